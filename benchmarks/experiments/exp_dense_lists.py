"""Candidate lists of the dense route read off slots of ids
(``flashsample_jax.dense_lists``) against ``lax.top_k`` over the whole
vocabulary, beside the fused kernels and plain sampling (issue #40:
top-k + top-p with an 8-bit head).

  python3 -m benchmarks.experiments.exp_dense_lists [--heads S] [--batches 16 64]
      [--weight-dtypes fp8 bf16] [--rounds 2]

For each head, weight dtype and B (random inputs, T 1, top-k 50 + top-p
0.9, the benchmark's logits): the rows each dense variant sends to the exact
path (un-timed), then, in alternating rounds (``_timing.timed_rounds``), us
per call of

* ``fused``: ``fs.sample`` through ``auto`` with top-k + top-p;
* ``dense_topk``: ``backend="dense"`` (XLA's GEMM, ``lax.top_k`` lists);
* ``dense_slots``: ``DenseBackend(list_select="slots")``;
* ``plain``: ``fs.sample`` through ``auto`` without controls (the bar's
  denominator: top-k + top-p <= 1.2x plain);
* ``dot``: XLA's GEMM alone.

One JSON line per round, one more per (head, dtype, B) with the exact rows.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._fallback import exact_path_rows
from benchmarks._timing import device_name, timed_rounds
from benchmarks.bench_controls import TOP_K, TOP_P
from flashsample_jax.backends.xla import DenseBackend

_DENSE = {"dense_topk": DenseBackend(), "dense_slots": DenseBackend(list_select="slots")}


def _head(head: str, dtype: str):
  w = shapes.random_head(head)
  if dtype == "bf16":
    return w, None
  return fs.quantize_weight(w, "float8_e4m3fn")


def _variants(key, scale):
  trunc = dict(top_k=TOP_K, top_p=TOP_P, weight_scale=scale)
  out = {"fused": jax.jit(lambda h, w: fs.sample(h, w, key, **trunc))}
  for name, be in _DENSE.items():
    out[name] = jax.jit(lambda h, w, be=be: fs.sample(h, w, key, backend=be, **trunc))
  out["plain"] = jax.jit(lambda h, w: fs.sample(h, w, key, weight_scale=scale))
  out["dot"] = jax.jit(lambda h, w: jnp.dot(h, w.astype(h.dtype).T,
                                            preferred_element_type=jnp.float32))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S"], choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
  ap.add_argument("--weight-dtypes", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
  ap.add_argument("--rounds", type=int, default=2)
  args = ap.parse_args(argv)
  key = jax.random.key(0)
  for head in args.heads:
    d, _ = shapes.HEADS[head]
    for dtype in args.weight_dtypes:
      w, scale = _head(head, dtype)
      variants = _variants(key, scale)
      for b in args.batches:
        h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
        tags = dict(gpu=device_name(), jax=jax.__version__, head=head, weight=dtype, B=b)
        rows = {name: exact_path_rows(h, w, key, backend=be, weight_scale=scale,
                                      top_k=TOP_K, top_p=TOP_P) for name, be in _DENSE.items()}
        print(json.dumps(dict(tags, exact_rows=rows)), flush=True)
        timed_rounds(variants, h, w, rounds=args.rounds, **tags)


if __name__ == "__main__":
  main()
