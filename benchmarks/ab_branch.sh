#!/bin/bash
# A/B of the dense route's list kernels between this checkout and another
# commit (a candidate branch that is not merged until a GPU has timed it).
#
#   bash benchmarks/ab_branch.sh prepare REV   (here: REV's package, benchmarks
#                                               and tests into .ab/new)
#   bash benchmarks/ab_branch.sh measure       (on the device; logs in $OUT;
#                                               ROUNDS=1 for one round a call)
#   bash benchmarks/ab_branch.sh test          (on the device: REV's GPU tests
#                                               of the list kernels)
#
# measure alternates the two trees ROUNDS times (default 2): the row program per phase
# (exp_row_phases) and top-k + top-p on the dense route with the kernels
# beside plain sampling (exp_dense_lists), FP8 S and L at B = 1, 16, 64. Each
# line of its JSON logs says which tree ("tree": "base" or "new").
# PHASES=0 leaves the row program's phases out (a change outside the list
# kernels). TIMELINE=1 adds, per tree and round, a profiler trace of the dense route
# (exp_dense_lists --timeline: kernels per call, each one's device time) at
# B = 1, 8, 16: for changes below the wall time's spread.
# .ab/ is git-ignored: the device call carries it (carry: [".ab", ".whl"]).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/ab_branch}
NEW=.ab/new

in_tree() {  # in_tree base|new CMD...: CMD with that tree's packages first
  local tree=$1
  shift
  if [ "$tree" = new ]; then
    (cd "$NEW" && PYTHONPATH=. "$@")
  else
    PYTHONPATH=. "$@"
  fi
}

tagged() {  # tagged TREE FILE: JSON lines of stdin tagged with the tree, appended to FILE
  python3 -c 'import json, sys
tree = sys.argv[1]
for line in sys.stdin:
  if line.startswith("{"):
    print(json.dumps(dict(json.loads(line), tree=tree)), flush=True)' "$1" | tee -a "$2"
}

case ${1:-} in
  prepare)
    rev=${2:?prepare REV}
    rm -rf "$NEW" && mkdir -p "$NEW"
    git archive "$rev" flashsample_jax pallas_kernels benchmarks tests pyproject.toml \
      | tar -x -C "$NEW"
    echo "$NEW: $(git rev-parse --short "$rev")" ;;
  measure)
    mkdir -p "$OUT"
    for _ in $(seq "${ROUNDS:-2}"); do
      for tree in base new; do
        if [ "${PHASES:-1}" = 1 ]; then
          in_tree $tree python3 -m benchmarks.experiments.exp_row_phases --heads S L \
            --batches 1 16 64 2>&1 | tagged $tree "$OUT/ab_row_phases.jsonl"
        fi
        in_tree $tree python3 -m benchmarks.experiments.exp_dense_lists --heads S L \
          --batches 1 16 64 --weight-dtypes fp8 --variants dense_kernel plain --rounds 1 \
          2>&1 | tagged $tree "$OUT/ab_dense_lists.jsonl"
        if [ "${TIMELINE:-0}" = 1 ]; then
          in_tree $tree python3 -m benchmarks.experiments.exp_dense_lists --heads S L \
            --batches 1 8 16 --weight-dtypes fp8 --variants dense_kernel --timeline \
            2>&1 | tagged $tree "$OUT/ab_timeline.jsonl"
        fi
      done
    done ;;
  test)
    mkdir -p "$OUT"
    in_tree new python3 -m pytest -q -n 8 -p no:cacheprovider -m "gpu or not gpu" \
      tests/test_triton_lists.py tests/test_dense_lists.py > "$OUT/ab_new_gpu_tests.log" 2>&1
    tail -3 "$OUT/ab_new_gpu_tests.log" ;;
  *) echo "usage: $0 prepare REV | measure | test" >&2; exit 2 ;;
esac
