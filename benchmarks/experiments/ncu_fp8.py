"""The FP8 register path under Nsight Compute (issue #40: where plain FP8
sampling loses the ~20% above its weight-read floor).

Runs plain sampling of an FP8 (e4m3, per-row scales) head (``--bf16``: the
bf16 head, to compare) through the mosaic backend ``--calls`` times at one
B; profile the last launch of the kernel:

  ncu --clock-control none --kernel-name-base mangled \\
      --kernel-name regex:flashsample_sm90_mosaic --launch-skip 2 --launch-count 1 \\
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
      --section Occupancy --section LaunchStats \\
      python3 -m benchmarks.experiments.ncu_fp8 --head S --batch 1
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks.shapes import HEADS, random_head


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--head", default="S", choices=sorted(HEADS))
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--calls", type=int, default=3)
  ap.add_argument("--bf16", action="store_true", help="the bf16 head instead, to compare")
  args = ap.parse_args(argv)
  d, _ = HEADS[args.head]
  w8, scale = fs.quantize_weight(random_head(args.head), jnp.float8_e4m3fn)
  if args.bf16:
    w8, scale = random_head(args.head), None
  h = jax.random.normal(jax.random.key(args.batch), (args.batch, d), jnp.bfloat16)
  f = jax.jit(lambda h, w, s, k: fs.sample(h, w, k, weight_scale=s, temperature=0.7,
                                           backend="mosaic"))
  for i in range(args.calls):
    tok = f(h, w8, scale, jax.random.key(i)).block_until_ready()
  print(f"head={args.head} B={args.batch} W_bytes={w8.size} "
        f"tokens={int(np.asarray(tok).sum())}", flush=True)


if __name__ == "__main__":
  main()
