#!/usr/bin/env bash
# The main job: set up .venv, build the C++ kernels, then run `mixprec demo` (extra arguments are passed on).
# Setting up says what it does and reports every 15 s, so a first run (torch and the dev
# dependencies: minutes) is not a long silence; pip's log is shown if it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/mixprec ]; then
  echo "mixprec demo: checking .venv (pip, quiet)..."
else
  echo "mixprec demo: first run: creating .venv and installing torch==2.13.0 and mixprec with its dev extras (a few minutes)..."
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$SECONDS
bash scripts/venv.sh >"$log" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  sleep 1
  elapsed=$((SECONDS - start))
  if kill -0 "$pid" 2>/dev/null && [ $((elapsed % 15)) -eq 0 ]; then
    echo "  still installing ($elapsed s)..."
  fi
done
if ! wait "$pid"; then
  echo "mixprec demo: error: setting up .venv failed after $((SECONDS - start)) s; the installer said:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
echo "mixprec demo: .venv ready ($((SECONDS - start)) s)"
# The C++ kernels now, with progress lines (about 30 s once per environment), not silently in the
# first mode; without a compiler the demo runs mixprec's fallbacks (same results, slower).
.venv/bin/mixprec build-kernels || echo "mixprec demo: going on without mixprec's C++ kernels (their fallbacks serve)"
exec .venv/bin/mixprec demo "$@"
