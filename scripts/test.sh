#!/usr/bin/env bash
# The project's test command: every test on the CPU (GPU trials are listed as ignored without one).
# The checkpoint tests kill saves at chosen system calls with strace, the report's test opens
# it in headless Chromium, and engine/tests/cpu_caches.rs bind-mounts other CPU caches in a
# mount namespace (util-linux's unshare, mount): all are installed when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v strace >/dev/null || missing+=(strace)
command -v unshare >/dev/null || missing+=(util-linux)
command -v mount >/dev/null || missing+=(mount)
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null &&
    ! command -v google-chrome >/dev/null && [[ -z "${CHROMIUM:-}" ]]; then
    missing+=(chromium)
fi
if ((${#missing[@]})); then
    sudo=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}"
fi
cargo test --workspace --locked "$@"
