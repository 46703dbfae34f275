# syntax=docker/dockerfile:1
# loopback-agent: one image for the node agent (`loopback-agent run`, the default) and the
# collector (`loopback-agent collector`). Build: `make image` (docker build -t IMAGE .).
#
# Base: pinned by tag to the interpreter the test suite runs on, not by digest. A digest
# pin (FROM python:3.11.7-slim-bookworm@sha256:<index digest>, both stages) makes the base
# immutable; it must be read from the registry when releasing (`docker buildx imagetools
# inspect python:3.11.7-slim-bookworm`, the "Digest:" of the multi-platform index). Not
# pinned yet because no registry was reachable where this was last changed, and a digest
# copied from elsewhere unverified may be a single-platform manifest or an older push of
# the tag; tests/test_deploy.py accepts the pinned form as soon as it is added.

# -- builder: every wheel the image installs ---------------------------------------------
FROM python:3.11.7-slim-bookworm AS builder
WORKDIR /src
# Dependencies first (their layer survives changes to agent/): exactly the files
# requirements.lock names, each checked against its sha256 (--require-hashes), and wheels
# only (--only-binary), so what is installed is byte for byte what was hashed — nothing is
# built from a source archive. [kube]: the agent reads Services, its Node and Ingresses
# from the API; [postgres]: the collector can use PostgreSQL (LOOPBACK_AGENT_DB).
COPY requirements.lock requirements-build.lock ./
RUN pip download --no-cache-dir --require-hashes --only-binary=:all: --no-deps \
        --dest /wheels -r requirements.lock \
    && cp requirements.lock /wheels/ \
    && pip install --no-cache-dir --require-hashes --only-binary=:all: --no-deps \
        -r requirements-build.lock
# The agent's own wheel, from the build context only (.dockerignore keeps the rest out),
# built with the hashed setuptools above and no build isolation: nothing else is fetched.
COPY pyproject.toml README.md LICENSE ./
COPY agent ./agent
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

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
# --no-index: nothing fetched here; the dependencies' hashes are checked again.
# /opt/loopback-agent/bin/loopback-agent: the agent at a fixed path, for what runs it by
# path rather than through PATH (node-problem-detector's custom plugin: daemonset/npd/);
# the build fails if pip put no loopback-agent on PATH.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels --require-hashes \
        --only-binary=:all: --no-deps -r /wheels/requirements.lock \
    && pip install --no-cache-dir --no-index --no-deps /wheels/loopback_agent-*.whl \
    && mkdir -p /opt/loopback-agent/bin \
    && ln -s "$(command -v loopback-agent)" /opt/loopback-agent/bin/loopback-agent
# No .pyc writes (the pods run with a read-only root filesystem); logs unbuffered.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# No USER: the agent must run as root (uid 0 with only NET_ADMIN and NET_RAW, set by the
# DaemonSet); the collector's pod spec sets runAsUser/runAsNonRoot 65532 itself.
# 9808: the agent's /metrics and /healthz; 8080: the collector.
EXPOSE 9808 8080
ENTRYPOINT ["loopback-agent"]
CMD ["run"]
