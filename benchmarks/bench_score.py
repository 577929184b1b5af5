"""Scoring given tokens: ``fs.score_tokens`` against XLA's materialized way,
with each program's peak memory (issue #39's bar: N = 1024..8192 rows).

  python -m benchmarks.bench_score [--head S] [--rows 1024 2048 4096 8192]
      [--configs plain topk_topp] [--out benchmarks/results] [--smoke]

Per (config, N rows), median us per call and the bytes XLA reserves for the
program beyond its arguments (``temp``: the compiled program's
``memory_analysis().temp_size_in_bytes``; the outputs are a few ``[N]``
vectors everywhere):

* ``fused``: ``fs.score_tokens`` (``auto``): one pass over the head with an
  online log-sum-exp and entropy, no noise, every field of ``ScoreOutput``
  (the processed, truncated and raw log-probabilities, both entropies, the
  kept flag); never the ``[N, V]`` logits.
* ``fused_xla``, ``fused_triton``, ``fused_mosaic``: the same on a named
  backend (the streaming xla backend holds one vocabulary chunk of logits
  at a time; the Triton and Mosaic GPU controls kernels none).
* ``xla``: the usual way for the log-probability alone: ``[N, V]`` f32 logits
  from ``jnp.dot``, divided by the temperature, ``jax.nn.log_softmax``,
  gathered at the tokens (with top-k + top-p: ``lax.top_k``, the nucleus on
  its sorted values, ``log_softmax`` over the kept set).
* ``xla_entropy``: the same plus each row's entropy (what a trainer's
  entropy monitor adds).
* ``dot``: ``jnp.dot`` alone, f32 out (the GEMM that every way pays).

Also the weight-read floor (W's bytes over a large ``jnp.sum``'s read
bandwidth). Writes ``score_<gpu>.{json,md,png}``.
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

CONFIGS = {"plain": dict(temperature=1.0),
           "topk_topp": dict(temperature=1.0, top_k=50, top_p=0.9)}
PROVIDERS = ("fused", "fused_xla", "fused_triton", "fused_mosaic", "xla", "xla_entropy",
             "dot")
DEFAULT_PROVIDERS = ("fused", "fused_xla", "xla", "xla_entropy", "dot")


def xla_logits(h, w, temperature):
  """The ``[N, V]`` f32 logits over the temperature, the usual way."""
  return jnp.dot(h, w.T, preferred_element_type=jnp.float32) / temperature


def xla_kept(l, top_k, top_p):
  """The values of the kept set (``-inf`` elsewhere) and their ids, by
  ``lax.top_k`` and the nucleus on its sorted values; the whole row without
  truncation."""
  if top_k is None:
    return l, None
  vals, ids = lax.top_k(l, top_k)                          # sorted descending
  if top_p is not None:
    probs = jax.nn.softmax(vals, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    vals = jnp.where(before < top_p, vals, -jnp.inf)
  return vals, ids


def xla_score(h, w, tokens, *, temperature, top_k=None, top_p=None, entropy=False):
  """The log-probability of ``tokens`` under the kept set (and the row's
  entropy over it when ``entropy``) from materialized logits."""
  vals, ids = xla_kept(xla_logits(h, w, temperature), top_k, top_p)
  logp = jax.nn.log_softmax(vals, axis=-1)
  if ids is None:
    lp = jnp.take_along_axis(logp, tokens[:, None], axis=1)[:, 0]
  else:
    lp = jnp.max(jnp.where(ids == tokens[:, None], logp, -jnp.inf), axis=1)
  if not entropy:
    return lp
  p = jnp.exp(logp)
  return lp, -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=1)


def programs(cfg):
  """provider -> a jitted function of ``(h, w, tokens)``."""
  t = cfg["temperature"]
  trunc = {k: cfg[k] for k in ("top_k", "top_p") if k in cfg}
  return {
      "fused": jax.jit(lambda h, w, tok: fs.score_tokens(h, w, tok, **cfg)),
      "fused_xla": jax.jit(lambda h, w, tok: fs.score_tokens(h, w, tok, backend="xla", **cfg)),
      "fused_triton": jax.jit(lambda h, w, tok: fs.score_tokens(h, w, tok, backend="triton",
                                                                **cfg)),
      "fused_mosaic": jax.jit(lambda h, w, tok: fs.score_tokens(h, w, tok, backend="mosaic",
                                                                **cfg)),
      "xla": jax.jit(lambda h, w, tok: xla_score(h, w, tok, temperature=t, **trunc)),
      "xla_entropy": jax.jit(lambda h, w, tok: xla_score(h, w, tok, temperature=t,
                                                         entropy=True, **trunc)),
      "dot": jax.jit(lambda h, w, tok: xla_logits(h, w, t)),
  }


def bench(args, on_point):
  d, v, w, res = head_run(args.head, args.smoke)
  for n in args.rows:
    h = jax.random.normal(jax.random.key(n), (n, d), jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(n + 1), (n,), 0, v, jnp.int32)
    for name in args.configs:
      cfg = CONFIGS[name]
      # score_tokens resolves as sample does with every RL output asked for.
      route = fs.which_backend(h, w, jax.random.key(0), return_logprobs=True,
                               return_entropy=True, return_raw_logprobs=True, **cfg)
      point = dict(N=n, config=name, backend=route)
      for prov, f in programs(cfg).items():
        if prov not in args.providers:
          continue
        # Compiled once: timed, and its buffer assignment read (the bytes
        # it reserves beyond its arguments and outputs).
        compiled = f.lower(h, w, tokens).compile()
        point[f"{prov}_us"] = round(median_us(compiled, h, w, tokens, reps=args.reps)[0], 1)
        point[f"{prov}_temp_mib"] = round(
            compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)
      if "fused_us" in point and "xla_us" in point:
        point["xla_over_fused"] = round(point["xla_us"] / point["fused_us"], 3)
      if "fused_us" in point and "dot_us" in point:
        point["fused_over_dot"] = round(point["fused_us"] / point["dot_us"], 3)
      add_point(res, point, on_point)
  return res


def markdown(res) -> str:
  lines = [f"# Scoring given tokens, {res['gpu']}, jax {res['jax']}", "",
           f"{head_line(res)} `fused`: `fs.score_tokens` "
           "(every ScoreOutput field); `xla`: f32 logits + `log_softmax` + gather; "
           "`xla_entropy`: and the entropy; `dot`: the f32 logits alone. Median us per "
           "call; MiB: the compiled program's temporary buffers "
           "(`python -m benchmarks.bench_score`).", "",
           "| config | N | route | fused | fused_xla | fused_triton | fused_mosaic | xla | "
           "xla_entropy | dot | xla / fused | fused / dot | fused MiB | fused_xla MiB | "
           "xla MiB | xla_entropy MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  g = lambda p, k: p.get(k, "-")
  for p in res["points"]:
    lines.append(f"| {p['config']} | {p['N']} | {p['backend']} | {g(p, 'fused_us')} | "
                 f"{g(p, 'fused_xla_us')} | {g(p, 'fused_triton_us')} | "
                 f"{g(p, 'fused_mosaic_us')} | {g(p, 'xla_us')} | "
                 f"{g(p, 'xla_entropy_us')} | {g(p, 'dot_us')} | "
                 f"{g(p, 'xla_over_fused')} | {g(p, 'fused_over_dot')} | "
                 f"{g(p, 'fused_temp_mib')} | {g(p, 'fused_xla_temp_mib')} | "
                 f"{g(p, 'xla_temp_mib')} | {g(p, 'xla_entropy_temp_mib')} |")
  return "\n".join(lines) + "\n"


def plot(res, path):
  cfgs = sorted({p["config"] for p in res["points"]})
  fig, axes = panels(len(cfgs))
  for ax, cfg in zip(axes, cfgs):
    pts = [p for p in res["points"] if p["config"] == cfg]
    ns = [p["N"] for p in pts]
    for prov in PROVIDERS:
      if all(f"{prov}_us" in p for p in pts):
        ax.plot(ns, [p[f"{prov}_us"] for p in pts], marker="o", label=prov)
    pow2_axis(ax, ns, "rows N", "us per call", cfg)
  save_panels(fig, axes, path)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--head", default="S", choices=sorted(shapes.HEADS))
  ap.add_argument("--rows", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
  ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=sorted(CONFIGS))
  ap.add_argument("--providers", nargs="+", default=list(DEFAULT_PROVIDERS),
                  choices=PROVIDERS)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  ap.add_argument("--smoke", action="store_true", help="a tiny head, for a CPU")
  ap.add_argument("--no-plot", action="store_true")
  args = ap.parse_args(argv)
  return run_and_write(bench, args, f"score_{slug(device_name())}", markdown=markdown,
                       plot=plot)


if __name__ == "__main__":
  main()
