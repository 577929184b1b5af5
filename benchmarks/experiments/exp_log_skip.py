"""How often the batch-major epilogue could skip the noise's two logs (#41):
a CPU simulation of one warp's iterations, no GPU.

  python3 -m benchmarks.experiments.exp_log_skip [--tiles 9 18]
      [--logit-std 1.3 4] [--temperature 0.7 1.0] [--warps 64]

At B >= 256 the noise is bound by issue and the integer pipe, ~120
instructions a logit (docs/performance.md, "Large batches: what bounds the
kernel"); threefry's bits are fixed, the two logs of ``g = -log(-log(u))``
(~25 instructions) are not needed where a logit cannot win. A rigorous cheap
bound: ``-log(u) >= 1 - u``, so ``g <= -log(1 - u)``, and with ``1 - u =
m * 2**e`` (``m`` in [0.5, 1), ``frexp``) ``-log(1 - u) <= (1 - e) * ln 2``:
a float subtraction and the exponent's bits. An iteration of the epilogue
loop (a warp's 32 rows x 8 columns of one chunk, 8 logits a thread) could
then draw its exact logs only where some lane's ``t + bound * scale``
reaches its running best (a warp-uniform branch), and the best stays the
same where none does.

This counts those iterations. Each warp sample draws the tempered logits of
32 rows over the warpgroup's ``--tiles`` tiles of 128 ids (in the order the
kernel takes them: tile by tile, chunks of 8 columns, thread ``q`` of a
quad holding columns ``2q, 2q + 1``) as N(0, std) / T, the benchmarks'
logits in distribution (``shapes.random_head``); the uniforms as the
noise's (``[tiny, 1 - 2**-23]``). Scopes of the running best: ``thread``
(each thread's own best per row, as the kernel's slots are now) and
``quad`` (the row's best over its quad, one shuffle-max an iteration).
Tiles per warpgroup: 9 at B = 256 and 18 at 512 on the S head (1187 tiles,
two or four blocks over 132 CTAs, two warpgroups).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

_TINY = np.finfo(np.float32).tiny
_LN2 = np.float32(np.log(2.0))
ROWS, EPI, TILE_V, QUAD = 32, 8, 128, 4


def uniforms(rng, shape):
  """The noise's uniforms: 23 random mantissa bits, ``max(tiny, u)``."""
  bits = rng.integers(0, 1 << 23, size=shape, dtype=np.uint32)
  return np.maximum(bits.astype(np.float32) * np.float32(2.0 ** -23), _TINY)


def gumbel(u):
  return -np.log(-np.log(u.astype(np.float64))).astype(np.float32)


def gumbel_bound(u):
  """An upper bound of ``-log(-log(u))`` from ``1 - u``'s exponent
  (``1 - u`` is exact in float32 for u >= 0.5; below, the bound's ln 2
  exceeds every g, whose largest there is 0.367). It meets g where ``1 - u``
  is a power of two: a kernel would add a few ulps of margin for its f32
  logs."""
  _, e = np.frexp(np.float32(1.0) - u)
  return (1 - e).astype(np.float32) * _LN2


def skipped_fraction(rng, *, tiles: int, std: float, temperature: float,
                     scope: str) -> float:
  """One warp sample: the fraction of its ``tiles * TILE_V / EPI``
  iterations in which no lane's bound reaches its running best."""
  if scope not in ("thread", "quad"):
    raise ValueError(f"scope={scope!r} must be 'thread' or 'quad'")
  t = (rng.standard_normal((ROWS, tiles * TILE_V)).astype(np.float32) * np.float32(std)
       / np.float32(temperature))
  u = uniforms(rng, t.shape)
  exact, bound = t + gumbel(u), t + gumbel_bound(u)
  cols = np.arange(EPI)
  owner = (cols // 2) % QUAD  # the quad's thread holding each column
  best = np.full((ROWS, QUAD), -np.inf, np.float32)
  skipped = 0
  iters = tiles * TILE_V // EPI
  for it in range(iters):
    sl = slice(it * EPI, (it + 1) * EPI)
    if scope == "quad":
      thr = np.broadcast_to(best.max(axis=1, keepdims=True), (ROWS, EPI))
    else:
      thr = best[:, owner]
    if not (bound[:, sl] >= thr).any():
      skipped += 1
      continue
    for q in range(QUAD):
      mine = owner == q
      best[:, q] = np.maximum(best[:, q], exact[:, sl][:, mine].max(axis=1))
  return skipped / iters


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tiles", type=int, nargs="+", default=[9, 18])
  ap.add_argument("--logit-std", type=float, nargs="+", default=[1.3, 4.0])
  ap.add_argument("--temperature", type=float, nargs="+", default=[0.7, 1.0])
  ap.add_argument("--warps", type=int, default=64)
  args = ap.parse_args()
  for tiles in args.tiles:
    for std in args.logit_std:
      for temp in args.temperature:
        rec = dict(tiles=tiles, logit_std=std, temperature=temp, warps=args.warps)
        for scope in ("thread", "quad"):
          rng = np.random.default_rng(0)
          fr = [skipped_fraction(rng, tiles=tiles, std=std, temperature=temp, scope=scope)
                for _ in range(args.warps)]
          rec[f"skipped_{scope}"] = round(float(np.mean(fr)), 4)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
