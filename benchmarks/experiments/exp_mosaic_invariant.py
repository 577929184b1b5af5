"""The mosaic controls kernel's batch-invariant split against its per-B one
(issue #39), in one process.

For each head, mode and B: ``fs.sample(...)`` through
``MosaicBackend()`` (calls that report floats take the fixed split:
blocks of 64 rows, each split over the vocabulary as one block alone) and
``MosaicBackend(batch_invariant=False)`` (128-row blocks without lists,
the SMs shared among a launch's blocks), timed in alternating rounds
(``_timing.timed_rounds``), random bf16 inputs, per-row keys, T 0.7.

  python3 -m benchmarks.experiments.exp_mosaic_invariant [--heads S L]
      [--batches 1 16 64 128 256 512] [--modes logprobs topk_topp_logprobs]

Prints one JSON line per (head, mode, B, round).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks._timing import timed_rounds
from benchmarks.batch_invariance import TEMPERATURE
from benchmarks.shapes import HEADS, random_head
from flashsample_jax.backends.mosaic import MosaicBackend

MODES = {
    "logprobs": dict(return_logprobs=True),
    "topk_topp_logprobs": dict(top_k=50, top_p=0.9, return_logprobs=True),
    "rl_all": dict(top_k=50, top_p=0.9, return_logprobs=True, return_entropy=True,
                   return_raw_logprobs=True),
}
VARIANTS = {"invariant": MosaicBackend(), "per_b": MosaicBackend(batch_invariant=False)}


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", nargs="+", default=["S", "L"], choices=sorted(HEADS))
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 128, 256, 512])
  ap.add_argument("--modes", nargs="+", default=["logprobs", "topk_topp_logprobs"],
                  choices=list(MODES))
  ap.add_argument("--rounds", type=int, default=2)
  args = ap.parse_args(argv)
  for head in args.heads:
    d, _ = HEADS[head]
    w = random_head(head)
    for mode in args.modes:
      kw = MODES[mode]
      for b in args.batches:
        h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
        keys = jax.random.split(jax.random.key(3), b)
        variants = {
            name: jax.jit(lambda h, k, be=be: fs.sample(h, w, k, temperature=TEMPERATURE,
                                                        backend=be, **kw))
            for name, be in VARIANTS.items()}
        timed_rounds(variants, h, keys, rounds=args.rounds, head=head, mode=mode, B=b)


if __name__ == "__main__":
  main()
