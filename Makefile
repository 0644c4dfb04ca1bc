.PHONY: run test test-latest lock bench setup demo-adapters

# the virtualenv every target uses; CI points it at a fresh folder
VENV ?= .venv
export VENV

setup:
	bash scripts/setup.sh

run: setup
	$(VENV)/bin/vlora serve

# one test process per core (pytest-xdist), a module's tests in one process so that its fixtures are built once
test: setup
	$(VENV)/bin/python -m pytest -q -n auto --dist loadscope

# the suite on today's newest releases (a fresh virtualenv, nothing pinned but CPU torch): run before `make lock`
test-latest:
	v=$$(VENV=$$(mktemp -d)/venv bash scripts/lock.sh --latest) && $$v/bin/python -m pytest -q -n auto --dist loadscope

# re-resolve the dependencies into requirements.lock, then run the suite on it
lock:
	bash scripts/lock.sh
	rm -f $(VENV)/.vlora-installed
	$(MAKE) test

bench: setup
	$(VENV)/bin/python benchmarks/bench_cpu_generate.py

# rebuild the trained demo adapters shipped in vlora/adapters/demo_weights/ (a few minutes of CPU)
demo-adapters: setup
	nice -n 10 $(VENV)/bin/vlora adapters demo --part text --out build/demo-adapters --ship
