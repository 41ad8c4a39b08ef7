#!/usr/bin/env bash
# Opens the memory traces of `ckpt-harness run --memory-trace` with PyTorch's own tools: for
# every snapshot (*.pickle) under DIR, `python -m torch.cuda._memory_viz`'s
#   trace_plot  the memory_viz page's Active Memory Timeline, written beside it as .html
#   stats       the allocator's segments, whose sizes torch checks add up
#   trace       every allocation and free, written beside it as .trace.txt
#
#   scripts/memory_viz.sh DIR
#
# Where python3 cannot import torch, says so and exits 0: there is nothing to render with.
# Exit status 1 if torch could not read a snapshot. PYTHON picks the interpreter.
set -euo pipefail
dir="${1:?usage: scripts/memory_viz.sh DIR}"
python="${PYTHON:-python3}"
if ! "$python" -c "import torch" >/dev/null 2>&1; then
    echo "memory_viz.sh: $python cannot import torch; the snapshots under $dir were not rendered"
    exit 0
fi
# One interpreter for every snapshot: the functions the module's command line calls for
# `trace_plot`, `stats` and `trace`, in that order (importing torch once per snapshot and
# command would take most of the time).
"$python" - "$dir" <<'PY'
import pickle
import sys
from pathlib import Path

import torch
from torch.cuda import _memory_viz as viz

snapshots = sorted(Path(sys.argv[1]).rglob("*.pickle"))
failed = 0
for snapshot in snapshots:
    base = snapshot.with_suffix("")
    try:
        with open(snapshot, "rb") as f:
            data = pickle.load(f)
        base.with_suffix(".html").write_text(viz.trace_plot(data))
        base.with_suffix(".stats.txt").write_text(viz.segsum(data) + "\n")
        base.with_suffix(".trace.txt").write_text(viz.trace(data) + "\n")
        print(f"ok      {snapshot}")
    except Exception as e:
        failed += 1
        print(f"FAILED  {snapshot}: {e!r}", file=sys.stderr)
print(f"memory_viz.sh: {len(snapshots)} snapshots read by torch {torch.__version__}")
sys.exit(1 if failed else 0)
PY
