#!/bin/bash
# one-off: dfe.py on a uni front-end stack and an mp one, in the order given
cd /work/main
export PYTHONPATH=/tmp/kvb  # a copy of the tree, so that it could be edited meanwhile
for kind in "$@"; do
  flag=--in-process-executor; [ "$kind" = mp ] && flag=--no-in-process-executor
  .venv/bin/kvpush up --front-end --detach $flag > /tmp/uni/up_$kind.log 2>&1 || { echo up failed; cat /tmp/uni/up_$kind.log; exit 1; }
  sleep 3
  echo "== $kind"
  .venv/bin/python /tmp/uni/dfe.py 30 /tmp/uni/dfe_${kind}_$(date +%H%M).json
  .venv/bin/kvpush down
done
