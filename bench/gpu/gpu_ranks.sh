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
# 512-piece vocabulary); OUT: where the logs, the tests' results and the run go. Environment:
# STEPS (the 4-rank run's steps, default 20). About 4 minutes on one H100 or H200.
set -euo pipefail
moeplan=$1 gpu_test=$2 data=$3 out=$4
root="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$out"
stamp() { date +%T; }
export MOEPLAN_PROFILES="$root/profiles" MOEPLAN_TEST_BINARY="$moeplan" MOEPLAN_GPU_TEST_DATA="$data"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
echo "== GPU tests ($(stamp))"
status=0
"$gpu_test" --gtest_brief=1 --gtest_output="json:$out/gpu_test.json" >"$out/gpu_test.log" 2>&1 || status=$?
tail -25 "$out/gpu_test.log"
echo "== a 4-rank plan sharing the GPU: E2 S2, 64-token sequences ($(stamp))"
model="$out/model.json"
"${PYTHON:-python3}" - "$root/profiles/models/mixtral-tiny.json" "$model" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
m["name"], m["vocab_size"] = "mixtral-tiny-v512", 512
json.dump(m, open(sys.argv[2], "w"), indent=1)
EOF
"$moeplan" search --gpus 4 --instance p5.48xlarge --model "$model" --seq-len 64 --global-batch-tokens 1024 \
  --precision fp32 --micro-batch 1 --expert-parallel-degree 2 --hybrid-shard-degree 2 --tensor-parallel-degree 1 \
  --pipeline-parallel-degree 1 --checkpointing none --offload off --target moeplan --out "$out/plan-e2s2.json" \
  2>&1 | tail -3
rm -rf "$out/run-e2s2"
"$moeplan" run "$out/plan-e2s2.json" --data "$data" --out "$out/run-e2s2" --steps "${STEPS:-20}" --timeout 120 \
  2>&1 | tee "$out/run-e2s2.log" | tail -16
cp "$out/run-e2s2/report.json" "$out/report-e2s2.json" 2>/dev/null || true
echo "== done ($(stamp)); GPU tests exit $status"
exit "$status"
