#!/bin/bash
# One device call: SASS/ptxas dump, Nsight Compute profiles and the epilogue
# ablation of the mosaic kernel (benchmarks/exp_mosaic_profile.py). Outputs
# under $OUT. Usage: bash benchmarks/gpu_profile.sh "256 64"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
BS=${1:-"256 64"}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv
python3 -c "import jax; print(jax.__version__, jax.devices())"
mkdir -p /tmp/dump
for b in $BS; do
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=/tmp/dump/$b \
    timeout 150 python3 benchmarks/exp_mosaic_profile.py ncu $b > /tmp/dump/log_$b.txt 2>&1
  tail -2 /tmp/dump/log_$b.txt
done
ls -la /tmp/dump/* | head -20
tar czf $OUT/dump.tgz -C /tmp dump
for b in $BS; do
  timeout 200 ncu --clock-control none -k regex:flashsample --launch-skip 2 --launch-count 1 \
    --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section SourceCounters --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section SpeedOfLight --import-source no -o /tmp/prof_$b \
    python3 benchmarks/exp_mosaic_profile.py ncu $b > /tmp/ncu_run_$b.log 2>&1
  tail -3 /tmp/ncu_run_$b.log
  ncu --import /tmp/prof_$b.ncu-rep --page details --print-details all > $OUT/ncu_details_$b.txt 2>&1
  ncu --import /tmp/prof_$b.ncu-rep --page source --print-source sass --csv > /tmp/src_$b.csv 2>&1
  grep -E "Registers Per|Duration|Warp Cycles Per Issued|Issued Ipc|Local Memory|Stall" $OUT/ncu_details_$b.txt | head -30
done
tar czf $OUT/ncu_src.tgz -C /tmp $(cd /tmp && ls src_*.csv ncu_run_*.log prof_*.ncu-rep)
timeout 280 python3 benchmarks/exp_mosaic_profile.py time $BS 2>&1 | tee $OUT/ablate.log | tail -20
