# syntax=docker/dockerfile:1
#
# carve-scheduler (and the `carve` CLI, for `carve admin ...` inside the container).
# Build from the repository root:
#   docker build -f deploy/docker/scheduler.Dockerfile -t carve-scheduler .

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
# The commit carve_build_info reports (.git is not in the build context):
#   docker build --build-arg CARVE_GIT_COMMIT=$(git rev-parse HEAD) ...
ARG CARVE_GIT_COMMIT=unknown
# The whole workspace (less what .dockerignore leaves out): cargo needs every member's
# manifest, carve-scheduler embeds migrations/ (sqlx::migrate!), the CLI embeds examples/.
COPY . .
# protox compiles the .proto files in pure Rust: no protoc needed. SQLite is bundled.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p carve-scheduler -p carve-cli \
 && install -D -m 0755 target/release/carve-scheduler /out/carve-scheduler \
 && install -D -m 0755 target/release/carve /out/carve

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 carve \
 && useradd --system --uid 10001 --gid carve --home-dir /var/lib/carve --shell /usr/sbin/nologin carve \
 && install -d -o carve -g carve -m 0700 /var/lib/carve
COPY --from=builder /out/carve-scheduler /out/carve /usr/local/bin/
# Defaults as a config file (named by CMD) rather than CARVE_* variables, so a mounted
# config file still wins over them: flags > CARVE_* environment > config file > built-in.
# Not CARVE_CONFIG in ENV: the `carve` CLI reads that variable as its own config file.
COPY deploy/docker/scheduler.toml /etc/carve/scheduler.toml
ENV RUST_LOG=info

USER carve:carve
WORKDIR /var/lib/carve
VOLUME ["/var/lib/carve"]
# 7470: gRPC (jobs, cluster, admin, worker services, grpc.health.v1, reflection)
# 9470: Prometheus metrics, GET /metrics
EXPOSE 7470 9470

# The metrics endpoint (port 9470, as in the default config) answers from the scheduler's
# live state, so it is a better probe than a bare TCP connect (bash's /dev/tcp: no curl in
# the image). Kubernetes uses the gRPC health service instead (deploy/k8s).
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9470 && printf 'GET /metrics HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q '^carve_workers' <&3"]

# carve-scheduler drains on SIGINT and SIGTERM alike; tini forwards the signal.
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/carve-scheduler"]
# Arguments replace this CMD: keep --config in them to keep the defaults above.
CMD ["--config", "/etc/carve/scheduler.toml"]
