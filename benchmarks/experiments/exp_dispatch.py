"""What traced checks cost a jitted call: the same programs traced with
``fs.traced_checks()`` on and off (docs/performance.md, "Dispatch").

  python -m benchmarks.experiments.exp_dispatch [--head S] [--batches 1 16 64]

A ``checkify`` check in a trace carries a JAX effect even where it lowers to
nothing, and a program with an effect is dispatched by JAX's Python path
instead of its C++ one. Per call and B: the median wall us per call of
back-to-back calls (``median_us``), checks off and on, and whether the
traced program has effects. Calls: ``fs.sample`` with per-row traced
temperatures (Qwen3's config: T, top-k 20, top-p 0.95 as ``[B]`` arrays),
``fs.verify_drafts`` of B requests at K = 4 (traced drafts), and
``fs.score_tokens`` of B rows (traced tokens). One JSON line each.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name, median_us

K = 4


def calls(w, d, v, b):
  """name -> (function, arguments): the traced-control programs at batch ``b``."""
  key = jax.random.key(0)
  h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
  hk = jax.random.normal(jax.random.key(b + 1), (b, K + 1, d), jnp.bfloat16)
  t = jnp.full((b,), 0.6, jnp.float32)
  tk = jnp.full((b,), 20, jnp.int32)
  tp = jnp.full((b,), 0.95, jnp.float32)
  drafts = jax.random.randint(jax.random.key(2), (b, K), 0, v, jnp.int32)
  tokens = jax.random.randint(jax.random.key(3), (b,), 0, v, jnp.int32)
  return {
      "sample_qwen3_traced": (lambda h, w, t, tk, tp: fs.sample(
          h, w, key, temperature=t, top_k=tk, top_p=tp), (h, w, t, tk, tp)),
      "verify_one_hot_k4": (lambda hk, w, dr, t, tk, tp: fs.verify_drafts(
          hk, w, key, dr, temperature=t, top_k=tk, top_p=tp), (hk, w, drafts, t, tk, tp)),
      "score_tokens": (lambda h, w, tok: fs.score_tokens(h, w, tok), (h, w, tokens)),
  }


def timed(f, args, checks: bool):
  """(median us per call, whether the traced program has effects) with
  traced checks on or off while it is traced and called."""
  with fs.traced_checks(checks):
    effects = bool(jax.make_jaxpr(f)(*args).effects)
    us = median_us(jax.jit(f), *args)[0]
  return round(us, 1), effects


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--head", default="S", choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
  ap.add_argument("--smoke", action="store_true", help="a tiny head, for a CPU")
  args = ap.parse_args()
  d, v = (256, 4096) if args.smoke else shapes.HEADS[args.head]
  w = shapes.random_weight(d, v, 1.3)
  for b in args.batches:
    for name, (f, a) in calls(w, d, v, b).items():
      off, eff_off = timed(f, a, False)
      on, eff_on = timed(f, a, True)
      print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, head=args.head, B=b,
                            call=name, checks_off_us=off, checks_on_us=on,
                            on_over_off=round(on / off, 3), effects_off=eff_off,
                            effects_on=eff_on)), flush=True)


if __name__ == "__main__":
  main()
