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
status=0 count=0
while IFS= read -r -d '' snapshot; do
    count=$((count + 1))
    base="${snapshot%.pickle}"
    if "$python" -m torch.cuda._memory_viz trace_plot "$snapshot" -o "$base.html" &&
        "$python" -m torch.cuda._memory_viz stats "$snapshot" >"$base.stats.txt" &&
        "$python" -m torch.cuda._memory_viz trace "$snapshot" >"$base.trace.txt"; then
        echo "ok      $snapshot"
    else
        echo "FAILED  $snapshot" >&2
        status=1
    fi
done < <(find "$dir" -name '*.pickle' -print0 | sort -z)
echo "memory_viz.sh: $count snapshots read by torch $("$python" -c 'import torch; print(torch.__version__)')"
exit "$status"
