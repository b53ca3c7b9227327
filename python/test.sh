#!/usr/bin/env bash
# Builds the `starling` Python package into a virtual environment and runs its tests (pytest).
# The environment is $STARLING_VENV, else python/.venv, made here with requirements-test.txt
# (maturin, numpy, pytest, torch from PyPI) when it does not exist yet.
set -euo pipefail
cd "$(dirname "$0")"
venv="${STARLING_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -r requirements-test.txt
fi
# An editable install into that environment: the compiled module lands in python/starling/,
# next to the sources.
export VIRTUAL_ENV="$(cd "$venv" && pwd)"
"$venv/bin/maturin" develop --locked --quiet
"$venv/bin/python" -m pytest tests -q
