#!/usr/bin/env bash
# The GPU check: at most ~8 minutes on one GPU. Prints what it ran and one JSON line per check;
# exits non-zero if a gpu-marked test fails or the GPU and CPU sites ever disagree.
#   1. the gpu-marked tests (device-parametrised hash, placement and codec tests on CUDA)
#   2. a 2-site run: one rank on the GPU in bf16 against a CPU site in fp32, hashes every round
#   3. the same with fp8 (torchao float8 linears) where the GPU supports it, else says why not
#   4. a site of 2 GPU ranks in pipeline stages (pp=2), then one splitting a mixture of experts
#      (ep, bf16): hashes every round (fewer than 2 GPUs: says so, one JSON line each)
#   5. throughput: a ~100M-parameter model on the GPU in bf16, H=100 inner steps per round:
#      inner tokens/s without and with the outer sync, and the outer sync's share of wall time
# scripts/gpu_check.sh --smoke runs the same steps on the CPU with tiny models (seconds; tested).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
OUT=${GPU_CHECK_OUT:-runs/gpu-check}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if ! "$PY" -c "import geodiloco.site, torch" 2>/dev/null; then
  echo "gpu_check: $PY cannot import geodiloco and torch; run 'make setup' with a CUDA build of" \
    "torch (deploy/README.md: TORCH_INDEX_URL) or set PYTHON=" >&2
  exit 2
fi

if [[ "${1:-}" == "--smoke" ]]; then
  DEVICE=cpu
  export OMP_NUM_THREADS=1  # tiny models, many processes: more threads only contend for the cores
  AGREE=(--smoke --rounds 2 --steps 3)
  LAYOUTS=(--smoke --rounds 2 --steps 3)
  THROUGHPUT=(--smoke --rounds 3 --steps 5)
else
  DEVICE=cuda
  AGREE=(--rounds 3 --steps 20)
  LAYOUTS=(--rounds 3 --steps 20)
  THROUGHPUT=(--rounds 3 --steps 100 --batch 16)
  nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader || true
  "$PY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
fi

echo "== 1. gpu-marked tests"
timeout 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/site tests/compression/test_device_codec.py 2>&1 | tee "$OUT/gpu-tests.txt"
echo "== 2. GPU site (bf16) against a CPU site"
timeout 180 "$PY" scripts/gpu_check.py agree --device "$DEVICE" --precision bf16 "${AGREE[@]}" \
  | tee "$OUT/agree-bf16.json"
echo "== 3. GPU site (fp8) against a CPU site"
timeout 180 "$PY" scripts/gpu_check.py agree --device "$DEVICE" --precision fp8 "${AGREE[@]}" \
  | tee "$OUT/agree-fp8.json"
echo "== 4. pp and ep sites on the GPUs"
timeout 360 "$PY" scripts/gpu_check.py layouts --device "$DEVICE" --precision bf16 "${LAYOUTS[@]}" \
  | tee "$OUT/layouts.jsonl"
echo "== 5. throughput, outer sync share at H=100"
timeout 240 "$PY" scripts/gpu_check.py throughput --device "$DEVICE" --precision bf16 "${THROUGHPUT[@]}" \
  | tee "$OUT/throughput.json"
echo "== done: $OUT"
