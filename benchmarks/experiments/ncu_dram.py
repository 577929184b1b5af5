"""DRAM bytes per call of the Hopper kernel's blocked launches (issue #20:
"verify with ncu that DRAM bytes stay ~1 W per call").

Runs plain sampling (backend mosaic, the heuristic's launches) once per
(head, B); run it under Nsight Compute, which counts every launch of the
kernel:

  ncu --clock-control none --kernel-name-base mangled \\
      --kernel-name regex:flashsample_sm90_mosaic \\
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,gpu__time_duration.sum \\
      --csv python3 -m benchmarks.experiments.ncu_dram S:128,256,512,1024 L:256,512

Prints, per call, W's bytes (what one pass over W from HBM reads) so that
the report's rows can be read against it.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

import flashsample_jax as fs
from benchmarks.shapes import points


def main(specs):
  f = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=0.7, backend="mosaic"))
  for head, _, _, b, w, h in points(specs):
    tok = f(h, w, jax.random.key(2)).block_until_ready()
    print(f"call head={head} B={b} W_bytes={w.size * 2} H_bytes={h.size * 2} "
          f"tokens={int(np.asarray(tok).sum())}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
