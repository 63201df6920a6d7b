#!/usr/bin/env bash
# Many ranks on one GPU machine (docs/executor.md, "Ranks on GPUs"): the GPU tests -- every
# collective on one-rank NCCL and gloo groups on the device, and plans of 2 and 4 ranks sharing
# the GPU (experts over 2, hybrid shard 2, tensor split 2 with sequence parallelism, 2 pipeline
# stages, offloading on) trained 20 steps against the one GPU rank's losses, resumed bit for bit,
# with each rank's peak device tensors against the memory model -- then one 4-rank run whose
# report and measured trace are kept. Builds nothing: MOEPLAN and GPU_TEST come from
# scripts/build-for-torch (run beside that machine's torch libraries, as its header says).
#
#   bench/gpu/gpu_ranks.sh MOEPLAN GPU_TEST DATA OUT
#
# MOEPLAN: the moeplan binary; GPU_TEST: the test_executor_gpu binary of the same build; DATA:
# `moeplan data prepare --vocab-size 512 --block-size 64` output (the tests' model has a
# 512-piece vocabulary); OUT: where the figures go, seven files (a device machine sends back few):
# gpu.txt, gpu_test.log, gpu_test.json, run-e2s2.log, report-e2s2.json, trace-e2s2.json and
# overlap-e2s2.txt (bench/gpu/overlap.py: the share of the shard all-gathers hidden behind compute).
# Environment: STEPS (the 4-rank run's steps, default 20), GPU_TEST_TIMEOUT (seconds the GPU tests
# may take, default 300). On an H200, 2026-11-30: about 2 minutes (docs/executor.md, "Ranks on GPUs").
#
# On a device machine (nothing is fetched there; the binaries and the data are carried):
#   here:  scripts/build-for-torch 2.11.0 build-gpu      # the version of that machine's torch
#          build/cli/moeplan data prepare --input /usr/share/games/fortunes/{fortunes,wisdom,science,computers} \
#            --out gpu-data --vocab-size 512 --block-size 64 --document-separator %
#   there: (carry build-gpu/cli/moeplan, build-gpu/tests/test_executor_gpu and gpu-data; set LD_LIBRARY_PATH
#          as scripts/build-for-torch says) bench/gpu/gpu_ranks.sh build-gpu/cli/moeplan \
#            build-gpu/tests/test_executor_gpu gpu-data "$OUT"
set -euo pipefail
moeplan=$1 gpu_test=$2 data=$3 out=$4
root="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stamp() { date +%T; }
export MOEPLAN_PROFILES="$root/profiles" MOEPLAN_TEST_BINARY="$moeplan" MOEPLAN_GPU_TEST_DATA="$data"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
echo "== GPU tests ($(stamp))"
status=0
timeout "${GPU_TEST_TIMEOUT:-300}" "$gpu_test" --gtest_brief=1 --gtest_output="json:$out/gpu_test.json" \
  >"$out/gpu_test.log" 2>&1 || status=$?
tail -25 "$out/gpu_test.log"
echo "== a 4-rank plan sharing the GPU: E2 S2, 64-token sequences ($(stamp))"
model="$work/model.json"
"${PYTHON:-python3}" - "$root/profiles/models/mixtral-tiny.json" "$model" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
m["name"], m["vocab_size"] = "mixtral-tiny-v512", 512
json.dump(m, open(sys.argv[2], "w"), indent=1)
EOF
"$moeplan" search --gpus 4 --instance p5.48xlarge --model "$model" --seq-len 64 --global-batch-tokens 1024 \
  --precision fp32 --micro-batch 1 --kernels eager --attention flash --expert-parallel-degree 2 \
  --hybrid-shard-degree 2 --tensor-parallel-degree 1 --pipeline-parallel-degree 1 --checkpointing none --offload off \
  --target moeplan --out "$work/plan-e2s2.json" 2>&1 | tail -3
"$moeplan" run "$work/plan-e2s2.json" --data "$data" --out "$work/run-e2s2" --steps "${STEPS:-20}" --timeout 120 \
  2>&1 | tee "$out/run-e2s2.log" | tail -16 || status=1
cp "$work/run-e2s2/report.json" "$out/report-e2s2.json" 2>/dev/null || status=1
cp "$work/run-e2s2/trace.json" "$out/trace-e2s2.json" 2>/dev/null || status=1
echo "== the shard all-gathers hidden behind compute ($(stamp))"
"${PYTHON:-python3}" "$root/bench/gpu/overlap.py" "$out/trace-e2s2.json" --min-hidden 0.5 | tee "$out/overlap-e2s2.txt" || status=1
echo "== done ($(stamp)); GPU tests exit $status"
exit "$status"
