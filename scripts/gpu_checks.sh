#!/usr/bin/env bash
# Every check that needs a GPU, in one run (about 8 minutes on one GPU):
#   1. the Triton kernels compiled and cross-checked against the torch backend (gpu_check_triton.sh);
#   2. the memory benchmark, the peak read by torch.cuda.max_memory_allocated (kvpolicy bench memory);
#   3. every preset's decode at 32k and 128k tokens on a random layer stack shaped like an 8B model's
#      (bfloat16, head_dim 128, 8 kv heads, 32 query heads), against DynamicCache with SDPA and
#      dequantize-then-attend in one interleaved run, the peak of torch.cuda.max_memory_allocated for the
#      128k prompt against DynamicCache's, and every Triton kernel cross-checked against the torch backend
#      at full size; one Markdown table, $OUT/presets.md (long_decode_check.py);
#   4. a model split across cuda:0 and cpu with a CompressedCache (device_map_check.py).
#
# Usage (from anywhere; needs the project installed: pip install -e ".[test,triton]"):
#   bash scripts/gpu_checks.sh              # on a CUDA machine: compiled kernels, full sizes
#   bash scripts/gpu_checks.sh --cpu        # without a GPU: the same checks at reduced sizes, the Triton
#                                           # kernels under Triton's interpreter (TRITON_INTERPRET=1), the
#                                           # memory benchmark reading the resident set (a few minutes)
# Output: one section per check on stdout, results under $OUT (default gpu-checks/): memory/ and the table
# presets.md, ready for docs/performance.md; exit status non-zero as soon as a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${OUT:-gpu-checks}"
MODE=cuda
if [ "${1:-}" = "--cpu" ]; then
  MODE=cpu
elif [ -n "${1:-}" ]; then
  echo "gpu_checks.sh: unknown argument '${1}'; use no argument (CUDA) or --cpu (reduced sizes on CPU)" >&2
  exit 2
fi
mkdir -p "$OUT"

if [ "$MODE" = cuda ]; then
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_checks.sh: no CUDA device visible; run 'bash scripts/gpu_checks.sh --cpu' for the reduced CPU run" >&2
    exit 2
  fi
  echo "== 1. Triton kernels, compiled, against torch"
  bash scripts/gpu_check_triton.sh
  echo "== 2. memory benchmark (torch.cuda.max_memory_allocated)"
  "$PY" -m kvpolicy.cli bench memory --device cuda --model smollm2 --lengths 8k 32k --steps 6 \
    --caches dynamic hf-quanto-2 one-liner preset:kvpolicy-3bit --out "$OUT/memory"
  echo "== 3. decode of every preset at 32k and 128k, 8B-shaped layer stack"
  "$PY" scripts/long_decode_check.py --device cuda --lengths 32768 131072 --layers 4 --dtype bfloat16 --steps 10 \
    --markdown "$OUT/presets.md"
  echo "== 4. device map (cuda:0 + cpu)"
  "$PY" scripts/device_map_check.py
else
  export TRITON_INTERPRET=1
  echo "== 1. Triton kernels under the interpreter, against torch (reduced)"
  "$PY" -m pytest -q -n 0 -p no:randomly -p no:cacheprovider tests/test_backend_triton.py \
    -k "quantize_dequantize_match_torch or attend_matches_reference or fused_decode_path_uses_the_kernel"
  echo "== 2. memory benchmark (resident set, tiny Llama)"
  "$PY" -m kvpolicy.cli bench memory --device cpu --model tiny-llama --lengths 256 --steps 2 --threads 1 \
    --caches dynamic hf-quanto-2 one-liner --out "$OUT/memory"
  echo "== 3. decode of every preset, reduced layer stack, Triton kernels under the interpreter"
  "$PY" scripts/long_decode_check.py --device cpu --backend triton --lengths 384 --layers 1 --heads 4 --kv-heads 2 \
    --head-dim 64 --dtype bfloat16 --steps 1 --markdown "$OUT/presets.md"
  echo "== 4. device map (both halves on cpu)"
  "$PY" scripts/device_map_check.py --first-device cpu
fi
echo "gpu_checks.sh: all checks passed ($MODE)"
