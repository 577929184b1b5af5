"""Triton config families and batch invariance (issue #39), in one process.

For each family (a config per batch size, or the table's), on the S head
with random bf16 inputs and per-row keys: ``fs.sample(..., return_logprobs=
True)`` on the first B rows against the same rows of a call of 512 rows
(rows whose token or log-probability bits differ), and the call's time.

  python3 -m benchmarks.experiments.exp_invariant_configs [--batches 1 16 64 128]

Prints one JSON line per (family, B).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks._timing import median_us
from benchmarks.batch_invariance import TEMPERATURE, differing_rows
from benchmarks.shapes import HEADS, random_head
from flashsample_jax.backends.triton import TritonBackend
from pallas_kernels.triton_sampler import TritonConfig as C


def _vocab_on_m(block_v: int, max_block_b: int, warps_per_64: int = 8, stages: int = 4):
  """The vocabulary on M for every B: tiles of ``block_v`` ids, batch
  blocks of 16 up to ``max_block_b`` rows."""
  def pick(b):
    bb = min(max(16, 1 << max(b - 1, 0).bit_length()), max_block_b)
    return C(block_v, bb, 128, max(4, warps_per_64 * bb // 64), stages, True)
  return pick


FAMILIES = {
    "table": lambda b: None,
    "vm64_b64": _vocab_on_m(64, 64),
    "vm64_b128": _vocab_on_m(64, 128),
    "vm64_b32": _vocab_on_m(64, 32),
    "vm64_b64w4": _vocab_on_m(64, 64, warps_per_64=4),
    "vm64_b128w8": _vocab_on_m(64, 128, warps_per_64=4),
    # 128-id tiles: half the hidden-state re-reads per id of the 64-id ones.
    "vm128_b64": _vocab_on_m(128, 64),
    "vm128_b64w4": _vocab_on_m(128, 64, warps_per_64=4),
    "vm128_b64s3": _vocab_on_m(128, 64, stages=3),
}


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 128])
  ap.add_argument("--full", type=int, default=512)
  ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
  args = ap.parse_args(argv)
  d, _ = HEADS["S"]
  w = random_head("S")
  h = jax.random.normal(jax.random.key(7), (args.full, d), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(3), args.full)
  for name in args.families:
    family = FAMILIES[name]

    def run(b):
      backend = TritonBackend(controls_config=family(b))
      return jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=TEMPERATURE,
                                               backend=backend, return_logprobs=True))

    full_f = run(args.full)
    full = full_f(h, w, keys)
    for b in args.batches + [args.full]:
      f = full_f if b == args.full else run(b)
      rec = dict(family=name, B=b, config=str(family(b)))
      if b != args.full:
        rec.update(differing_rows(f(h[:b], w, keys[:b]), full, b))
      rec["us"] = round(median_us(f, h[:b], w, keys[:b], reps=7, inner=20)[0], 1)
      print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
