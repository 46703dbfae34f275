# Every target installs what it needs: Debian packages (as root) and a venv in .venv.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
DEB_PKGS := iptables ipset ipvsadm iproute2 nftables kmod procps postgresql chromium
PYTEST_ARGS ?=

.PHONY: test lint bench deps venv clean

deps:
	@missing=""; for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "need root to install:$$missing" >&2; exit 1; fi; \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

test: deps venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check agent tests

bench: deps venv
	@for p in time tcpdump; do dpkg -s $$p >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq $$p >/dev/null; done
	$(PY) tests/bench/check_from.py
	$(PY) tests/bench/capture_rate.py
	$(PY) tests/bench/collector_load.py
	$(PY) tests/bench/agent_idle.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
