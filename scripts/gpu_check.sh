#!/usr/bin/env bash
# The GPU check, as a user runs it on one lent GPU: at most 8 minutes (the steps' limits add up to 480 s). Prints what it ran and one
# JSON line per check (also kept in $GPU_CHECK_OUT); runs every step, then exits non-zero if any
# check failed (a gpu-marked test, a hash disagreement, a loss out of noise, a failed resume).
#   1. every gpu-marked test of the whole tests/ tree (selected by the marker)
#   2. a GPU site (bf16) against a CPU site (fp32), hashes every round
#   3. the same with fp8 (torchao float8 linears) where the GPU supports it, else says why not
#   4. one GPU rank: the plain model, DDP, FSDP2 and the per-block options (activation
#      checkpointing, compile) trained alike; losses within noise of the plain model's
#   5. a DCP checkpoint saved by a GPU site, resumed on the CPU: what loads hashes to what was
#      saved, and the run's hashes agree every round
#   6. sites of 2 GPU ranks: pipeline stages (pp=2), a mixture of experts split over them (ep)
#      (fewer than 2 GPUs: says so, one JSON line each)
#   7. benchmarks/inner.py on the GPU (~100M parameters): tokens/s of a plain loop against the
#      same loop with the outer sync at H=100
# scripts/gpu_check.sh --smoke runs every step on the CPU with tiny models (tests/site/test_gpu_check.py).
set -uo pipefail
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
  SCALE=4  # a loaded CPU machine: more time per step than a GPU machine's 16 cores need
  export OMP_NUM_THREADS=1  # tiny models, many processes: more threads only contend for the cores
  SIZE=(--smoke)
  AGREE=(--rounds 2 --steps 3)
  ONE_RANK=(--steps 4 --precision fp32)  # fp32: the wrappers must give the plain model's bits
  CKPT=(--rounds 4 --steps 40)  # rounds long enough that the site is killed mid-run
  LAYOUTS=(--rounds 2 --steps 3)
  INNER=(--rounds 3 --steps 5)
else
  DEVICE=cuda
  SCALE=1
  SIZE=()
  AGREE=(--rounds 3 --steps 20)
  ONE_RANK=(--steps 20 --precision bf16)
  CKPT=(--rounds 6 --steps 50)
  LAYOUTS=(--rounds 3 --steps 20)
  INNER=(--rounds 3 --steps 100 --batch 16)
  nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader || true
  "$PY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' || exit 2
fi

failed=()
started=$SECONDS
step() {  # step NAME TIMEOUT CHECK ARGS...: one check's JSON lines to the screen and $OUT/NAME.jsonl
  local name=$1 limit=$2 began=$SECONDS
  shift 2
  limit=$((limit * SCALE))
  echo "== $name (at most $limit s)" >&2
  timeout --kill-after=30 "$limit" "$PY" scripts/gpu_check.py "$@" --device "$DEVICE" "${SIZE[@]}" 2>"$OUT/$name.log" \
    | tee "$OUT/$name.jsonl"
  local code=${PIPESTATUS[0]}
  if [[ $code -ne 0 ]]; then
    failed+=("$name")
    echo "{\"check\": \"$name\", \"ok\": false, \"exit\": $code, \"log\": \"$OUT/$name.log\"}" \
      | tee -a "$OUT/$name.jsonl"
  fi
  echo "== $name: $((SECONDS - began)) s" >&2
}

step gpu-tests 90 tests
step agree-bf16 60 agree --precision bf16 "${AGREE[@]}"
step agree-fp8 60 agree --precision fp8 "${AGREE[@]}"
step one-rank 60 one-rank "${ONE_RANK[@]}"
step checkpoint 60 checkpoint --precision bf16 "${CKPT[@]}"
step layouts 60 layouts --precision bf16 "${LAYOUTS[@]}"
step inner 90 inner --precision bf16 "${INNER[@]}"
echo "== done in $((SECONDS - started)) s: $OUT" >&2
if ((${#failed[@]})); then
  echo "gpu_check: failed: ${failed[*]}" >&2
  exit 1
fi
