# pyproxy — two commands matter: `make demo` runs the product, `make test` runs the suite.
# Both install what they need on a fresh Debian machine (as root).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
APT_PACKAGES := nftables libnftables1 python3-nftables iproute2 conntrack
DEBIAN_NFT := /usr/lib/python3/dist-packages/nftables

.PHONY: all deps venv test unit lint bench demo clean

all: test

# System packages: installed only when something is missing (apt is slow, and offline runs
# with everything present must not need it).
deps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# The virtualenv holds the package and its test extras. Debian's nftables binding is the one
# that matches the installed libnftables; only that package is linked in, because putting all
# of dist-packages on PYTHONPATH would shadow the virtualenv's own packages.
$(BIN)/pyproxy: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

venv: deps $(BIN)/pyproxy
	@site=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  [ -e "$$site/nftables" ] || ln -s $(DEBIAN_NFT) "$$site/nftables"

lint: venv
	$(BIN)/ruff check pyproxy tests
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest -q -m 'not netns'

test: venv lint
	$(BIN)/pytest -q

demo: venv
	scripts/demo.sh

bench: venv
	$(BIN)/python bench/bench_sync.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
