#!/usr/bin/env bash
# Routing as it really is, on the executor (docs/validation.md): runs in which the router learns,
# each step predicted from the expert loads it measured, and a routing profile measured on one
# run planning a later run of the same layout with another seed.
#
#   bench/routing/learned_routing.sh MOEPLAN DATA OUT [RANKS] [STEPS] [RUN...]
#
# MOEPLAN is build/cli/moeplan, DATA a `moeplan data prepare` folder of 256-token blocks
# (docs/validation.md, "Reproduce"). OUT gets the calibrated profile (kept between calls: delete
# OUT/profile.json to calibrate again), each run's plan, run folder and prediction, and
# summary.txt. RANKS (4) CPU ranks train mixtral-tiny, 8,192 tokens a step in micro-batches of 4
# (two a step), fp32, for STEPS (200) steps; the first 20 are left out of every figure. RUN names
# which runs to make (default all):
#   E4-none E4-none-s2   experts over 4 ranks, no load balancing, seeds 1 and 2
#   E2-aux E2-aux-s2     experts over 2 ranks (2 replicas), auxiliary loss 0.001, seeds 1 and 2
#   E4-sinkhorn E2-balanced E2-none-cf1.0 E4-none-cf1.25
# and, named only, E4-none-s3 and E2-aux-s3 (seed 3: runs kept out of a change's making, to check it on).
# Nothing else should run on the machine meanwhile (docs/validation.md, "A shared machine").
set -euo pipefail
if [[ $# -lt 3 ]]; then
  sed -n 2,18p "$0" >&2
  exit 2
fi
moeplan=$(realpath "$1")
data=$(realpath "$2")
out=$3
ranks=${4:-4}
steps=${5:-200}
shift $(($# < 5 ? $# : 5))
runs=("$@")
[[ ${#runs[@]} -gt 0 ]] || runs=(E4-none E4-none-s2 E2-aux E2-aux-s2 E4-sinkhorn E2-balanced E2-none-cf1.0 E4-none-cf1.25)
mkdir -p "$out"
cd "$out"
from=21

if [[ ! -f profile.json ]]; then
  echo "== calibrating this machine as $ranks ranks ($(date -u +%H:%M))"
  "$moeplan" calibrate --ranks "$ranks" --model mixtral-tiny --seq-len 256 --out profile.json > calibrate.txt
fi

# name -> expert degree, load balancing, capacity factor (0: dropless), seed
spec() {
  case $1 in
    E4-none) echo "4 none 0 1" ;;
    E4-none-s2) echo "4 none 0 2" ;;
    E4-none-s3) echo "4 none 0 3" ;;
    E2-aux) echo "2 aux_loss 0 1" ;;
    E2-aux-s2) echo "2 aux_loss 0 2" ;;
    E2-aux-s3) echo "2 aux_loss 0 3" ;;
    E4-sinkhorn) echo "4 sinkhorn 0 1" ;;
    E2-balanced) echo "2 balanced 0 1" ;;
    E2-none-cf1.0) echo "2 none 1.0 1" ;;
    E4-none-cf1.25) echo "4 none 1.25 1" ;;
    *) echo "learned_routing.sh: no run named $1" >&2; return 1 ;;
  esac
}

for name in "${runs[@]}"; do
  read -r experts balancing capacity seed < <(spec "$name")
  capacity_flag=()
  [[ $capacity == 0 ]] || capacity_flag=(--capacity-factor "$capacity")
  "$moeplan" search --gpus "$ranks" --instance profile.json --model mixtral-tiny --seq-len 256 \
    --global-batch-tokens 8192 --precision fp32 --expert-parallel-degree "$experts" --hybrid-shard-degree 1 \
    --tensor-parallel-degree 1 --pipeline-parallel-degree 1 --micro-batch 4 --checkpointing none \
    --steps "$steps" --learning-rate 1e-4 --warmup-steps 10 --load-balancing "$balancing" \
    "${capacity_flag[@]}" --out "$name.plan.json" > "$name.search.txt"
  # The training seed (initial weights, data order): seed 1 is the plan's own (12345), seed k
  # adds k - 1.
  python3 -c 'import json, sys
p = json.load(open(sys.argv[1])); p["training"]["seed"] += int(sys.argv[2]) - 1
json.dump(p, open(sys.argv[1], "w"), indent=2)' "$name.plan.json" "$seed"
  if [[ ! -f $name/report.json ]]; then
    echo "== $name: E$experts, $balancing, capacity $capacity, seed $seed, $steps steps ($(date -u +%H:%M))"
    rm -rf "$name"
    "$moeplan" run "$name.plan.json" --data "$data" --out "$name" --steps "$steps" > "$name.run.txt"
  fi
  "$moeplan" routing "$name" --from-step "$from" --expert-degree "$experts" --predict --profile profile.json \
    > "$name.predict.txt"
done

{
  echo "learned routing: $ranks CPU ranks, $steps steps, steps $from on; profile $(python3 -c "import json; print(json.load(open('profile.json'))['name'])")"
  for name in "${runs[@]}"; do
    echo "== $name"
    grep -E "^all |median \|error\||^step time|dropped" "$name.predict.txt" || true
  done
  # A priori: the profile measured on the seed-1 run plans the seed-2 run.
  for pair in E4-none E2-aux; do
    [[ -f $pair/report.json && -f $pair-s2/report.json ]] || continue
    "$moeplan" routing "$pair" --from-step "$from" --profile profile.json --out "$pair.routing.json" > /dev/null
    echo "== a priori: $pair's routing planning $pair-s2"
    "$moeplan" simulate "$pair-s2.plan.json" --routing "$pair.routing.json" --draws 200 | grep -E "^routing|step median"
    grep -E "^step time" "$pair-s2.predict.txt" | sed "s/^/measured: /" || true
  done
} | tee summary.txt
