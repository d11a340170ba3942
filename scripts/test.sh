#!/usr/bin/env bash
# The test command: set up .venv, build the C++ kernels, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
# The C++ kernels now, with progress lines, so that no test pauses silently for the build;
# without a compiler the tests run mixprec's fallbacks (same results) and skip the kernels' own
# tests. In CI (MIXPREC_REQUIRE_NATIVE=1, which .ci/run sets; unset, CI=true) a failed build
# fails the run, and so do the kernels' tests (tests/_native_required.py).
if ! .venv/bin/mixprec build-kernels; then
    require="${MIXPREC_REQUIRE_NATIVE:-${CI:-}}"
    case "${require,,}" in
        1 | true)
            echo "scripts/test.sh: the C++ kernels did not build, and this run requires them (MIXPREC_REQUIRE_NATIVE=1, or CI=true)" >&2
            exit 1 ;;
    esac
    echo "scripts/test.sh: testing without mixprec's C++ kernels (their fallbacks serve)"
fi
exec .venv/bin/python -m pytest "$@"
