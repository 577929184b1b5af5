"""Where a call with penalties spends its time (issue #23): the GPU kernels
of one call from a profiler trace, next to plain sampling and the mask
alone (the same controls kernel with one bit-plane), at the controls
benchmark's penalties (repetition 1.2, presence 0.5, frequency 0.3, 128
prompt + 128 output ids per row, shape S).

  python3 -m benchmarks.experiments.exp_penalties 1,16,64 [--profile]

Prints one JSON line per (B, variant); with ``--profile`` also each
variant's kernels (start and duration in us, name) of its last call.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import _timing
from benchmarks.bench_controls import HISTORY, PENALTIES
from benchmarks.shapes import HEADS, random_head


def _profile(f, *args):
  events, _ = _timing.trace_events(f, *args, calls=3)
  mains = [i for i, e in enumerate(events) if "flashsample" in e[2]]
  if len(mains) < 2:
    return []
  # One call's worth of kernels: after one main kernel up to the next one
  # (the previous call's finish, then this call's preparation and kernel).
  events = events[mains[-2] + 1:mains[-1] + 1]
  t0 = events[0][0]
  return [f"{(s - t0) / 1e3:8.1f} {d / 1e3:7.1f}  {n[:100]}" for s, d, n, _ in events]


def main(batches, profile):
  d, v = HEADS["S"]
  w = random_head("S")
  key = jax.random.key(7)
  for b in batches:
    h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
    km = jax.random.key(b + 100)
    prompt = jax.random.randint(jax.random.fold_in(km, 2), (b, HISTORY), 0, v)
    output = jax.random.randint(jax.random.fold_in(km, 3), (b, HISTORY), 0, v)
    mask = jnp.full((b, -(-v // 32)), 0xFFFFFFFF, jnp.uint32)
    variants = {
        "plain": lambda k, h, w, p, o, m: fs.sample(h, w, k),
        "mask": lambda k, h, w, p, o, m: fs.sample(h, w, k, allowed_mask=m),
        "penalties": lambda k, h, w, p, o, m: fs.sample(
            h, w, k, prompt_ids=p, output_ids=o, **PENALTIES),
    }
    for name, f in variants.items():
      f = jax.jit(f)
      args = (key, h, w, prompt, output, mask)
      us, _ = _timing.median_us(f, *args, reps=15, inner=50)
      print(json.dumps(dict(B=b, variant=name, us=round(us, 1))), flush=True)
      if profile:
        print("\n".join(_profile(f, *args)), flush=True)


if __name__ == "__main__":
  main([int(x) for x in sys.argv[1].split(",")], "--profile" in sys.argv)
