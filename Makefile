.PHONY: run test bench setup

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/vlora serve

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python benchmarks/bench_cpu_generate.py
