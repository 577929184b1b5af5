"""Candidate lists of the dense route read off slots of ids
(``flashsample_jax.dense_lists``) against ``lax.top_k`` over the whole
vocabulary, beside the fused kernels and plain sampling (issue #40:
top-k + top-p with an 8-bit head).

  python3 -m benchmarks.experiments.exp_dense_lists [--heads S] [--batches 16 64]
      [--weight-dtypes fp8 int8 bf16] [--variants ...] [--rounds 2] [--timeline] [--scopes]

For each head, weight dtype and B (random inputs, T 1, top-k 50 + top-p
0.9, the benchmark's logits): the rows each dense variant sends to the exact
path (un-timed), then, in alternating rounds (``_timing.timed_rounds``), us
per call of

* ``auto``: ``fs.sample`` through ``auto`` with top-k + top-p;
* ``mosaic`` / ``triton``: the fused controls kernel of that backend;
* ``dense_topk``: ``DenseBackend(list_select="top_k")`` (XLA's GEMM,
  ``lax.top_k`` lists);
* ``dense_slots``: ``DenseBackend(list_select="slots")``;
* ``dense_kernel``: ``DenseBackend(list_select="kernel")`` (the Triton list
  kernels, ``pallas_kernels.triton_lists``);
* ``plain``: ``fs.sample`` through ``auto`` without controls (the bar's
  denominator: top-k + top-p <= 1.2x plain);
* ``dot``: XLA's GEMM alone.

One JSON line per round, one more per (head, dtype, B) with the exact rows.
With ``--timeline``: instead of the rounds, one line per variant with its
device timeline (``exp_small_b_timeline.timeline``: the kernels of a call
and their times). With ``--scopes``: one more line per variant, its compiled
program's kernels with the named scopes of the code each comes from
(``hlo_scopes.kernel_scopes``), to read the timeline's kernel names against.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks._fallback import exact_path_rows
from benchmarks.bench_controls import TOP_K, TOP_P
from benchmarks.experiments._points import add_point_args, points, report
from benchmarks.experiments.hlo_scopes import kernel_scopes
from flashsample_jax.backends.xla import DenseBackend

_DENSE = {"dense_topk": DenseBackend(list_select="top_k"),
          "dense_slots": DenseBackend(list_select="slots"),
          "dense_kernel": DenseBackend(list_select="kernel")}
VARIANTS = ("auto", "mosaic", "triton", *_DENSE, "plain", "dot")
def _variants(key, scale, names):
  trunc = dict(top_k=TOP_K, top_p=TOP_P, weight_scale=scale)
  backends = {"auto": "auto", "mosaic": "mosaic", "triton": "triton", **_DENSE}
  out = {}
  for name in names:
    if name in backends:
      out[name] = jax.jit(lambda h, w, be=backends[name]: fs.sample(h, w, key, backend=be,
                                                                    **trunc))
    elif name == "plain":
      out[name] = jax.jit(lambda h, w: fs.sample(h, w, key, weight_scale=scale))
    else:
      out[name] = jax.jit(lambda h, w: jnp.dot(h, w.astype(h.dtype).T,
                                               preferred_element_type=jnp.float32))
  return out


# The variants whose exact-path rows and tokens are checked (the fused
# backends by name: for an 8-bit head "mosaic" may run the plain kernel's
# slot lists, MosaicBackend.slot_lists).
_CHECKED = {**_DENSE, "auto": "auto", "mosaic": "mosaic"}


def _same_tokens(h, w, key, scale, names):
  """Per checked variant, the fraction of 16 keys' tokens equal to
  ``dense_topk``'s (the lists' exactness at full size, not timed)."""
  if len(names) < 2 or "dense_topk" not in names:
    return {}
  keys = jax.random.split(key, 16)
  kw = dict(top_k=TOP_K, top_p=TOP_P, weight_scale=scale)

  def tokens(be):
    f = jax.jit(lambda k: fs.sample(h, w, k, backend=be, **kw))
    return np.stack([np.asarray(f(k)) for k in keys])

  want = tokens(_DENSE["dense_topk"])
  return {n: float(np.mean(tokens(_CHECKED[n]) == want)) for n in names if n != "dense_topk"}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_point_args(ap, heads=["S"], batches=[16, 64], weight_dtypes=["fp8", "bf16"], rounds=2)
  ap.add_argument("--variants", nargs="+", choices=VARIANTS,
                  default=["auto", "mosaic", "dense_topk", "dense_slots", "plain", "dot"])
  ap.add_argument("--scopes", action="store_true")
  args = ap.parse_args(argv)
  key = jax.random.key(0)
  for w, scale, h, tags in points(args):
    variants = _variants(key, scale, args.variants)
    rows = {name: exact_path_rows(h, w, key, backend=be, weight_scale=scale,
                                  top_k=TOP_K, top_p=TOP_P)
            for name, be in _CHECKED.items() if name in variants}
    same = _same_tokens(h, w, key, scale, [n for n in _CHECKED if n in variants])
    print(json.dumps(dict(tags, exact_rows=rows, same_tokens=same)), flush=True)
    if args.scopes:
      for name, f in variants.items():
        text = f.lower(h, w).compile().as_text()
        print(json.dumps(dict(tags, variant=name, kernels=kernel_scopes(text))), flush=True)
    report(args, variants, h, w, tags)


if __name__ == "__main__":
  main()
