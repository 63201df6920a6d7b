#!/usr/bin/env bash
# Peak memory per rank, measured against the planner's memory model, for layouts of 4 CPU ranks
# on this machine (docs/memory-model.md, "Measured on CPU ranks").
# Usage: bench/memory_matrix.sh DATA_DIR [WORK_DIR]
#   DATA_DIR: a `moeplan data prepare` folder with vocabulary 4096 and block size 256.
# Each layout is planned with its choices fixed (`moeplan search` with --expert-parallel-degree,
# --hybrid-shard-degree, ...), run for 3 steps, and its report.json read.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
moeplan="$root/build/cli/moeplan"
data="$1"
work="${2:-$(mktemp -d)}"
mkdir -p "$work"
# mixtral-tiny widened so that model states and activations outweigh the runtime's own memory.
python3 - "$root/profiles/models/mixtral-tiny.json" "$work/model.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m.update(name="mixtral-tiny-wide", hidden_size=256, intermediate_size=1024, num_attention_heads=8,
         num_key_value_heads=4, head_dim=32)
json.dump(m, open(sys.argv[2], "w"), indent=1)
PY
# predicted/measured: whole rank (model total; peak RSS of the largest rank). tensors: the model
# without framework overhead and fragmentation; the largest live-tensor peak of the ranks.
printf '%-16s %4s %9s %9s %6s %9s %9s %6s  %s\n' layout mbs predicted measured error tensors: measured error \
  "peak RSS per rank, before the model (MiB)"
run() {  # name gpus E S checkpointing offload micro-batch
  local name=$1 gpus=$2 e=$3 s=$4 ckpt=$5 off=$6 mbs=$7
  local file="$name-mbs$mbs"
  "$moeplan" search --gpus "$gpus" --instance local-cpu --model "$work/model.json" --seq-len 256 \
    --global-batch-tokens $((gpus * mbs * 256)) --precision fp32 --expert-parallel-degree "$e" \
    --hybrid-shard-degree "$s" --checkpointing "$ckpt" --offload "$off" --micro-batch "$mbs" --placement RSE \
    --out "$work/$file.json" >/dev/null
  rm -rf "$work/run-$file"
  "$moeplan" run "$work/$file.json" --data "$data" --out "$work/run-$file" --steps 3 >"$work/$file.log" 2>&1
  python3 - "$work/run-$file/report.json" "$work/$file.json" "$name" "$mbs" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); m = r["measured"]; MiB = 2**20
items = json.load(open(sys.argv[2]))["prediction"]["memory"]["device"]
tensors = r["predicted"]["device_bytes_per_rank"] - items["framework_overhead"] - items["fragmentation"]
live = max(m["peak_tensor_bytes_per_rank"])
print(f"{sys.argv[3]:16s} {sys.argv[4]:>4s} {r['predicted']['device_bytes_per_rank']/MiB:5.0f} MiB"
      f" {m['peak_rss_bytes']/MiB:5.0f} MiB {100*r['relative_error']['peak_memory']:+5.0f}%"
      f" {tensors/MiB:5.0f} MiB {live/MiB:5.0f} MiB {100*(live/tensors-1):+5.0f}%"
      f"  {[round(x/MiB) for x in m['peak_rss_bytes_per_rank']]}, {round(m['baseline_rss_bytes_per_rank'][0]/MiB)}")
PY
}
run E1S1R4 4 1 1 none off 4
run E1S1R4 4 1 1 none off 1
run E1S2R2 4 1 2 none off 4
run E1S4R1 4 1 4 none off 4
run E1S4R1-full 4 1 4 full off 4
run E4S1R1 4 4 1 none off 4
run E4S1R1 4 4 1 none off 2
run E4S1R1 4 4 1 none off 1
run E2S2R1 4 2 2 none off 4
run E2S2R1-sel 4 2 2 selective off 4
run E2S2R1-sel-off 4 2 2 selective on 4
run E2S2R1-full 4 2 2 full off 4
run E2S2R1-full-off 4 2 2 full on 4
