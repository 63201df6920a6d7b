#!/usr/bin/env bash
# The executor on one GPU against its prediction and against the eager PyTorch baseline
# (docs/executor.md, "On a GPU"): calibrates this GPU at mixtral-1gpu's shapes, plans a one-GPU
# run with that profile, trains it on the prepared text, then trains the same model in eager
# PyTorch (bench/python/mixtral_baseline.py) at the plan's micro-batch on the same GPU.
#
#   bench/gpu/one_gpu.sh MOEPLAN DATA OUT [BASE_PROFILE]
#
# MOEPLAN: the moeplan binary; DATA: `moeplan data prepare --vocab-size 8192 --block-size 2048`
# output; OUT: where the profile, plan, run and logs go. BASE_PROFILE: the profile whose GPU
# this is (p5.48xlarge: H100 SXM). Environment: STEPS (default 20), BASELINE_STEPS (10), PASSES (2),
# PYTHON (python3, with torch), GPU_TEST (a test_executor_gpu binary to run first).
set -euo pipefail
moeplan=$1 data=$2 out=$3 base=${4:-p5.48xlarge}
root="$(cd "$(dirname "$0")/../.." && pwd)"
python=${PYTHON:-python3}
mkdir -p "$out"
stamp() { date +%T; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
if [[ -n "${GPU_TEST:-}" ]]; then
  echo "== GPU tests ($(stamp))"
  MOEPLAN_PROFILES="$root/profiles" "$GPU_TEST" --gtest_brief=1 2>&1 | tee "$out/gpu_test.log" | tail -15
fi
echo "== calibrate ($(stamp))"
"$moeplan" calibrate --ranks 1 --base "$base" --model mixtral-1gpu --seq-len 2048 --precision mixed \
  --max-micro-batch 4 --quick --passes "${PASSES:-2}" --name gpu-here --out "$out/gpu-here.json" --profiles "$root/profiles" \
  2>&1 | tee "$out/calibrate.log" | tail -25
echo "== search ($(stamp))"
"$moeplan" search --gpus 1 --instance "$out/gpu-here.json" --model mixtral-1gpu --profiles "$root/profiles" \
  --seq-len 2048 --global-batch-tokens 65536 --precision mixed --max-micro-batch 4 --checkpointing none \
  --offload off --steps 200 --learning-rate 3e-4 --min-learning-rate 3e-5 --warmup-steps 10 \
  --out "$out/plan.json" 2>&1 | tee "$out/search.log" | tail -12
echo "== run ($(stamp))"
"$moeplan" run "$out/plan.json" --data "$data" --out "$out/run" --steps "${STEPS:-20}" 2>&1 | tee "$out/run.log" | tail -16
read -r mbs ga < <("$python" -c "import json,sys; p=json.load(open(sys.argv[1]))['parallel']; \
print(p['micro_batch_size'], p['gradient_accumulation_steps'])" "$out/plan.json")
# The same tokens per step; where the eager model's unfused attention does not fit the plan's
# micro-batch, halves of it (tokens/s stays comparable).
while :; do
  echo "== eager PyTorch baseline, micro-batch $mbs x $ga ($(stamp))"
  if "$python" -W ignore "$root/bench/python/mixtral_baseline.py" --model "$root/profiles/models/mixtral-1gpu.json" \
    --seq-len 2048 --micro-batch "$mbs" --grad-accumulation "$ga" --steps "${BASELINE_STEPS:-10}" --warmup 2 \
    --precision mixed --device cuda > "$out/baseline.json"; then
    cat "$out/baseline.json"
    break
  fi
  (( mbs > 1 )) || break
  mbs=$((mbs / 2)) ga=$((ga * 2))
done
echo "== done ($(stamp))"
