#!/usr/bin/env bash
# The measurements behind docs/performance.md's "Many small experts" section, in one run on an
# idle machine (nothing else running: every figure is a ratio within a round, but a busy
# machine still moves them). Writes into benchmarks/results/. About 40 minutes on 2 cores.
#   BEFORE=<commit>  also runs step_path.py against that commit (a worktree) for before/after,
#                    and bench.py's world-2 rounds with that commit's selzero as a third mode
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
R=benchmarks/results
for w in c e f; do  # the step path's host cost per expert tensor, profiled by phase
  $PY benchmarks/step_path.py --workload $w --rounds 11 --out $R/step-path-$w.json
done
if [ -n "${BEFORE:-}" ]; then
  root=$PWD
  tree=$(mktemp -d)/before
  git worktree add -f "$tree" "$BEFORE" -q
  cp benchmarks/step_path.py benchmarks/bench.py "$tree/benchmarks/"
  for w in c e f; do  # the old package (the script puts its own tree first on sys.path)
    (cd "$tree" && "$root/$PY" benchmarks/step_path.py --workload $w --rounds 11 \
      --out "$root/$R/step-path-$w-before.json")
  done
fi
# step time and memory beside DDP, modes interleaved, world 2 and world 4
if [ -n "${BEFORE:-}" ]; then
  $PY benchmarks/bench.py --workloads c,e,f,a,d --modes ddp,selzero,selzero-before \
    --before "$tree" --rounds 3
  git worktree remove --force "$tree"
else
  $PY benchmarks/bench.py --workloads c,e,f,a,d --modes ddp,selzero --rounds 3
fi
$PY benchmarks/bench.py --workloads c,e,f --modes ddp,selzero --rounds 2 --world 4 \
  --out $R/world4
# the cost of scale, simulated on the fake process group
$PY benchmarks/scale.py --worlds 8,64,256 --partition chunks,tensors \
  --out $R/scale.json --md $R/scale.md --png $R/scale.png
# checkpoints beside torch.distributed.checkpoint, and the change of world size 2 -> 3
$PY benchmarks/checkpoint_time.py --rounds 3 --modes selzero,dcp --reshard-to 3
