# syntax=docker/dockerfile:1
# The drafter image: `drafter serve` on an NVIDIA GPU node.
#   docker build -t ghcr.io/drafter/drafter:0.1.0 .
#   docker run --gpus 1 -e DRAFTER_HOST=0.0.0.0 -v /path/to/models:/models:ro \
#       -p 50051:50051 -p 5555:5555 ghcr.io/drafter/drafter:0.1.0 --model /models/head ...
# torch comes from PyPI as a CUDA build that carries its own CUDA libraries
# (set PIP_EXTRA_INDEX_URL as a build arg for another CUDA flavour); the base
# image gives the NVIDIA container runtime its settings and Ubuntu 24.04 gives
# Python 3.12. The tag is pinned; pin the digest too in your own registry.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build
ARG PIP_EXTRA_INDEX_URL=""
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/drafter
ENV PATH=/opt/drafter/bin:$PATH
WORKDIR /src
# Sources only (see .dockerignore); the gRPC stubs are generated from proto/
# by the package build, so proto/ must be in the context.
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install . \
 && drafter --help > /dev/null

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 drafter \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /tmp --shell /usr/sbin/nologin drafter
COPY --from=build /opt/drafter /opt/drafter
# The root filesystem is read-only in Kubernetes: no bytecode files, caches
# and HOME under /tmp (an emptyDir there).
ENV PATH=/opt/drafter/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.cache/triton
# Numeric, so that the kubelet can verify runAsNonRoot.
USER 10001:10001
WORKDIR /tmp
# grpc, health (grpc.health.v1, plaintext), zmq, metrics
EXPOSE 50051 50052 5555 9400
# SIGTERM starts the drain: in-flight calls finish, new ones get UNAVAILABLE,
# health turns NOT_SERVING; `drafter serve` is PID 1 and handles it itself.
STOPSIGNAL SIGTERM
ENTRYPOINT ["drafter", "serve"]
