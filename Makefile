# The README's two commands: `make serve` and `make test`. Both work from a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a GPU host sets TORCH_SPEC to a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8000
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`, each pinned to its share of the CPUs; whole files
# go to one worker (their module fixtures start once), the longest first (conftest.py).
TEST_WORKERS ?= 2
# `make soak`: seconds of random load (`make test` runs a 30-second soak).
SOAK_SECONDS ?= 600

.PHONY: install serve test soak lint format clean promtool chromium redis-server docs

# The native CPU kernels are compiled against the venv's torch (setup.py), so the build
# runs without isolation, after torch and the build tools; editing a kernel source
# rebuilds them (and a failed build fails `make test`).
NATIVE_SOURCES := setup.py $(wildcard engine/ops/csrc/*)

$(VENV)/.installed: pyproject.toml $(NATIVE_SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH_SPEC)' 'setuptools>=68' ninja
	$(PY) -m pip install --quiet --no-build-isolation -e '.[dev]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/pagedserve serve --port $(PORT) --tool-call-parser hermes

lint: install
	$(VENV)/bin/ruff check engine server tests benchmarks setup.py
	$(VENV)/bin/ruff format --check engine server tests benchmarks setup.py
	$(VENV)/bin/mypy engine

format: install
	$(VENV)/bin/ruff check --fix engine server tests benchmarks setup.py
	$(VENV)/bin/ruff format engine server tests benchmarks setup.py

# $(call apt_install,COMMAND,PACKAGE): installs a Debian package when COMMAND is missing.
define apt_install
	@command -v $(1) >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $(2); }
endef

# promtool checks the metrics and alert rules; it comes from Debian's prometheus package.
promtool:
	$(call apt_install,promtool,prometheus)

# The responses store's tests run a real Redis, from Debian's redis-server package.
redis-server:
	$(call apt_install,redis-server,redis-server)

# The dashboard test drives headless Chromium, from Debian's chromium package.
chromium:
	$(call apt_install,chromium,chromium)

test: install lint promtool chromium redis-server
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

soak: install
	$(PY) -m tests.server.soak --duration $(SOAK_SECONDS)

# The documentation site from docs/ (MkDocs, Material theme) into site/; strict, so a broken
# link or a page missing from the nav fails it (tests/test_docs.py builds it too).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build site engine/ops/_C*.so
