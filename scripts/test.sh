#!/usr/bin/env bash
# The project's test command: every test on the CPU (GPU trials are listed as ignored without one).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked "$@"
