#!/usr/bin/env bash
# One command for a CUDA machine: build mixprec's kernels, run the CUDA tests (-m cuda), the
# fake-CUDA tier, benchmarks/gpu.py and benchmarks/gemm_table.py (per recipe and shape: TFLOPS, ratio
# to bf16, error against fp32); write benchmarks/gpu-<device name>.md and print a verdict.
# Without a CUDA GPU: run the fake-CUDA tier only, say so, exit 0 (when the tier passes).
# Python: $PYTHON if set, else .venv (created by scripts/venv.sh if missing), else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
FAKE_TIER=(tests/engine/test_cuda_fake_autocast.py tests/fp8/test_cuda_fake_fp8.py tests/scaling/test_cuda_fake_scaling.py
           tests/fp8/test_cuda_fake_blocks.py tests/fp8/test_native_gemm.py tests/fp8/test_swizzle.py
           tests/fp8/test_grouped_native.py)
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; }
cuda_python() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

if ! has_gpu; then
  PY=${PYTHON:-}
  if [ -z "$PY" ]; then
    if [ ! -x .venv/bin/python ]; then
      echo "gpu-check: no CUDA GPU and no .venv: setting it up (scripts/venv.sh, a few minutes)..."
      bash scripts/venv.sh || { echo "gpu-check: error: scripts/venv.sh failed; set PYTHON to a Python with torch and pytest" >&2; exit 1; }
    fi
    PY=.venv/bin/python
  fi
  if ! "$PY" -c "import torch, pytest" 2>/dev/null; then
    echo "gpu-check: error: $PY has no torch or pytest; run bash scripts/venv.sh or set PYTHON to a Python with both" >&2
    exit 1
  fi
  echo "gpu-check: no CUDA GPU: running the fake-CUDA tier with $PY"
  PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest "${FAKE_TIER[@]}" -q -p no:cacheprovider
  rc=$?
  echo "gpu-check: fake-CUDA tier $([ $rc -eq 0 ] && echo passed || echo FAILED) ($((SECONDS - start)) s); the GPU part (kernels, -m cuda tests, benchmarks/gpu.py) needs a CUDA GPU: run this script on one"
  exit $rc
fi

# A Python whose torch sees the GPU: $PYTHON, .venv, python3 (offline machines), else set up .venv.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && cuda_python .venv/bin/python; then PY=.venv/bin/python
  elif cuda_python python3 && python3 -c "import pytest" 2>/dev/null; then PY=python3
  else
    echo "gpu-check: setting up .venv (scripts/venv.sh: torch==2.13.0 with CUDA from PyPI, a few minutes)..."
    bash scripts/venv.sh || { echo "gpu-check: error: scripts/venv.sh failed (no network? set PYTHON to a Python with CUDA torch and pytest)" >&2; exit 1; }
    PY=.venv/bin/python
  fi
fi
if ! cuda_python "$PY"; then
  echo "gpu-check: error: $PY's torch does not see the GPU ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1)); install a CUDA build of torch==2.13.0 or set PYTHON" >&2
  exit 1
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
device=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
slug=$(printf '%s' "$device" | tr -c 'A-Za-z0-9._-' '-')
log=benchmarks/gpu-$slug.log
: >"$log"
echo "gpu-check: $device, $("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'); log: $log"

step() {  # step NAME TIMEOUT COMMAND...: run, log, remember the outcome
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  local part line rc
  part=$(mktemp)
  echo "== $name" | tee -a "$log"
  timeout "$limit" "$@" >"$part" 2>&1
  rc=$?
  cat "$part" >>"$log"
  line=$(grep -E "[0-9]+ (passed|failed|error)" "$part" | tail -n 1)
  rm -f "$part"
  results+=("$(printf '%-26s %s (%d s) %s' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc")" $((SECONDS - t0)) "$line")")
  return $rc
}
results=()
status=0
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
step "build kernels" 240 "$PY" -m mixprec build-kernels || echo "gpu-check: going on with mixprec's fallbacks"
step "CUDA tests (-m cuda)" 180 "${PYTEST[@]}" -m cuda tests || status=1
step "fake-CUDA tier" 240 "${PYTEST[@]}" "${FAKE_TIER[@]}" || status=1
out=benchmarks/gpu-$slug.md
step "benchmarks/gpu.py" 300 "$PY" benchmarks/gpu.py --device cuda --step-costs --fp8 --out "$out" || status=1
step "GEMM table" 150 "$PY" benchmarks/gemm_table.py --device cuda --budget 100 --out "$out" --append || status=1
if "$PY" -c "import vllm" >/dev/null 2>&1; then  # (a vLLM built for CUDA in this Python: serve the fp8 export)
  step "vLLM serves the fp8 export" 150 "${PYTEST[@]}" -m vllm tests/export/test_export_vllm.py \
    -k "fp8_export or unquantized_control" || status=1
else
  results+=("SKIPPED vLLM serving: no vllm in $PY (pip install vllm there to serve the fp8 export)")
fi

echo
echo "================ gpu-check verdict: $device ($((SECONDS - start)) s) ================"
printf '%s\n' "${results[@]}"
if [ -s "$out" ]; then
  echo "--- $out"
  cat "$out"
fi
echo "gpu-check: $([ $status -eq 0 ] && echo "every step passed" || echo "SOME STEP FAILED: see $log")"
exit $status
