#!/usr/bin/env bash
# Every GPU check of the executor on one GPU machine, in one go (about 4 minutes on an H200; the
# parts' own headers say what each runs): ranks sharing the GPU (bench/gpu/gpu_ranks.sh: the GPU
# tests, a 4-rank hybrid-shard run and how much of its all-gathers compute hid), then one rank at
# the GPU's speed (bench/gpu/one_gpu.sh: calibrate, plan, train mixtral-1gpu and the eager
# baseline), and a summary of the one-rank figures: tokens/s, MFU (the simulator's FLOPs of the
# step over the measured step time and the profile's peak), the ratio to the eager baseline and
# the prediction's error. Builds nothing.
#
#   bench/gpu/gpu_checks.sh MOEPLAN GPU_TEST SMALL_DATA ONE_GPU_DATA OUT
#
# SMALL_DATA: `moeplan data prepare --vocab-size 512 --block-size 64` output (gpu_ranks.sh);
# ONE_GPU_DATA: `--vocab-size 8192 --block-size 2048` output (one_gpu.sh). OUT gets ranks/,
# one-gpu/ and summary.txt. Environment as the parts take it (STEPS, PYTHON, ...).
#
# On a device machine (the binaries and both data folders carried, built and prepared here):
#   here:  scripts/build-for-torch 2.11.0 build-gpu      # the version of that machine's torch
#          for v in "512 64 gpu-data" "8192 2048 gpu-data-1gpu"; do set -- $v
#            build/cli/moeplan data prepare --input /usr/share/games/fortunes/{fortunes,wisdom,science,computers} \
#              --out $3 --vocab-size $1 --block-size $2 --document-separator %; done
#   there: (LD_LIBRARY_PATH as scripts/build-for-torch says) bench/gpu/gpu_checks.sh build-gpu/cli/moeplan \
#            build-gpu/tests/test_executor_gpu gpu-data gpu-data-1gpu "$OUT"
set -uo pipefail
moeplan=$1 gpu_test=$2 small=$3 one=$4 out=$5
root="$(cd "$(dirname "$0")/../.." && pwd)"
python=${PYTHON:-python3}
mkdir -p "$out"
status=0
start=$(date +%s)
"$root/bench/gpu/gpu_ranks.sh" "$moeplan" "$gpu_test" "$small" "$out/ranks" || status=1
ranks_done=$(date +%s)
"$root/bench/gpu/one_gpu.sh" "$moeplan" "$one" "$out/one-gpu" || status=1
one_done=$(date +%s)
{
  echo "ranks sharing the GPU: $((ranks_done - start)) s; one rank: $((one_done - ranks_done)) s"
  "$moeplan" simulate "$out/one-gpu/plan.json" --measured "$out/one-gpu/run/report.json" \
    > "$out/one-gpu/simulate.txt" 2>&1 || status=1
  "$python" - "$out/one-gpu" <<'EOF'
import json, re, sys
d = sys.argv[1]
measured = json.load(open(f"{d}/run/report.json"))["measured"]
baseline = json.load(open(f"{d}/baseline.json"))
text = open(f"{d}/simulate.txt").read()
sim = re.search(r"step ([0-9.]+) s, ([0-9.]+) tokens/s, ([0-9.]+) TFLOP/s per GPU, MFU ([0-9.]+)%", text)
step, sim_step = measured["step_time_s"], float(sim.group(1))
mfu = float(sim.group(4)) * sim_step / step
base = baseline.get("tokens_per_s") or baseline.get("tokens_per_second")
print(f"one rank: {measured['tokens_per_s']:.0f} tokens/s, step {step:.3f} s (median), predicted {sim_step:.3f} s "
      f"({100 * (step / sim_step - 1):+.1f}%), MFU {mfu:.1f}%, eager baseline {base:.0f} tokens/s "
      f"(x{measured['tokens_per_s'] / base:.2f})")
EOF
} 2>&1 | tee "$out/summary.txt"
exit "$status"
