"""The XLA kernels around a plain 8-bit call's sampling kernel (#40, #41).

  python3 -m benchmarks.experiments.exp_prelaunch [--heads S L qwen3-1.7b]
      [--batches 1 16] [--rounds 3] [--variants transpose gather]

Under Nsight Compute a plain FP8 call at B = 1 ran five kernels (the per-row
block's concatenate, its pad to the launch's rows, H's pad and column
permutation, the sampling kernel, stage 2's row reduction) where a bf16
call runs three (docs/performance.md, "Quantized heads"). The register
path's column permutation of H (``sm90_common.permute_k``) is one of them.
Variants, each the permutation's form while the call compiles:

* ``transpose``: a reshape and a transpose of groups of 16 columns.
* ``gather``: one gather of H's columns by a constant index.

For each head, B and variant: the compiled program's fusions and custom
calls, a device timeline of back-to-back calls (kernels per call, busy and
idle us), then alternating rounds of wall time. Every variant's tokens are
checked against the reference on exact inputs, and on the timed random
inputs against the first variant's.
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name, timed_rounds
from benchmarks.experiments.exp_small_b_timeline import timeline
from flashsample_jax import reference
from pallas_kernels import sm90_common

_TRANSPOSE = sm90_common.permute_k


def _gather(x, axis: int = -1):
  """``permute_k`` as one gather by a constant index."""
  axis = axis % x.ndim
  n = x.shape[axis]
  k = np.arange(n)
  src = (k & ~0b1010) | ((k >> 2) & 0b10) | ((k << 2) & 0b1000)   # swap bits 3 and 1
  return jnp.take(x, jnp.asarray(src, jnp.int32), axis=axis)


VARIANTS = {"transpose": _TRANSPOSE, "gather": _gather}


def compiled(variant: str, h, w, key, scale):
  """Plain FP8 sampling (T 0.7, the mosaic backend), compiled ahead of time
  with ``variant``'s permutation; the executable keeps it."""
  sm90_common.permute_k = VARIANTS[variant]
  try:
    jax.clear_caches()
    f = jax.jit(lambda h, w, k, s: fs.sample(h, w, k, temperature=0.7, weight_scale=s,
                                             backend="mosaic"))
    exe = f.lower(h, w, key, scale).compile()
  finally:
    sm90_common.permute_k = _TRANSPOSE
  return exe


def program_kernels(exe) -> dict:
  """The entry computation's fusions (by kind) and custom-call targets."""
  text = exe.as_text()
  entry = text[text.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  kinds = re.findall(r"fusion\(.*?kind=(k\w+)", entry)
  calls = re.findall(r'custom_call_target="([^"]*)"', entry)
  return dict(fusions=len(kinds), kinds=sorted(kinds), custom_calls=calls)


def exact_check(variants, b: int, dim: int = 4096, vocab: int = 32000) -> bool:
  from tests import inputs  # pylint: disable=import-outside-toplevel
  h, w, scale = inputs.quantized_inputs(b, dim, vocab, seed=b)
  key = jax.random.key(b)
  ref = reference.sample(h, w, key, temperature=0.7, weight_scale=scale)
  return {v: bool(jnp.all(compiled(v, h, w, key, scale)(h, w, key, scale) == ref))
          for v in variants}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S", "L", "qwen3-1.7b"],
                  choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  args = ap.parse_args()
  print(json.dumps(dict(gpu=device_name(), jax=jax.__version__,
                        exact_tokens={b: exact_check(args.variants, b) for b in (1, 16)})),
        flush=True)
  key = jax.random.key(0)
  for head in args.heads:
    d, _ = shapes.HEADS[head]
    w, scale = fs.quantize_weight(shapes.random_head(head, 1.3))
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      exes = {v: compiled(v, h, w, key, scale) for v in args.variants}
      fns = {v: (lambda e: lambda h, w: e(h, w, key, scale))(e) for v, e in exes.items()}
      first = fns[args.variants[0]](h, w)
      tags = dict(head=head, B=b)
      for v, f in fns.items():
        print(json.dumps(dict(tags, variant=v, tokens_equal_first=float(jnp.mean(f(h, w) == first)),
                              **program_kernels(exes[v]), **timeline(f, h, w, calls=20))),
              flush=True)
      timed_rounds(fns, h, w, rounds=args.rounds, **tags)


if __name__ == "__main__":
  main()
