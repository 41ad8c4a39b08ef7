#!/usr/bin/env bash
# The project's test command: every test on the CPU (GPU trials are listed as ignored without one).
# The checkpoint tests kill saves at chosen system calls with strace: it is installed when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v strace >/dev/null; then
    sudo=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $sudo apt-get update -qq && $sudo apt-get install -y -qq strace
fi
cargo test --workspace --locked "$@"
