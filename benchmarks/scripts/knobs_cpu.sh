#!/usr/bin/env bash
# The CPU-only timing settings against their absence, on this host's kvpush stack (1P1D, one
# core each): the defaults, `idle_wait_s: 0` (no wait on idle steps), and
# `gil_switch_interval_s: 0.005` (Python's own GIL interval). Two rounds, the variants in turn
# in each, the same prompts for every variant of a round. docs/benchmarks.md, "The knobs kept",
# prints its table from the results with `results_tables.py --knobs`.
set -euo pipefail
OUT=${OUT:-benchmarks/results/knobs_cpu}
declare -A EXTRA=(
  [default]='{}'
  [idle_wait_0]='{"idle_wait_s": 0}'
  [gil_5ms]='{"gil_switch_interval_s": 0.005}'
)
for round in 1 2; do
  for variant in default idle_wait_0 gil_5ms; do
    .venv/bin/kvpush bench serve --connectors kvpush --qps 2,4 --num-prompts 48 \
      --seed $((4342 + round)) --connector-extra "${EXTRA[$variant]}" \
      --results-dir "$OUT/${variant}_r$round"
  done
done
