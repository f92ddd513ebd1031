#!/bin/bash
# Same-lending A/B of the cache service benchmark: an older tree of the project against the checkout,
# alternating which runs first, three rounds; then the native transport floor.
#
# On the development machine (git does not run on the GPU machine), unpack the older tree as an
# untracked folder of the checkout, so that the device tool carries it, and build the native probe:
#   git archive REV | (mkdir -p ab_old && tar -x -C ab_old) && rm -rf ab_old/perf/results ab_old/tests
#   gcc -O2 -static tools/native_pingpong.c -o ab_old/native_pingpong
# On the GPU machine:  bash tools/ab_service_trees.sh ab_old   (writes into $OUT/ab/)
# Delete ab_old afterwards (it must not be committed).
set -u
OLD=${1:?usage: tools/ab_service_trees.sh OLD_TREE_DIR}
OUTDIR=${OUT:-perf/out}/ab
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
ARGS="--device cuda --clients 0 --shapes , --per-layer-pairs 0 --floor-rounds 201 --pairs 21 --back-to-back 61"
for r in 1 2 3; do
  order="old new"
  [ $((r % 2)) -eq 0 ] && order="new old"
  for side in $order; do
    if [ "$side" = old ]; then
      PYTHONPATH=$OLD python "$OLD/perf/bench_service.py" $ARGS --out "$OUTDIR/$r-old" > "$OUTDIR/$r-old.txt" 2>&1
    else
      PYTHONPATH=. python perf/bench_service.py $ARGS --out "$OUTDIR/$r-new" > "$OUTDIR/$r-new.txt" 2>&1
    fi
    echo "== run $r $side rc=$?"
    grep -E "paired ratio|balanced|back to back|client.start -> client.built|total|floor" "$OUTDIR/$r-$side.txt"
  done
done
if [ -x "$OLD/native_pingpong" ]; then
  echo "== native transport floor"
  for i in 1 2 3; do "$OLD/native_pingpong"; done
fi
