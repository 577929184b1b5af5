#!/bin/bash
# The end-to-end benchmarks (issue 22) in one device call per mode. Every step
# is bounded by `timeout` and leaves its log and results in $OUT; the
# benchmarks also stop starting new batch sizes some time before their limit
# and rewrite their results after every point, so a slow step still reports.
#
#   bash benchmarks/e2e_suite.sh          # one GPU (H100): about 12 minutes at most
#   bash benchmarks/e2e_suite.sh e2e_8b   # one of its steps (floor, e2e_1.7b, e2e_8b)
#   bash benchmarks/e2e_suite.sh tp       # 4 GPUs: about 8 minutes at most
#
# one GPU:
#   floor     examples/decode.py: the Qwen3-8B-shaped decoder at B=1, TPOT against
#             its weight-read floor, attention "xla" then "cudnn" (plain sampling)
#   e2e_1.7b  benchmarks/bench_e2e: Qwen3-1.7B shape, all five generation configs
#             (plain, qwen3, greedy, llama3, min-p), B = 1/16/64/128/256
#   e2e_8b    benchmarks/bench_e2e: Qwen3-8B shape, qwen3 and plain configs,
#             B = 1/16/64/128/256
# Both e2e steps set the logits' spread to LOGIT_STD (default 4; random weights give ~1,
# so flat that top-p alone and min-p keep thousands of ids and take the exact path:
# LOGIT_STD=none keeps them flat).
# tp (4 GPUs):
#   sharded   benchmarks/bench_sharded: shape L, TP 1/2/4, B 16/64/256, sampling
#             inside a jitted 32-step loop
#   tp_e2e    benchmarks/bench_tp_e2e: a 32B-class decoder (4 layers) with its LM
#             head split over TP 1/2/4, qwen3 config, B 1/16/64/256
#
# Limits in seconds (env): T_FLOOR T_E2E_17 T_E2E_8 T_SHARDED T_TP_E2E. Subsets (env):
# GEN_17 (e2e_1.7b's generation configs, default all), TP_BATCHES (tp_e2e's B). COMPILE_THREADS
# (default 4): bench_e2e's programs compiled at once (1 = one after another). An existing
# PYTHONPATH (e.g. a jax-triton wheel's site dir) is kept, after the repository.
# SUITE_SMOKE=1 runs the same command lines on the CPU with tiny shapes appended
# (argparse keeps the last value of a flag), so CI checks the GPU lines' flags.
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/e2e_suite}
mkdir -p "$OUT"
mode=${1:-single}
PY=${PY:-python3}
suite_start=$(date +%s)
LOGIT_STD=${LOGIT_STD:-4}
S_STD=""
[ "$LOGIT_STD" != none ] && S_STD="--logit-std $LOGIT_STD"
suite_rc=0
S_FLOOR="" S_E2E="" S_SHARDED="" S_TP=""
if [ -n "${SUITE_SMOKE:-}" ]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=4"
  S_FLOOR="--config tiny --attention xla --tokens 2 --prompt-len 4"
  # The e2e steps plot as on the GPU (tests/test_benchmarks_smoke.py checks the plots).
  S_E2E="--smoke --configs tiny --generation-config plain,qwen3 --batches 2 --tokens 2
         --prompt-len 4 --repeats 1"
  S_SHARDED="--smoke --shape smoke --batches 4 --steps 2 --reps 1 --no-plot"
  S_TP="--smoke --config tiny-tp --batches 2 --tokens 2 --prompt-len 4 --repeats 1 --no-plot"
fi

# step NAME LIMIT COMMAND...: runs it under `timeout`, output in $OUT/NAME.log.
step() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit} s): $*"
  timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  [ "$rc" -ne 0 ] && suite_rc=1
  echo "== $name: rc=$rc (124 = time limit) after $(( $(date +%s) - start )) s"
  grep -E "Error|error:|Traceback|failed" "$OUT/$name.log" | grep -v "^\s*$" | tail -n 5 | sed 's/^/   /'
}

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# The GPU's name as the benchmarks write it ("NVIDIA H100 80GB HBM3" -> h100-80gb-hbm3).
GPU=$($PY -c "
import sys, jax
from benchmarks import _timing
print('jax', jax.__version__, jax.devices(), file=sys.stderr)
print(_timing.slug(_timing.device_name()))")
echo "results named after: $GPU"

# want STEP: whether this mode runs step STEP (single: all three).
want() { [ "$mode" = single ] || [ "$mode" = "$1" ]; }

case $mode in
  single|floor|e2e_1.7b|e2e_8b)
    want floor && step floor "${T_FLOOR:-75}" $PY examples/decode.py --config qwen3-8b --batch 1 \
      --tokens 64 --prompt-len 64 --sampler xla --attention xla,cudnn --floor \
      --json "$OUT/floor_${GPU}_qwen3-8b.json" $S_FLOOR
    want floor && grep -E "^weight-read floor|TPOT|failed" "$OUT/floor.log" | sed 's/^/   /'
    # B in an order that keeps the most telling points if the budget runs out;
    # the tables sort by B.
    want e2e_1.7b && step e2e_1.7b "${T_E2E_17:-330}" $PY -m benchmarks.bench_e2e --configs qwen3-1.7b \
      --generation-config "${GEN_17:-all}" --batches 64,1,256,16,128 --tokens 64 --prompt-len 64 \
      --repeats 3 --budget-s $(( ${T_E2E_17:-330} - 70 )) --out "$OUT" $S_STD \
      --compile-threads "${COMPILE_THREADS:-4}" \
      --name "${GPU}_qwen3-1.7b" $S_E2E
    want e2e_8b && step e2e_8b "${T_E2E_8:-300}" $PY -m benchmarks.bench_e2e --configs qwen3-8b \
      --generation-config qwen3,plain --batches 64,1,16,256,128 --tokens 64 --prompt-len 64 \
      --repeats 3 --budget-s $(( ${T_E2E_8:-300} - 80 )) --out "$OUT" $S_STD \
      --compile-threads "${COMPILE_THREADS:-4}" \
      --name "${GPU}_qwen3-8b" $S_E2E
    tables="$(ls "$OUT"/e2e_*.md 2>/dev/null)"
    ;;
  tp)
    step sharded "${T_SHARDED:-180}" $PY -m benchmarks.bench_sharded --shape L \
      --tp 1,2,4 --batches 16,64,256 --steps 32 --reps 10 --out "$OUT" $S_SHARDED
    step tp_e2e "${T_TP_E2E:-260}" $PY -m benchmarks.bench_tp_e2e --tp 1,2,4 \
      --batches "${TP_BATCHES:-1,16,64,256}" --tokens 64 --prompt-len 64 --repeats 3 \
      --budget-s $(( ${T_TP_E2E:-260} - 60 )) --out "$OUT" --name "$GPU" $S_TP
    tables="$(ls "$OUT"/sharded_*.md "$OUT"/tp_e2e_*.md 2>/dev/null)"
    ;;
  *)
    echo "unknown mode $mode: use no argument (one GPU), floor, e2e_1.7b, e2e_8b or 'tp' (4 GPUs)"
    exit 2
    ;;
esac

for t in $tables; do
  echo
  if [ -f "$t" ]; then cat "$t"; else echo "(no $t)"; fi
done
echo
echo "suite ($mode): $(( $(date +%s) - suite_start )) s, rc=$suite_rc; files in $OUT:"
ls "$OUT"
exit $suite_rc
