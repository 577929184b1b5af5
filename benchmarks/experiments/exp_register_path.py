"""The register path's step, and the kernels around its launch (#40).

  python3 -m benchmarks.experiments.exp_register_path [--heads S L qwen3-1.7b]
      [--batches 1 16] [--rounds 3] [--variants base pairs gather]

At B <= 16 plain FP8 sampling converts each 8-bit tile in registers and
feeds it to ``wgmma`` as the A operand (docs/performance.md, "Quantized
heads"). Nsight Compute's source view of that kernel on the S head
(``results/quantized/ncu/ncu_fp8_S1_sass.csv.gz``): one compute warpgroup
converts at a time, its warps issuing ~800 instructions a step (10 per
32-bit word of weights), then waiting for the step's 32 wgmmas. Variants,
each patched in while its call compiles (e4m3, bf16 hidden states):

* ``base``: the conversion before (byte pairs (0, 1) and (2, 3): a byte
  permute per pair; H's columns in the matching order, by a gather).
* ``pairs``: pairs (0, 2) and (1, 3), one shift for both (9 instructions
  a word; the shipped conversion).
* ``gather``: ``pairs`` with H's column permutation as one gather by a
  constant index instead of a transpose (one kernel fewer before the
  launch? ``results/quantized/h200_exp_prelaunch.jsonl``: no).

Commit d284353 also held ``chunks`` and ``chunks64``: the step's
conversion and wgmmas in chunks of 128 (64) columns, each chunk's wgmmas
issued before the next chunk converts (level with ``pairs`` within 1%;
64 columns do not lower: slices of an 8-bit tile must keep its 128-byte
swizzle).

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

_E4M3 = ("float8_e4m3fn", "bfloat16")
_PAIRS_02_13 = sm90_common.CONVERSIONS[_E4M3]
_PAIRS_01_23 = _PAIRS_02_13.replace("shl.b32 w0, $2, 8;", "prmt.b32 w0, $2, 0, 0x1404;") \
                           .replace("mov.b32 w1, $2;", "prmt.b32 w1, $2, 0, 0x3424;")
assert _PAIRS_01_23 != _PAIRS_02_13


def _source(order) -> np.ndarray:
  k = np.arange(16)
  a, b, c, d = k >> 3, (k >> 2) & 1, (k >> 1) & 1, k & 1
  return order(a, b, c, d)


def _gather_01_23(x, axis: int = -1):
  """H's permutation for pairs (0, 1), (2, 3): k = 8a + 4b + 2c + d from
  8c + 4b + 2a + d, as one gather (the code before ran it as a transpose:
  one kernel either way, the call level, ``h200_exp_prelaunch.jsonl``)."""
  return _by_index(x, axis, _source(lambda a, b, c, d: 8 * c + 4 * b + 2 * a + d))


def _by_index(x, axis, src):
  axis = axis % x.ndim
  n = x.shape[axis]
  idx = (np.arange(n) // 16 * 16 + np.tile(src, n // 16)).astype(np.int32)
  return jnp.take(x, jnp.asarray(idx), axis=axis)


def _gather_02_13(x, axis: int = -1):
  """``sm90_common.permute_k`` as one gather by a constant index."""
  return _by_index(x, axis, _source(lambda a, b, c, d: 8 * c + 4 * b + 2 * d + a))


VARIANTS = {
    "base": dict(conversion=_PAIRS_01_23, permute=_gather_01_23),
    "pairs": dict(conversion=_PAIRS_02_13, permute=sm90_common.permute_k),
    "gather": dict(conversion=_PAIRS_02_13, permute=_gather_02_13),
}


def compiled(variant: str, h, w, key, scale):
  """Plain sampling (T 0.7, the mosaic backend) compiled ahead of time with
  ``variant`` patched in; the executable keeps it."""
  v = VARIANTS[variant]
  saved = sm90_common.CONVERSIONS[_E4M3], sm90_common.permute_k
  sm90_common.CONVERSIONS[_E4M3] = v["conversion"]
  sm90_common.permute_k = v["permute"]
  try:
    jax.clear_caches()
    f = jax.jit(lambda h, w, k, s: fs.sample(h, w, k, temperature=0.7, weight_scale=s,
                                             backend="mosaic"))
    return f.lower(h, w, key, scale).compile()
  finally:
    sm90_common.CONVERSIONS[_E4M3], sm90_common.permute_k = saved


def program_kernels(exe) -> dict:
  """The entry computation's fusions (by kind) and custom-call targets."""
  text = exe.as_text()
  entry = text[text.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  kinds = re.findall(r"fusion\(.*?kind=(k\w+)", entry)
  calls = re.findall(r'custom_call_target="([^"]*)"', entry)
  return dict(fusions=len(kinds), kinds=sorted(kinds), custom_calls=calls)


def exact_check(variants, b: int, dim: int = 4096, vocab: int = 32000) -> dict:
  """Per variant: its tokens on exact inputs equal the reference's (or the
  error that stopped it compiling)."""
  from tests import inputs  # pylint: disable=import-outside-toplevel
  h, w, scale = inputs.quantized_inputs(b, dim, vocab, seed=b)
  key = jax.random.key(b)
  ref = reference.sample(h, w, key, temperature=0.7, weight_scale=scale)
  out = {}
  for v in variants:
    try:
      out[v] = bool(jnp.all(compiled(v, h, w, key, scale)(h, w, key, scale) == ref))
    except Exception as e:  # pylint: disable=broad-except
      out[v] = f"{type(e).__name__}: {str(e)[:300]}"
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S", "L", "qwen3-1.7b"],
                  choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--variants", nargs="+", default=["base", "pairs"],
                  choices=list(VARIANTS))
  ap.add_argument("--no-timeline", action="store_true")
  args = ap.parse_args()
  exact = {b: exact_check(args.variants, b) for b in (1, 16)}
  print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, exact_tokens=exact)), flush=True)
  variants = [v for v in args.variants if all(e[v] is True for e in exact.values())]
  key = jax.random.key(0)
  for head in args.heads:
    d, _ = shapes.HEADS[head]
    w, scale = fs.quantize_weight(shapes.random_head(head, 1.3))
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      exes = {v: compiled(v, h, w, key, scale) for v in variants}
      fns = {v: (lambda e: lambda h, w: e(h, w, key, scale))(e) for v, e in exes.items()}
      first = fns[variants[0]](h, w)
      tags = dict(head=head, B=b)
      for v, f in fns.items():
        rec = dict(tags, variant=v, tokens_equal_first=float(jnp.mean(f(h, w) == first)),
                   **program_kernels(exes[v]))
        if not args.no_timeline:
          rec.update(timeline(f, h, w, calls=20))
        print(json.dumps(rec), flush=True)
      timed_rounds(fns, h, w, rounds=args.rounds, **tags)


if __name__ == "__main__":
  main()
