# moeserve images. Three targets:
#   docker build --target cpu     -t moeserve:cpu .      (Debian 12, CPU backend)
#   docker build --target cpu-mpi -t moeserve:cpu-mpi .  (the same with Open MPI and OpenSSH:
#                                                         multi-node, an MPIJob's pods)
#   docker build --target cuda    -t moeserve:cuda .     (CUDA 12.6 runtime + cuBLAS/NCCL)
# All run `moeserve serve` (the default command) as the numeric user 10001, listening on
# 0.0.0.0:8000 (MOESERVE_HOST/MOESERVE_PORT; every flag has such a variable), with the bundled
# model at /models/mohge-small (mount your own and pass --model /models/NAME).
# Stopping: SIGTERM starts a drain of --shutdown-grace seconds (30 by default; the server exits
# 0 when the last request ends), so give the container longer than that before the kill:
# `docker run --stop-timeout 40`, or `docker stop -t 40`; Kubernetes:
# terminationGracePeriodSeconds > --shutdown-grace (deploy/kubernetes).
# Health: `moeserve healthcheck` (exit 0 when /health answers 200), so no curl in the image.
# Base images are pinned to a point release (Debian 12.11; CUDA 12.6.3 on Ubuntu 24.04);
# apt packages are not pinned (see .hadolint.yaml). Labels: OCI image annotations; pass
# --build-arg VERSION=... REVISION=$(git rev-parse HEAD) CREATED=$(date -u +%FT%TZ).
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown

# ---- CPU build -----------------------------------------------------------------------------
FROM debian:12.11 AS build-cpu
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake pkg-config libjansson-dev libpcre2-dev libuv1-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY CMakeLists.txt ./
COPY engine engine
COPY kernels kernels
COPY server server
COPY proto proto
COPY bench bench
COPY tests tests
RUN cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMOESERVE_CUDA=OFF \
    && cmake --build build -j"$(nproc)" --target moeserve

FROM debian:12.11-slim AS cpu
ARG VERSION
ARG REVISION
ARG CREATED
LABEL org.opencontainers.image.title="moeserve (CPU)" \
      org.opencontainers.image.description="OpenAI-compatible inference server for Mixture-of-Experts models, CPU backend" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="docker.io/library/debian:12.11-slim"
RUN apt-get update && apt-get install -y --no-install-recommends \
        libjansson4 libpcre2-8-0 libuv1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 moeserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin moeserve
COPY --from=build-cpu /src/build/moeserve /usr/local/bin/moeserve
COPY models /models
WORKDIR /
ENV MOESERVE_HOST=0.0.0.0 \
    MOESERVE_PORT=8000
USER 10001:10001
EXPOSE 8000
STOPSIGNAL SIGTERM
# start-period: a large model takes minutes to load (/health is 503 until it is ready)
HEALTHCHECK --interval=30s --timeout=6s --start-period=600s --retries=3 \
    CMD ["/usr/local/bin/moeserve", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/moeserve"]
CMD ["serve"]

# ---- CPU with MPI --------------------------------------------------------------------------
# For deploy/kubernetes/overlays/multi-node-mpi (an MPIJob of the Kubeflow MPI Operator): the
# launcher pod runs `mpirun ... moeserve serve`, which starts the other ranks over ssh in the
# worker pods, where sshd runs as user 10001 on port 2222 with the keys the operator mounts at
# /home/moeserve/.ssh (deploy/mpi/sshd_config, deploy/mpi/ssh_config).
FROM build-cpu AS build-cpu-mpi
RUN apt-get update && apt-get install -y --no-install-recommends libopenmpi-dev \
    && rm -rf /var/lib/apt/lists/* \
    && cmake -S . -B build-mpi -DCMAKE_BUILD_TYPE=Release -DMOESERVE_CUDA=OFF -DMOESERVE_MPI=ON \
    && cmake --build build-mpi -j"$(nproc)" --target moeserve

FROM cpu AS cpu-mpi
LABEL org.opencontainers.image.title="moeserve (CPU, MPI)" \
      org.opencontainers.image.description="OpenAI-compatible inference server for Mixture-of-Experts models, CPU backend, several nodes over MPI"
USER 0
RUN apt-get update && apt-get install -y --no-install-recommends \
        openmpi-bin openssh-server openssh-client \
    && rm -rf /var/lib/apt/lists/* \
    && usermod --home /home/moeserve --shell /bin/sh moeserve \
    && mkdir -p /home/moeserve/.ssh \
    && chown -R 10001:10001 /home/moeserve
COPY deploy/mpi/sshd_config /etc/moeserve/sshd_config
COPY deploy/mpi/ssh_config /etc/ssh/ssh_config.d/moeserve.conf
COPY --from=build-cpu-mpi /src/build-mpi/moeserve /usr/local/bin/moeserve
USER 10001:10001
EXPOSE 8000 2222

# ---- CUDA build ----------------------------------------------------------------------------
FROM nvidia/cuda:12.6.3-devel-ubuntu24.04 AS build-cuda
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake pkg-config libjansson-dev libpcre2-dev libuv1-dev libnccl-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY CMakeLists.txt ./
COPY engine engine
COPY kernels kernels
COPY server server
COPY proto proto
COPY bench bench
COPY tests tests
RUN cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMOESERVE_CUDA=ON \
    && cmake --build build -j"$(nproc)" --target moeserve

FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04 AS cuda
ARG VERSION
ARG REVISION
ARG CREATED
LABEL org.opencontainers.image.title="moeserve (CUDA)" \
      org.opencontainers.image.description="OpenAI-compatible inference server for Mixture-of-Experts models, NVIDIA GPUs" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="docker.io/nvidia/cuda:12.6.3-runtime-ubuntu24.04"
RUN apt-get update && apt-get install -y --no-install-recommends \
        libjansson4 libpcre2-8-0 libuv1t64 libnccl2 libcublas-12-6 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 moeserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin moeserve
COPY --from=build-cuda /src/build/moeserve /usr/local/bin/moeserve
COPY models /models
WORKDIR /
# The GPU image serves on the GPU unless told otherwise (--device cpu).
ENV MOESERVE_HOST=0.0.0.0 \
    MOESERVE_PORT=8000 \
    MOESERVE_DEVICE=cuda
USER 10001:10001
EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=6s --start-period=600s --retries=3 \
    CMD ["/usr/local/bin/moeserve", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/moeserve"]
CMD ["serve"]
