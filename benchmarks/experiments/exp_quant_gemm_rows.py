"""XLA's GEMM of an 8-bit head at small batches, with the hidden states
padded to more rows (issue #40).

The dense route's logits of an FP8 head are XLA's dot of the converted
weight. Its plain time at B = 1 measured longer than at B = 16 (S: 216
against 173 us; docs/performance.md, "Quantized heads"), so the question is
whether padding H to P rows before the dot (and slicing the logits back)
buys XLA's faster kernel for B < P. Timed in alternating rounds
(``_timing.timed_rounds``), random inputs, FP8 e4m3 with per-row scales:

* ``rows``: the dot at B rows (``problem.logits``, the dense route's);
* ``pad8`` / ``pad16`` / ``pad32``: H padded with zero rows to P, the dot,
  the first B rows of the logits;

and, with ``--calls``, ``fs.sample(..., backend="dense")`` plain and with
top-k 50 + top-p 0.9 (T 0.7) at B, for scale.

  python3 -m benchmarks.experiments.exp_quant_gemm_rows [--heads S L]
      [--batches 1 2 4 8 16] [--rounds 3] [--calls]

Prints one JSON line per (head, B, round).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks._timing import timed_rounds
from benchmarks.shapes import HEADS, fp8_points
from flashsample_jax import problem


def _padded_dot(rows: int):
  def run(h, w, s, keys):
    del keys
    b = h.shape[0]
    hp = jnp.pad(h, ((0, max(rows - b, 0)), (0, 0)))
    return problem.logits(hp, w, "vd", s)[:b]
  return run


def _variants(b: int, calls: bool):
  out = {"rows": lambda h, w, s, keys: problem.logits(h, w, "vd", s)}
  for rows in (8, 16, 32):
    if rows > b:
      out[f"pad{rows}"] = _padded_dot(rows)
  if calls:
    out["dense_plain"] = lambda h, w, s, keys: fs.sample(
        h, w, keys, weight_scale=s, temperature=0.7, backend="dense")
    out["dense_topk_topp"] = lambda h, w, s, keys: fs.sample(
        h, w, keys, weight_scale=s, temperature=0.7, top_k=50, top_p=0.9, backend="dense")
  return {name: jax.jit(f) for name, f in out.items()}


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", nargs="+", default=["S", "L"], choices=sorted(HEADS))
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--calls", action="store_true")
  args = ap.parse_args(argv)
  for head, b, h, w8, scale, keys in fp8_points(args.heads, args.batches):
    timed_rounds(_variants(b, args.calls), h, w8, scale, keys, rounds=args.rounds,
                 head=head, B=b)


if __name__ == "__main__":
  main()
