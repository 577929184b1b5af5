"""Plain sampling of an 8-bit head on the dense route against XLA's way, by
device timeline (#40: the dense route reads 0.95-1.0x XLA's time where
``auto`` takes it, L at B = 49-79 and B > 128).

  python3 -m benchmarks.experiments.exp_dense_plain_timeline [--heads L S]
      [--batches 64 256] [--calls 20]

For each head and batch size (FP8 e4m3 per-row scales, T 1), four programs
in one process: ``dot``, XLA's GEMM of the converted weight times the scale;
``xla``, that and ``jax.random.categorical`` (XLA's way); ``dense``,
``fs.sample(..., backend="dense")``; ``auto``. For each, the wall time per
call and its device timeline (``exp_small_b_timeline.timeline``): the
kernels of the last call with the gap before each, busy and idle time. Both
sides pay the same GEMM, so what differs is the kernels after it.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name
from benchmarks.experiments.exp_small_b_timeline import timeline


def programs(key, scale) -> dict:
  logits = lambda h, w: jnp.dot(h, w.astype(jnp.bfloat16).T,
                                preferred_element_type=jnp.float32) * scale
  return {
      "dot": jax.jit(logits),
      "xla": jax.jit(lambda h, w: jax.random.categorical(key, logits(h, w))),
      "dense": jax.jit(lambda h, w: fs.sample(h, w, key, weight_scale=scale,
                                              backend="dense")),
      "auto": jax.jit(lambda h, w: fs.sample(h, w, key, weight_scale=scale)),
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["L", "S"], choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
  ap.add_argument("--calls", type=int, default=20)
  args = ap.parse_args()
  key = jax.random.key(0)
  for head, b, h, w, scale, _ in shapes.fp8_points(args.heads, args.batches, logit_std=1.3):
    for name, f in programs(key, scale).items():
      t = timeline(f, h, w, calls=args.calls)
      print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, head=head, B=b,
                            program=name, **t)), flush=True)


if __name__ == "__main__":
  main()
