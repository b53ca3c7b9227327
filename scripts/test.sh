#!/usr/bin/env bash
# The project's test command (what CI runs): every Rust test, then the Python package's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked
python/test.sh
