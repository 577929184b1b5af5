"""How much noise bounded-Gumbel pruning could skip on the benchmarks' logits
(#41): an upper bound, computed without a GPU.

  python3 -m benchmarks.experiments.exp_prune_bound [--head qwen3-1.7b] [--batch 64]
      [--logit-std 1.3 4] [--tile-v 128]

Pruning would skip the noise of a tile-row (``--tile-v`` ids of one row)
whose largest logit over T plus the largest Gumbel value the noise can take
(``-log(-log(1 - 2**-23))`` = 15.942385: the noise's uniforms lie in
``[tiny, 1 - 2**-23]``, ``pallas_kernels/threefry.py``) cannot reach the
row's best perturbed score. A kernel knows only its running best when it
reaches a tile; this script compares every tile-row with the row's *final*
best (an oracle), so the fraction it prints bounds from above what any tile
order could skip. Logits are the benchmarks' own: N(0, 1) bf16 hidden
states against ``shapes.random_head(head, logit_std)``, T = 1; the best
perturbed score is drawn with ``jax.random.gumbel`` (the bound needs only its
distribution, not the package's bits).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks import shapes

GUMBEL_MAX = 15.942385


def prunable_fraction(logits, key, tile_v: int) -> float:
  """The fraction of ``tile_v``-wide tile-rows of ``logits [B, V]`` whose
  largest logit plus :data:`GUMBEL_MAX` is below the row's best perturbed
  score (the last partial tile is left out)."""
  b, v = logits.shape
  best = jnp.max(logits + jax.random.gumbel(key, logits.shape, jnp.float32), axis=1)
  n = v // tile_v
  tile_max = jnp.max(logits[:, :n * tile_v].reshape(b, n, tile_v), axis=2)
  return float(jnp.mean(tile_max + GUMBEL_MAX < best[:, None]))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--head", default="qwen3-1.7b", choices=sorted(shapes.HEADS))
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--logit-std", type=float, nargs="+", default=[1.3, 4.0])
  ap.add_argument("--tile-v", type=int, default=128)
  args = ap.parse_args()
  d, _ = shapes.HEADS[args.head]
  h = jax.random.normal(jax.random.key(args.batch), (args.batch, d), jnp.bfloat16)
  for std in args.logit_std:
    w = shapes.random_head(args.head, std)
    logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
    frac = prunable_fraction(logits, jax.random.key(0), args.tile_v)
    print(json.dumps(dict(head=args.head, B=args.batch, logit_std=std, tile_v=args.tile_v,
                          logits_std_measured=round(float(jnp.std(logits)), 2),
                          prunable_tile_rows=round(frac, 5))), flush=True)


if __name__ == "__main__":
  main()
