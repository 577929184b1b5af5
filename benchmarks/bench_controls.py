"""Sampling controls: fused vs XLA baselines that materialize the logits.

Run on the GPU (one process, one run)::

    PYTHONPATH=. python3 benchmarks/bench_controls.py [--out DIR] [--smoke]

Providers, on shape S (D 4096, V 151936, bf16), B in {1, 16, 64, 256}:

* ``fused_plain``: ``fs.sample`` with temperature only (backend auto);
* ``fused_topk_topp``: ``fs.sample(top_k=50, top_p=0.9)`` (backend auto; the
  mosaic kernel has no controls yet, so this is the xla backend);
* ``xla_plain``: ``jax.random.categorical(k, dot(h, w.T))``;
* ``xla_topk_topp``: logits, ``lax.top_k(50)``, top-p on the 50, categorical;
* ``xla_sort_topp``: logits, full sort, cumsum top-p, categorical.

Writes ``controls_<gpu>.json`` / ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashsample_jax as fs  # noqa: E402
from benchmarks import _timing  # noqa: E402

TOP_K, TOP_P = 50, 0.9


def _logits(h, w):
  return jnp.dot(h, w.T, preferred_element_type=jnp.float32)


def _xla_topk_topp(k, h, w):
  vals, ids = jax.lax.top_k(_logits(h, w), TOP_K)           # sorted descending
  q = jax.nn.softmax(vals, axis=-1)
  vals = jnp.where(jnp.cumsum(q, axis=-1) - q < TOP_P, vals, -jnp.inf)
  return jnp.take_along_axis(ids, jax.random.categorical(k, vals)[:, None], 1)[:, 0]


def _xla_sort_topp(k, h, w):
  l = _logits(h, w)
  order = jnp.argsort(-l, axis=-1)
  ls = jnp.take_along_axis(l, order, axis=-1)
  q = jax.nn.softmax(ls, axis=-1)
  ls = jnp.where(jnp.cumsum(q, axis=-1) - q < TOP_P, ls, -jnp.inf)
  return jnp.take_along_axis(order, jax.random.categorical(k, ls)[:, None], 1)[:, 0]


PROVIDERS = {
    "fused_plain": lambda k, h, w: fs.sample(h, w, k),
    "fused_topk_topp": lambda k, h, w: fs.sample(h, w, k, top_k=TOP_K, top_p=TOP_P),
    "xla_plain": lambda k, h, w: jax.random.categorical(k, _logits(h, w)),
    "xla_topk_topp": _xla_topk_topp,
    "xla_sort_topp": _xla_sort_topp,
}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--smoke", action="store_true", help="tiny shape, for a CPU")
  args = ap.parse_args(argv)
  d, v = (256, 8192) if args.smoke else (4096, 151936)
  batches = (1, 16) if args.smoke else (1, 16, 64, 256)
  reps = 3 if args.smoke else 15
  kw, kh = jax.random.split(jax.random.key(0))
  # Logits with std ~3, an LLM-like spread.
  w = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / d**0.5)).astype(jnp.bfloat16)
  rows = []
  for b in batches:
    h = jax.random.normal(kh, (b, d), jnp.bfloat16)
    key = jax.random.key(1)
    row = dict(B=b, D=d, V=v, backend_plain=fs.which_backend(h, w, key),
               backend_controls=fs.which_backend(h, w, key, top_k=TOP_K, top_p=TOP_P))
    for name, f in PROVIDERS.items():
      row[name + "_us"] = _timing.median_us(jax.jit(f), key, h, w, reps=reps)[0]
    row["controls_over_plain"] = row["fused_topk_topp_us"] / row["fused_plain_us"]
    row["speedup_vs_xla_topk"] = row["xla_topk_topp_us"] / row["fused_topk_topp_us"]
    rows.append(row)
    print(json.dumps(row), flush=True)
  meta = dict(gpu=_timing.device_name(), jax=jax.__version__,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              top_k=TOP_K, top_p=TOP_P)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "controls_" + _timing.slug(meta["gpu"]))
  with open(stem + ".json", "w") as fh:
    json.dump(dict(meta, rows=rows), fh, indent=1)
  cols = ["fused_plain", "fused_topk_topp", "xla_plain", "xla_topk_topp", "xla_sort_topp"]
  with open(stem + ".md", "w") as fh:
    fh.write(f"# Sampling controls on {meta['gpu']}\n\njax {meta['jax']}, {meta['date']}; "
             f"shape D={d} V={v} bf16; top_k={TOP_K}, top_p={TOP_P}; median us.\n\n")
    fh.write("| B | backend (controls) | " + " | ".join(cols)
             + " | controls / plain (fused) | speedup vs XLA top-k |\n")
    fh.write("|---" * (len(cols) + 4) + "|\n")
    for r in rows:
      fh.write(f"| {r['B']} | {r['backend_controls']} | "
               + " | ".join(f"{r[c + '_us']:.0f}" for c in cols)
               + f" | {r['controls_over_plain']:.2f} | {r['speedup_vs_xla_topk']:.2f} |\n")
  print(open(stem + ".md").read())


if __name__ == "__main__":
  main()
