#!/usr/bin/env bash
# The test command: set up .venv, build the C++ kernels, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
# The C++ kernels now, with progress lines, so that no test pauses silently for the build;
# without a compiler the tests run mixprec's fallbacks (same results).
.venv/bin/mixprec build-kernels || echo "scripts/test.sh: testing without mixprec's C++ kernels (their fallbacks serve)"
exec .venv/bin/python -m pytest "$@"
