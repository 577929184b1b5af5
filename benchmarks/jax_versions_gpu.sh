#!/bin/bash
# The GPU side of the jax-version checks (README, "Tested"), on a device
# machine whose image has jax 0.11.2 and no network. jax 0.12's wheels
# travel in parts (scripts/offline_wheels.sh pack .whl12 47M -- ...), one
# part per device call, while the machine stays warm:
#
#   bash benchmarks/jax_versions_gpu.sh stage .whl12/wheels.tar.part-aa
#   ...                                  (every part, then)
#   bash benchmarks/jax_versions_gpu.sh install     # also .whl/jax_triton-*.whl
#   bash benchmarks/jax_versions_gpu.sh suite 0.12 [group ...]   # gpu_suite.sh
#   bash benchmarks/jax_versions_gpu.sh suite 0.11 [group ...]
#   bash benchmarks/jax_versions_gpu.sh ab ROUNDS [--points ...]  # timing A/B
#
# Logs under $OUT/jax<version>/ (suite) and $OUT/ab_jax_versions.jsonl.
set -uo pipefail
PARTS=/var/tmp/jax-parts
J12=/var/tmp/jax012
JT=/var/tmp/jax-triton
OUT=${OUT:-/tmp/jax_versions}
mkdir -p "$OUT"

# PYTHONPATH for a jax version: the image's 0.11.2, or the installed 0.12.
pythonpath() {
  case $1 in
    0.11) echo "$JT" ;;
    0.12) echo "$J12:$JT" ;;
    *) echo "unknown jax version $1 (0.11 or 0.12)" >&2; exit 2 ;;
  esac
}

cmd=$1
shift
case $cmd in
  stage)
    mkdir -p "$PARTS" && cp "$@" "$PARTS"/ && cp .whl12/wheels.sha256 "$PARTS"/ && ls -l "$PARTS" ;;
  install)
    bash scripts/offline_wheels.sh install "$PARTS" "$J12" &&
      python3 -m pip install -q --no-deps --no-index --target "$JT" .whl/jax_triton-*.whl &&
      for v in 0.11 0.12; do
        PYTHONPATH=$(pythonpath $v) python3 -c "import jax, jax_triton; print('jax', jax.__version__, jax.devices())"
      done ;;
  suite)
    v=$1
    shift
    mkdir -p "$OUT/jax$v"
    PYTHONPATH=$(pythonpath "$v") OUT="$OUT/jax$v" bash benchmarks/gpu_suite.sh "$@" ;;
  ab)
    rounds=$1
    shift
    for r in $(seq "$rounds"); do
      for v in 0.11 0.12; do
        PYTHONPATH=.:$(pythonpath $v) python3 -m benchmarks.experiments.ab_versions \
          "jax$v" "$@" >> "$OUT/ab_jax_versions.jsonl" 2>> "$OUT/ab_jax_versions.err"
      done
    done
    python3 -m benchmarks.ab_report "$OUT/ab_jax_versions.jsonl"
    ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
