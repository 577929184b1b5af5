"""The register path's shared loads: 8 bytes of a row per thread
(``WGMMA_UPCAST_4X``) against 4 (``WGMMA_UPCAST_2X``), issue #40.

Plain sampling of an FP8 (e4m3, per-row scales) head through the mosaic
backend, each variant compiled with ``sm90_common.OPERAND_LOAD_BYTES`` set
to its width (a compiled call keeps it), then timed in alternating rounds
(``_timing.timed_rounds``); tokens of both compared on random inputs.

  python3 -m benchmarks.experiments.exp_operand_loads [--heads S L]
      [--batches 1 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

import flashsample_jax as fs
from benchmarks._timing import timed_rounds
from benchmarks.shapes import HEADS, fp8_points
from pallas_kernels import sm90_common


def _compiled(width: int, h, w, s, keys):
  """The call compiled ahead of time with loads of ``width`` bytes (the
  caches cleared first: fs.sample's inner jit would reuse the other
  variant's trace), and its tokens."""
  f = jax.jit(lambda h, w, s, k: fs.sample(h, w, k, weight_scale=s, temperature=0.7,
                                           backend="mosaic"))
  old = sm90_common.OPERAND_LOAD_BYTES
  sm90_common.OPERAND_LOAD_BYTES = width
  try:
    jax.clear_caches()
    compiled = f.lower(h, w, s, keys).compile()
  finally:
    sm90_common.OPERAND_LOAD_BYTES = old
  return compiled, np.asarray(compiled(h, w, s, keys))


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", nargs="+", default=["S", "L"], choices=sorted(HEADS))
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args(argv)
  for head, b, h, w8, scale, keys in fp8_points(args.heads, args.batches):
    variants, tokens = {}, {}
    for width in (8, 4):
      variants[f"load{width}"], tokens[width] = _compiled(width, h, w8, scale, keys)
    print(json.dumps(dict(head=head, B=b, tokens_equal=int((tokens[8] == tokens[4]).sum()),
                          rows=b)), flush=True)
    timed_rounds(variants, h, w8, scale, keys, rounds=args.rounds, head=head, B=b)


if __name__ == "__main__":
  main()
