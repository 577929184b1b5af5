#!/bin/bash
# compute-sanitizer memcheck, racecheck and synccheck over every kernel
# schedule (the Mosaic sampling kernel, the Mosaic controls kernel, the Triton
# kernels), each tool on each group as its own process, all of them at once
# (one GPU, 16 cores: the programs are small, compiling is the cost).
#
#   bash benchmarks/sanitize.sh [LOGDIR] [tool|group ...]
#
# LOGDIR (default /tmp/sanitize) gets sanitizer_<tool>_<group>.log and
# sanitizer_summary.txt. Where $OUT is set (the device machine) and is not
# LOGDIR, $OUT gets sanitizer_logs.tar.gz (all of them) and the summary:
# two files, as $OUT returns at most 8. Names after LOGDIR pick tools and/or
# groups (default all: memcheck racecheck synccheck x mosaic_plain
# mosaic_controls triton).
#
# Each run: python3 -m benchmarks.sanitize_kernels --sanitize TOOL GROUP,
# which builds the sanitizer command and environment in Python (the same
# ones tests/test_sanitizers.py uses; `--commands` prints them), stops the
# run after T seconds (default 420), writes the log and prints one line:
# PASS/FAIL, the sanitizer's summary, the tokens checked, exit status, time.
# Exit status: 0 iff every run passed.
#
# Env: PYTHON (default python3), T (seconds per run), JOBS (runs at once,
# default 9), COMPUTE_SANITIZER (path; default found on PATH or in CUDA).
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T=${T:-420}
JOBS=${JOBS:-9}
LOGDIR=${1:-/tmp/sanitize}
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$LOGDIR" || exit 2
LOGDIR=$(cd "$LOGDIR" && pwd)

tools=() groups=()
for name in "$@"; do
  case $name in
    memcheck|racecheck|synccheck) tools+=("$name") ;;
    mosaic_plain|mosaic_controls|triton) groups+=("$name") ;;
    *) echo "unknown tool or group: $name" >&2; exit 2 ;;
  esac
done
(( ${#tools[@]} )) || tools=(memcheck racecheck synccheck)
(( ${#groups[@]} )) || groups=(mosaic_plain mosaic_controls triton)

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | sed -n 1p
"$PY" -m benchmarks.sanitize_kernels --commands | sed -n 1p
"$PY" -c "import jax; print('jax', jax.__version__)" 2>&1 | tail -n 1

tmp=$(mktemp -d)
start=$SECONDS
for group in "${groups[@]}"; do
  for tool in "${tools[@]}"; do
    while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n; done
    (
      timeout -k 30 $(( T + 120 )) "$PY" -m benchmarks.sanitize_kernels \
        --sanitize "$tool" "$group" --log-dir "$LOGDIR" --timeout "$T" \
        > "$tmp/$tool.$group.out" 2>&1
      echo $? > "$tmp/$tool.$group.rc"
    ) &
  done
done
wait

fail=0
summary="$LOGDIR/sanitizer_summary.txt"
: > "$summary"
for group in "${groups[@]}"; do
  for tool in "${tools[@]}"; do
    rc=$(cat "$tmp/$tool.$group.rc" 2>/dev/null || echo missing)
    line=$(grep -E '^\S+ +\S+ +(PASS|FAIL) ' "$tmp/$tool.$group.out" | tail -n 1)
    if [[ -z $line ]]; then
      line="$tool $group FAIL  no summary (driver exit $rc): $(tail -c 300 "$tmp/$tool.$group.out" | tr '\n' ' ')"
    fi
    [[ $rc == 0 && $line == *" PASS "* ]] || fail=1
    echo "$line" | tee -a "$summary"
  done
done
echo "total $(( SECONDS - start )) s; logs in $LOGDIR" | tee -a "$summary"
rm -rf "$tmp"

if [[ -n ${OUT:-} && $(cd "$OUT" 2>/dev/null && pwd) != "$LOGDIR" ]]; then
  mkdir -p "$OUT"
  tar czf "$OUT/sanitizer_logs.tar.gz" -C "$LOGDIR" \
    $(cd "$LOGDIR" && ls sanitizer_*.log sanitizer_summary.txt 2>/dev/null)
  cp "$summary" "$OUT/"
fi
exit $fail
