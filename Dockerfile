# moeserve images. Two targets:
#   docker build --target cpu  -t moeserve:cpu .    (Debian 12, CPU backend only)
#   docker build --target cuda -t moeserve:cuda .   (CUDA runtime + cuBLAS/NCCL, sm_90 with PTX)
# Both run `moeserve` (the HTTP server once it lands; `moeserve generate` today) as an
# unprivileged user, with models mounted at /models.

# ---- CPU build -----------------------------------------------------------------------------
FROM debian:bookworm AS build-cpu
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake pkg-config libjansson-dev libpcre2-dev \
        libuv1-dev && rm -rf /var/lib/apt/lists/*
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

FROM debian:bookworm-slim AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends \
        libjansson4 libpcre2-8-0 libuv1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* && useradd --system --uid 10001 moeserve
COPY --from=build-cpu /src/build/moeserve /usr/local/bin/moeserve
COPY models /models
USER moeserve
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/moeserve"]

# ---- CUDA build ----------------------------------------------------------------------------
FROM nvidia/cuda:12.6.3-devel-ubuntu24.04 AS build-cuda
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake pkg-config libjansson-dev libpcre2-dev \
        libuv1-dev libnccl-dev && rm -rf /var/lib/apt/lists/*
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
RUN apt-get update && apt-get install -y --no-install-recommends \
        libjansson4 libpcre2-8-0 libuv1t64 libnccl2 \
        libcublas-12-6 && rm -rf /var/lib/apt/lists/* && useradd --system --uid 10001 moeserve
COPY --from=build-cuda /src/build/moeserve /usr/local/bin/moeserve
COPY models /models
# The GPU image serves on the GPU unless told otherwise (--device cpu).
ENV MOESERVE_DEVICE=cuda
USER moeserve
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/moeserve"]
