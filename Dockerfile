# syntax=docker/dockerfile:1
#
# relayd daemon image.
#
#   docker build -t relayd:0.1.0 .          (BuildKit: the install bind-mounts the
#                                            checkout; podman/buildah: --format docker
#                                            keeps the HEALTHCHECK)
#
# Run it on the host's IPC namespace, which stages need to map the arena, with
# the socket directory shared (deploy/README.md, "Docker"):
#
#   docker run -d --name relayd --ipc=host -v /run/relayd:/run/relayd relayd:0.1.0
#
# torch: a base image that already has torch keeps it (pass one as BASE_IMAGE).
# On the default base, pip takes torch from the index: PyPI's default Linux
# build is the CUDA one, which bundles the CUDA runtime (the driver comes from
# the host through the NVIDIA container runtime). For a CPU-only image add the
# CPU constraints (torch==...+cpu) and PyTorch's CPU wheel index; pip reads both
# from the environment, so the install line stays the README's:
#
#   docker build -t relayd:0.1.0-cpu \
#     --build-arg PIP_CONSTRAINT=constraints/cpu.txt \
#     --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# BASE_IMAGE must be Debian-based with python3.11 and a pip that may install into
# that Python: the python:* images qualify. Debian's own python3 refuses
# system-wide installs (PEP 668, "externally-managed-environment"); on such a
# base create a venv first and put its bin/ on PATH.

# Pinned by tag. Pin by digest as well (python:3.11-slim-bookworm@sha256:...)
# where your registry mirror lets you resolve it; tags are moved by rebuilds.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# Optional pip settings for the install step (see above); unset by default.
ARG PIP_CONSTRAINT
ARG PIP_EXTRA_INDEX_URL

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RELAYD_SOCKET=/run/relayd/relayd.sock \
    RELAYD_PEER_NOTICE_PORT=9093

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Shared libraries the Mooncake transfer engine links against and does not bundle
# (RDMA verbs, NUMA, HTTP metadata), plus the verbs providers (mlx5, efa, ...)
# without which libibverbs finds no RDMA device (mooncake_protocol = "rdma").
# DL3008 (apt versions): the Debian release is fixed by the base tag; pinning
# package versions would break the build at every Debian security update, which
# removes the previous version from the mirror.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*

# The daemon's user; uid/gid 10001 match deploy/k8s (runAsUser, allow_gid).
RUN groupadd --system --gid 10001 relayd \
    && useradd --system --uid 10001 --gid relayd --home-dir /nonexistent \
        --no-create-home --shell /usr/sbin/nologin relayd \
    && install -d -o relayd -g relayd -m 0750 /run/relayd

WORKDIR /src
# The checkout is bind-mounted for the install only, read-write so that the build
# can write its scratch files (discarded with the mount): no copy of the source
# stays in any layer of the image, only the empty mount point.
# Same command as README.md's install section (tests/deploy checks they match).
# DL3013 (pip versions): these are the local packages, whose dependencies are
# bounded in pyproject.toml; PIP_CONSTRAINT pins further where wanted.
# hadolint ignore=DL3013
RUN --mount=type=bind,source=.,target=/src,rw pip install --no-cache-dir ./client '.[mooncake]'

WORKDIR /
USER 10001:10001

# metrics, gRPC health, peer service, peer notices (fixed above, as in deploy/k8s,
# so that a port mapping or firewall can name it)
EXPOSE 9090 9091 9092 9093

# Exits 0 when the daemon's gRPC health says SERVING. Kubernetes ignores this and
# uses the probes in deploy/k8s/daemonset.yaml. The OCI image format has no
# HEALTHCHECK: podman and buildah (OCI by default) drop it with a warning unless
# the image is built with --format docker; docker build keeps it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["relayd", "health"]

STOPSIGNAL SIGTERM
ENTRYPOINT ["relayd", "serve"]
