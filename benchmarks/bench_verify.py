"""Speculative verification: the fused ``fs.verify_drafts`` against the same
rules written the usual way in JAX, and the fused ``fs.sample`` of as many rows.

  python -m benchmarks.bench_verify [--head S] [--k 2 4 8] [--batches 1 8 16 32 64]
      [--out benchmarks/results] [--smoke]

Per (K, B requests, config), median us per call:

* ``fused``: ``fs.verify_drafts(method="one_hot")`` (``auto``): one pass over
  the head for the ``B (K + 1)`` rows, no logits written on the kernels.
* ``jax``: the one-hot rule the usual way: the ``[B (K + 1), V]`` f32 logits,
  truncation by ``lax.top_k`` (and a sort of the top-k for top-p), softmax,
  ``u < p(d)``, the residual by ``jax.random.categorical`` with the draft
  masked.
* ``sample``: ``fs.sample`` of the same ``B (K + 1)`` rows and controls (what
  verification costs at least: one fused pass).

Configs: ``qwen3`` (Qwen3's generation config: T 0.6, top-k 20, top-p 0.95)
and ``plain`` (T 1). Also the weight-read floor (W's bytes over the read
bandwidth of a large ``jnp.sum``). Writes ``verify_<gpu>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import (add_point, device_name, head_line, head_run, median_us,
                                panels, pow2_axis, run_and_write, save_panels, slug)

CONFIGS = {"qwen3": dict(temperature=0.6, top_k=20, top_p=0.95), "plain": dict(temperature=1.0)}


def jax_one_hot(key, h, w, drafts, u, *, temperature, top_k=None, top_p=None):
  """The one-hot rule from materialized logits, the usual way (``h [R, D]``,
  ``drafts [R]`` with -1 for none, ``u [R]``): accepted flags and the tokens
  emitted at a rejection (the bonus rows' samples where ``d = -1``)."""
  l = jnp.dot(h, w.T, preferred_element_type=jnp.float32) / temperature
  if top_k is None:
    ids = None
    vals = l
  else:
    vals, ids = lax.top_k(l, top_k)                       # sorted descending
    if top_p is not None:
      probs = jax.nn.softmax(vals, axis=-1)
      before = jnp.cumsum(probs, axis=-1) - probs
      vals = jnp.where(before < top_p, vals, -jnp.inf)
  logp = jax.nn.log_softmax(vals, axis=-1)
  col = (jnp.arange(vals.shape[1])[None] if ids is None else ids) == drafts[:, None]
  p_d = jnp.sum(jnp.where(col, jnp.exp(logp), 0.0), axis=-1)
  accept = u < p_d
  j = jax.random.categorical(key, jnp.where(col, -jnp.inf, vals))
  token = j if ids is None else jnp.take_along_axis(ids, j[:, None], axis=1)[:, 0]
  return accept, token


def bench(args, on_point):
  d, v, w, res = head_run(args.head, args.smoke)
  for k in args.k:
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, k + 1, d), jnp.bfloat16)
      drafts = jax.random.randint(jax.random.key(k), (b, k), 0, v, jnp.int32)
      key = jax.random.key(0)
      for name, cfg in CONFIGS.items():
        fused = jax.jit(lambda key, h, w, dr, cfg=cfg: fs.verify_drafts(h, w, key, dr, **cfg))
        rows = h.reshape(-1, d)
        sample = jax.jit(lambda key, rows, w, cfg=cfg: fs.sample(rows, w, key, **cfg))
        dr = jnp.concatenate([drafts, jnp.full((b, 1), -1, jnp.int32)], axis=1).reshape(-1)
        u = jax.random.uniform(jax.random.key(3), (b * (k + 1),))
        base = jax.jit(lambda key, rows, w, dr, u, cfg=cfg: jax_one_hot(key, rows, w, dr, u, **cfg))
        point = dict(K=k, B=b, rows=b * (k + 1), config=name,
                     backend=fs.which_backend(rows, w, key, **cfg),
                     fused_us=round(median_us(fused, key, h, w, drafts)[0], 1),
                     jax_us=round(median_us(base, key, rows, w, dr, u)[0], 1),
                     sample_us=round(median_us(sample, key, rows, w)[0], 1))
        point["speedup"] = round(point["jax_us"] / point["fused_us"], 2)
        point["vs_sample"] = round(point["fused_us"] / point["sample_us"], 2)
        add_point(res, point, on_point)
  return res


def markdown(res) -> str:
  lines = [f"# Speculative verification, {res['gpu']}, jax {res['jax']}", "",
           f"{head_line(res)} One-hot rule; `jax`: the "
           "materialized logits + `lax.top_k` + softmax + categorical; `sample`: `fs.sample` "
           "of the same B (K + 1) rows. Median us per call "
           "(`python -m benchmarks.bench_verify`).", "",
           "| config | K | B | rows | route | fused | jax | sample | jax / fused | "
           "fused / sample |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for p in res["points"]:
    lines.append(f"| {p['config']} | {p['K']} | {p['B']} | {p['rows']} | {p['backend']} | "
                 f"{p['fused_us']} | {p['jax_us']} | {p['sample_us']} | {p['speedup']} | "
                 f"{p['vs_sample']} |")
  return "\n".join(lines) + "\n"


def plot(res, path):
  ks = sorted({p["K"] for p in res["points"]})
  fig, axes = panels(len(ks))
  for ax, k in zip(axes, ks):
    for cfg, style in (("qwen3", "-"), ("plain", "--")):
      pts = [p for p in res["points"] if p["K"] == k and p["config"] == cfg]
      bs = [p["B"] for p in pts]
      for key, label in (("fused_us", "fused"), ("jax_us", "jax"), ("sample_us", "sample")):
        ax.plot(bs, [p[key] for p in pts], style, marker="o", label=f"{label} ({cfg})")
    ax.axhline(res["floor_us"], color="gray", lw=0.8, label="W read floor")
    pow2_axis(ax, sorted({p["B"] for p in res["points"]}), "requests B", "us per call",
              f"K = {k}")
  save_panels(fig, axes, path)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--head", default="S", choices=sorted(shapes.HEADS))
  ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 64])
  ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  ap.add_argument("--smoke", action="store_true", help="a tiny head, for a CPU")
  ap.add_argument("--no-plot", action="store_true")
  args = ap.parse_args()
  run_and_write(bench, args, f"verify_{slug(device_name())}", markdown=markdown, plot=plot)

if __name__ == "__main__":
  main()
