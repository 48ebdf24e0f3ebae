# syntax=docker/dockerfile:1
#
# carve-worker on NVIDIA's CUDA + cuDNN runtime image. The worker finds GPUs through NVML
# (libnvidia-ml, mounted by the NVIDIA Container Toolkit together with /dev/nvidia*), and
# the engine's CUDA backend loads CUDA 12.6 / cuDNN / cuBLAS at run time. Without a GPU,
# run it with --sim-gpus (e.g. 2x16GiB): the cpu backend and simulated GPUs.
# Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t carve-worker .

ARG RUST_VERSION=1.95
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
# The whole workspace (less what .dockerignore leaves out): cargo needs every member's
# manifest, carve-scheduler embeds migrations/ (sqlx::migrate!), the CLI embeds examples/.
COPY . .
# Built on Debian bookworm (glibc 2.36), run on Ubuntu 24.04 (glibc 2.39): compatible.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p carve-worker -p carve-guard \
 && install -D -m 0755 target/release/carve-worker /out/carve-worker \
 && install -D -m 0755 target/release/libcarve_guard.so /out/libcarve_guard.so

FROM ${CUDA_IMAGE} AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates procps tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 carve \
 && useradd --system --uid 10001 --gid carve --home-dir /var/lib/carve --shell /usr/sbin/nologin carve \
 && install -d -o carve -g carve -m 0750 /var/lib/carve /var/lib/carve/checkpoints
# Every attempt runs as a child process of this same binary (`carve-worker attempt ...`,
# found through /proc/self/exe). The worker stops an attempt with kill(1) (SIGTERM, then
# SIGKILL after the grace period): procps provides it.
COPY --from=builder /out/carve-worker /usr/local/bin/carve-worker
# The guard the worker preloads into programs it runs on real GPUs (--guard-library's
# default: next to carve-worker).
COPY --from=builder /out/libcarve_guard.so /usr/local/bin/libcarve_guard.so

# The base image sets NVIDIA_DRIVER_CAPABILITIES=compute,utility (utility brings NVML).
# Which GPUs the container sees is the runtime's choice: `docker run --gpus ...`, or the
# Kubernetes device plugin for `nvidia.com/gpu` limits.
ENV RUST_LOG=info

USER carve:carve
WORKDIR /var/lib/carve
# Checkpoints: keep them on a volume so an attempt resumed on this node finds them. The
# scheduler's checkpoint_dir must name the same path (it is the fallback resume location).
VOLUME ["/var/lib/carve"]

# The worker listens on nothing; it dials the scheduler (CARVE_SCHEDULER) with a worker
# token (--token-file), reconnecting with backoff. Its liveness is the process itself.
HEALTHCHECK NONE

# tini reaps the attempt processes' orphans and forwards SIGTERM, on which the worker stops.
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/carve-worker"]
CMD ["--checkpoint-dir", "/var/lib/carve/checkpoints"]
