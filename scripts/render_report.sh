#!/usr/bin/env bash
# Opens a report's index.html in headless Chromium as a person would: saves a screenshot, and
# reads what the page shows from the rendered DOM (never from the HTML text).
#
#   scripts/render_report.sh DIR [PNG]
#
# PNG defaults to DIR/index.png. Prints one JSON line read from the rendered page: each trial's
# name, verdict, plots (with their rendered width and height) and visible failure text, the
# changes against the baseline, the page's size and the milliseconds from navigation until its
# layout was done (`layout_ms`). Fails when the page is 2 MB or more. The layout time is a figure
# to read, never a verdict: it depends on the machine and what else runs on it (speed is measured
# by the benchmarks, docs/PERFORMANCE.md).
#
# Environment: CHROMIUM names the browser (default: chromium, chromium-browser or google-chrome
# on PATH; `apt-get install chromium` gives /usr/bin/chromium).
set -euo pipefail

dir="${1:?usage: scripts/render_report.sh DIR [PNG]}"
page="$dir/index.html"
png="$(realpath -m "${2:-$dir/index.png}")"
[[ -f "$page" ]] || { echo "render_report.sh: $page: no such file; run ckpt-harness run --report $dir first" >&2; exit 2; }

browser="${CHROMIUM:-}"
if [[ -z "$browser" ]]; then
    for candidate in chromium chromium-browser google-chrome; do
        if command -v "$candidate" >/dev/null; then
            browser="$candidate"
            break
        fi
    done
fi
[[ -n "$browser" ]] || { echo "render_report.sh: no Chromium on PATH; install it (apt-get install chromium) or set CHROMIUM" >&2; exit 2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
flags=(--headless --no-sandbox --disable-gpu --disable-background-networking
    --disable-component-update --disable-sync --no-first-run --hide-scrollbars
    --user-data-dir="$work/profile")

# The probe runs in a copy of the page, after the last section: it forces layout, then writes
# what it found, base64-encoded JSON, into the DOM that --dump-dom prints.
probe='<script>
(() => {
  const visible = e => { const r = e.getBoundingClientRect(); return { width: Math.round(r.width), height: Math.round(r.height) }; };
  const trials = [...document.querySelectorAll("section.trial")].map(s => ({
    name: s.dataset.trial,
    verdict: s.querySelector("h2 .badge").innerText,
    plots: [...s.querySelectorAll("figure.plot")].map(f => ({ kind: f.classList[1], caption: f.querySelector("figcaption").innerText, ...visible(f.querySelector("svg")) })),
    failures: [...s.querySelectorAll("tr.failure")].map(r => r.innerText),
    checks: [...s.querySelectorAll("tr.check")].map(r => r.innerText.split("\t").slice(0, 2).join(" ")),
  }));
  const changes = document.getElementById("changes");
  const first = document.querySelector("section.trial");
  const result = {
    title: document.title,
    trials,
    changes: changes.innerText,
    changes_first: !!first && !!(changes.compareDocumentPosition(first) & Node.DOCUMENT_POSITION_FOLLOWING),
    regressions: [...document.querySelectorAll("#changes tr.regression")].map(r => r.innerText),
    layout_ms: Math.round(performance.now()),
  };
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = btoa(unescape(encodeURIComponent(JSON.stringify(result))));
  document.body.appendChild(pre);
})();
</script>'
awk -v probe="$probe" '{ if (index($0, "</body>")) print probe; print }' "$page" >"$work/probe.html"

"$browser" "${flags[@]}" --dump-dom "file://$work/probe.html" 2>"$work/dom.log" >"$work/dom.html" ||
    { cat "$work/dom.log" >&2; exit 1; }
encoded="$(sed -n 's:.*<pre id="probe">\([A-Za-z0-9+/=]*\)</pre>.*:\1:p' "$work/dom.html")"
[[ -n "$encoded" ]] || { echo "render_report.sh: the page's probe did not run; the browser said:" >&2; cat "$work/dom.log" >&2; exit 1; }
json="$(base64 -d <<<"$encoded")"

"$browser" "${flags[@]}" --window-size=1400,2400 --screenshot="$png" "file://$(cd "$(dirname "$page")" && pwd)/index.html" \
    2>"$work/shot.log" >/dev/null || { cat "$work/shot.log" >&2; exit 1; }
[[ -s "$png" ]] || { echo "render_report.sh: no screenshot was written to $png" >&2; exit 1; }

bytes=$(wc -c <"$page")
layout_ms=$(sed -n 's/.*"layout_ms":\([0-9]*\).*/\1/p' <<<"$json")
echo "${json%\}},\"bytes\":$bytes,\"screenshot\":\"$png\"}"
echo "render_report.sh: $page: $bytes bytes, laid out in $layout_ms ms" >&2
status=0
if ((bytes >= 2 * 1024 * 1024)); then
    echo "render_report.sh: $page is $bytes bytes, 2 MB or more" >&2
    status=1
fi
exit "$status"
