# syntax=docker/dockerfile:1
# loopback-agent: one image for the node agent (`loopback-agent run`, the default) and the
# collector (`loopback-agent collector`). Build: `make image` (docker build -t IMAGE .).
#
# Base: pinned by tag to the interpreter the test suite runs on. A digest pin
# (python:3.11.7-slim-bookworm@sha256:...) makes rebuilds byte-identical; take it from
# `docker buildx imagetools inspect python:3.11.7-slim-bookworm` when releasing.

# -- builder: the agent's wheel and its dependencies' wheels -----------------------------
FROM python:3.11.7-slim-bookworm AS builder
WORKDIR /src
# Only what the build reads (the rest is kept out by .dockerignore as well).
COPY pyproject.toml README.md ./
COPY agent ./agent
# [kube]: the agent reads Services, its Node and Ingresses from the API;
# [postgres]: the collector can use PostgreSQL (LOOPBACK_AGENT_DB) for several replicas.
# All as wheels, so the final stage installs offline and carries no build tools.
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[kube,postgres]"

# -- final --------------------------------------------------------------------------------
FROM python:3.11.7-slim-bookworm
# The node tools the probes run (read-only: they only dump state). Pinned to Debian
# bookworm's versions; a bookworm security update that replaces one of them makes this
# step fail, which is the signal to bump the pin.
#   iptables: iptables-save, -legacy-save and -nft-save (whichever backend holds
#   kube-proxy's chains); ipset: `ipset save`; ipvsadm: `ipvsadm -Ln`; iproute2: `ip`
#   (bundle); nftables: `nft`.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        iptables=1.8.9-2 \
        ipset=7.17-1 \
        ipvsadm=1:1.31-1+b1 \
        iproute2=6.1.0-3 \
        nftables=1.0.6-2+deb12u2 \
    && rm -rf /var/lib/apt/lists/*
# Installed from the builder's wheels through a bind mount (BuildKit, the default builder
# since Docker 23; DOCKER_BUILDKIT=0 cannot build this), so the wheels take no layer;
# --no-index: exactly the versions resolved in the builder, nothing fetched here.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/*.whl
# No .pyc writes (the pods run with a read-only root filesystem); logs unbuffered.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# No USER: the agent must run as root (uid 0 with only NET_ADMIN and NET_RAW, set by the
# DaemonSet); the collector's pod spec sets runAsUser/runAsNonRoot 65532 itself.
# 9808: the agent's /metrics and /healthz; 8080: the collector.
EXPOSE 9808 8080
ENTRYPOINT ["loopback-agent"]
CMD ["run"]
