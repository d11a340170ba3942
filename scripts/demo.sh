#!/usr/bin/env bash
# The main job: set up .venv, then run `mixprec demo` (extra arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
exec .venv/bin/mixprec demo "$@"
