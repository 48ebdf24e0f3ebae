# syntax=docker/dockerfile:1
#
# carve-worker on NVIDIA's CUDA + cuDNN runtime image. The worker finds GPUs through NVML
# (libnvidia-ml, mounted by the NVIDIA Container Toolkit together with /dev/nvidia*), and
# the engine's CUDA backend loads CUDA 12.6 / cuDNN / cuBLAS at run time. Without a GPU,
# run it with --sim-gpus (e.g. 2x16GiB): the cpu backend and simulated GPUs.
#
# Every attempt runs in its own OCI container, started with runc (installed below): the
# worker runs as root and the container that runs it must be privileged, in the host's
# cgroup namespace (and, on real GPUs, its pid namespace), e.g.
#   docker run --privileged --cgroupns=host --pid=host --gpus all ...
# (deploy/README.md, "Attempts in containers"). Without that, start it with
# --insecure-no-sandbox, and every attempt it runs says it is not contained.
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
# runc: the OCI runtime every attempt's container is started with (the worker finds it on
# PATH; --oci-runtime names another), from Ubuntu's own packages.
# /var/lib/carve and its checkpoints/ are root's and 0711: a container's root directory
# lives below them (checkpoints/sandbox/bundles/) and belongs to its tenant's host uid,
# which must pass through (never list) every directory above it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates procps tini runc \
 && rm -rf /var/lib/apt/lists/* \
 && runc --version \
 && install -d -m 0711 /var/lib/carve /var/lib/carve/checkpoints
# The engine's attempt process is this same binary (`carve-worker attempt ...`, found
# through /proc/self/exe), run inside the attempt's container, which sees the image's
# system directories read-only. The worker stops an attempt through runc (`kill --all`);
# procps' kill(1) stays for attempts run with --insecure-no-sandbox.
COPY --from=builder /out/carve-worker /usr/local/bin/carve-worker
# The guard the worker preloads into programs it runs on real GPUs (--guard-library's
# default: next to carve-worker).
COPY --from=builder /out/libcarve_guard.so /usr/local/bin/libcarve_guard.so

# The base image sets NVIDIA_DRIVER_CAPABILITIES=compute,utility (utility brings NVML).
# Which GPUs the container sees is the runtime's choice: `docker run --gpus ...`, or the
# Kubernetes device plugin for `nvidia.com/gpu` limits.
ENV RUST_LOG=info

# Root, deliberately (the one image here that is): runc makes each attempt's user, pid,
# mount and network namespaces, its cgroup under /carve/ and its mounts, and the worker
# gives each job's directories to its tenant's host uid (from 1000000000 up). The
# attempts themselves never run as root: each is uid 1000 in its own user namespace,
# mapped to its tenant's range, with no capabilities.
USER root
WORKDIR /var/lib/carve
# Checkpoints: keep them on a volume so an attempt resumed on this node finds them. The
# scheduler's checkpoint_dir must name the same path (it is the fallback resume location).
# The same directory holds runc's state of the running containers (checkpoints/sandbox/):
# a worker that comes back with the same volume and --hostname ends the containers its
# predecessor left running.
VOLUME ["/var/lib/carve"]

# The worker listens on nothing; it dials the scheduler (CARVE_SCHEDULER) with a worker
# token (--token-file), reconnecting with backoff. Its liveness is the process itself.
HEALTHCHECK NONE

# tini reaps orphans and forwards SIGTERM, on which the worker stops its attempts' containers
# and exits. In the host's pid namespace (--pid=host, hostPID) tini is not PID 1: set
# TINI_SUBREAPER=1 there, as the compose and Kubernetes files do.
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/carve-worker"]
CMD ["--checkpoint-dir", "/var/lib/carve/checkpoints"]
