"""The register path's short last step where 256 does not divide D (#40).

  python3 -m benchmarks.experiments.exp_short_step [--heads gpt-oss]
      [--batches 1 16] [--rounds 3] [--weight-dtypes fp8 int8]

gpt-oss' D = 2880 is not a multiple of the wide 8-bit steps' 256 columns
(docs/performance.md, "Steps that do not divide D"): its last step copies
256 columns from column 2816, 192 of them past the weight's and H's last
(the TMA fills zeros). Variants, each patched in while its call compiles:

* ``full``: that step's conversion and wgmma take all 256 columns (zeros
  times zeros past column 2879).
* ``short``: they take only its 64 columns (``sm90_common.step_count``;
  shipped).

A head of the same vocabulary and D = 3072 took as long as D = 2880
(``h200_exp_fp8_width.jsonl``): a step's time, not its bytes. For each
head, B, dtype and variant: tokens on exact inputs at gpt-oss' width
against the reference (e4m3, e5m2, int8; per-row and per-tensor scales),
the compiled program's fusions, a device timeline of back-to-back calls,
then alternating rounds of wall time (plain sampling, T 0.7, mosaic).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name, timed_rounds
from benchmarks.experiments.exp_register_path import program_kernels
from benchmarks.experiments.exp_small_b_timeline import timeline
from flashsample_jax import reference
from pallas_kernels import sm90_common

VARIANTS = ("full", "short")
_CONSUME = sm90_common.consume_tile


def _full_width(acc_ref, **kw):
  return _CONSUME(acc_ref, **dict(kw, last_cols=None))
_DTYPES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}


def compiled(variant: str, h, w, key, scale):
  """Plain sampling compiled ahead of time with ``variant`` patched in."""
  sm90_common.consume_tile = _full_width if variant == "full" else _CONSUME
  try:
    jax.clear_caches()
    f = jax.jit(lambda h, w, k, s: fs.sample(h, w, k, temperature=0.7, weight_scale=s,
                                             backend="mosaic"))
    return f.lower(h, w, key, scale).compile()
  finally:
    sm90_common.consume_tile = _CONSUME


def exact_check(variant: str, b: int, dim: int, vocab: int = 20011) -> dict:
  """The variant's tokens on exact inputs equal the reference's, per dtype
  and scale kind (or the error that stopped it)."""
  from tests import inputs  # pylint: disable=import-outside-toplevel
  out = {}
  for i, dt in enumerate((jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8)):
    for per_row in (True, False):
      h, w, scale = inputs.quantized_inputs(b, dim, vocab, dtype=dt, per_row=per_row,
                                            seed=b + i)
      key = jax.random.key(b + i)
      name = f"{jnp.dtype(dt).name}/{'row' if per_row else 'tensor'}"
      try:
        got = compiled(variant, h, w, key, scale)(h, w, key, scale)
        ref = reference.sample(h, w, key, temperature=0.7, weight_scale=scale)
        out[name] = bool(jnp.all(got == ref))
      except Exception as e:  # pylint: disable=broad-except
        out[name] = f"{type(e).__name__}: {str(e)[:300]}"
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["gpt-oss"], choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--weight-dtypes", nargs="+", default=["fp8"], choices=list(_DTYPES))
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
  ap.add_argument("--no-timeline", action="store_true")
  args = ap.parse_args()
  dims = sorted({shapes.HEADS[h][0] for h in args.heads})
  exact = {v: {f"D={d} B={b}": exact_check(v, b, d) for d in dims for b in (1, 16)}
           for v in args.variants}
  print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, exact_tokens=exact)),
        flush=True)
  variants = [v for v in args.variants
              if all(r is True for e in exact[v].values() for r in e.values())]
  key = jax.random.key(0)
  for head in args.heads:
    d, _ = shapes.HEADS[head]
    for wd in args.weight_dtypes:
      w, scale = fs.quantize_weight(shapes.random_head(head, 1.3), _DTYPES[wd])
      for b in args.batches:
        h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
        exes = {v: compiled(v, h, w, key, scale) for v in variants}
        fns = {v: (lambda e: lambda h, w: e(h, w, key, scale))(e) for v, e in exes.items()}
        first = fns[variants[0]](h, w)
        tags = dict(head=head, B=b, weight_dtype=wd)
        for v, f in fns.items():
          rec = dict(tags, variant=v, tokens_equal_first=float(jnp.mean(f(h, w) == first)),
                     **program_kernels(exes[v]))
          if not args.no_timeline:
            rec.update(timeline(f, h, w, calls=20))
          print(json.dumps(rec), flush=True)
        timed_rounds(fns, h, w, rounds=args.rounds, **tags)
      del w, scale


if __name__ == "__main__":
  main()
