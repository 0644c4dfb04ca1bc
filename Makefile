.PHONY: run test bench setup demo-adapters

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/vlora serve

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python benchmarks/bench_cpu_generate.py

# rebuild the trained demo adapters shipped in vlora/adapters/demo_weights/ (a few minutes of CPU)
demo-adapters: setup
	nice -n 10 .venv/bin/vlora adapters demo --part text --out build/demo-adapters --ship
