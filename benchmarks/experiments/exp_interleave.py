"""Alternating measurements of close variants, for route decisions at large B.

At large batches the GPU runs at its power cap and a variant's time depends
on what ran just before it (PERF_LOG, sixteenth session: one config measured
1070 and 1154 us in one process). This measures the variants in turn,
``rounds`` times, and prints every round's medians, so that a decision rests
on the spread, not on one ordering:

  python3 -m benchmarks.experiments.exp_interleave L:256 S:256 qwen3-1.7b:256 --rounds 5

Variants per point: XLA's dot + categorical, the dense route, the Hopper
kernel with the heuristic's launch, and (where D allows) the same launch
with Dt = 128 in the most slots that fit, or, where the heuristic runs
more than 128 rows in one launch, batch blocks of 128. Prints one JSON line per point
and round.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks._timing import timed_rounds
from benchmarks.shapes import points
from flashsample_jax.backends.mosaic import MosaicBackend
from pallas_kernels import sm90_sampler
from pallas_kernels.sm90_config import BLOCK_ROWS, SMEM_BUDGET, pick_blocked_config


def _variants(d, v, b, t):
  out = {
      "xla": jax.jit(lambda h, w, k: jax.random.categorical(
          k, jnp.dot(h, w.T, preferred_element_type=jnp.float32) / t)),
      "dense": jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=t, backend="dense")),
      "kernel": jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=t, backend="mosaic")),
  }
  launches = sm90_sampler.launches(b, d, v, 2)
  cfg = launches[0][2]
  if len(launches) == 1 and cfg.batch_blocks == 1 and b > BLOCK_ROWS:
    # One launch of all rows: also the batch blocks of 128 rows.
    be = MosaicBackend(config=pick_blocked_config(b, d, v))
    out["kernel_blocks"] = jax.jit(
        lambda h, w, k, be=be: fs.sample(h, w, k, temperature=t, backend=be))
  if len(launches) == 1 and cfg.batch_blocks > 1 and cfg.tile_d != 128 and d % 128 == 0:
    n = launches[0][3]
    for steps in (4, 3, 2):
      wide = dataclasses.replace(cfg, tile_d=128, max_concurrent_steps=steps)
      if wide.smem_bytes(n, 2) <= SMEM_BUDGET:
        be = MosaicBackend(config=wide)
        out[f"kernel_dt128_s{steps}"] = jax.jit(
            lambda h, w, k, be=be: fs.sample(h, w, k, temperature=t, backend=be))
        break
  return out


def main(specs, rounds):
  key = jax.random.key(7)
  for head, d, v, b, w, h in points(specs):
    variants = _variants(d, v, b, jnp.float32(0.7))
    for f in variants.values():
      jax.block_until_ready(f(h, w, key))
    timed_rounds(variants, h, w, key, rounds=rounds, head=head, b=b)


if __name__ == "__main__":
  args = sys.argv[1:]
  rounds = 5
  if "--rounds" in args:
    i = args.index("--rounds")
    rounds = int(args[i + 1])
    del args[i:i + 2]
  main(args, rounds)
