"""Which exact backend ``auto`` should take on a CPU: the streaming ``xla``
backend or ``dense`` (issue #42, defect 7).

The demo's head (Qwen3-0.6B: D = 1024, V = 151936), weights bf16 and f32,
B from 1 to 64, two configs: ``plain`` (T = 1) and ``qwen3`` (T 0.6, top-k
20, top-p 0.95). Both backends are exact (same tokens for the same key; the
script checks it); only their time differs. For scale, the unfused JAX
baselines the demo and the decode example time: ``dot + categorical``
(plain) and ``lax.top_k`` + top-p over the k candidates + categorical
(``qwen3``: examples/_model.py's timed baseline, whose noise is drawn over
the k candidates, so its tokens are not compared).

On a shared CPU one variant's time depends on what else runs, so the
variants of a point are timed in turn, ``--rounds`` times, and the median of
the rounds' medians is reported.

  python3 -m benchmarks.experiments.exp_cpu_route                 # the full table
  python3 -m benchmarks.experiments.exp_cpu_route --batches 1 8 --dtypes bfloat16

Prints one JSON line per point and a Markdown table; records the CPU, the
jax version and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks._timing import median_us
from examples import _model

D, V = 1024, 151936  # Qwen3-0.6B's LM head, the demo's CPU shape
CONFIGS = {"plain": _model.GenerationConfig("plain"), "qwen3": _model.GENERATION_CONFIGS["qwen3"]}


def _dot(h, w):
  return jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def variants(gen: _model.GenerationConfig):
  kw = gen.fused_kwargs()
  return {
      "xla": jax.jit(lambda k, h, w: fs.sample(h, w, k, backend="xla", **kw)),
      "dense": jax.jit(lambda k, h, w: fs.sample(h, w, k, backend="dense", **kw)),
      "baseline": jax.jit(lambda k, h, w: _model.baseline_tokens(_dot(h, w), k, gen)),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
  ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
  ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--reps", type=int, default=3)
  args = ap.parse_args(argv)
  print(json.dumps(dict(cpu=platform.processor() or platform.machine(),
                        devices=str(jax.devices()), jax=jax.__version__,
                        date=datetime.date.today().isoformat())), flush=True)
  rows = []
  for dtype in args.dtypes:
    w = (jax.random.normal(jax.random.key(1), (V, D), jnp.float32)
         * (3.0 / D**0.5)).astype(dtype)
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, D), jnp.float32).astype(dtype)
      key = jax.random.key(7)
      for name in args.configs:
        gen = CONFIGS[name]
        fns = variants(gen)
        toks = {n: np.asarray(f(key, h, w)) for n, f in fns.items()}  # compile
        assert (toks["xla"] == toks["dense"]).all(), "xla and dense must agree"
        times = {n: [] for n in fns}
        for _ in range(args.rounds):
          for n, f in fns.items():
            times[n].append(median_us(f, key, h, w, warmup=1, reps=args.reps, inner=1)[0])
        ms = {n: round(statistics.median(t) / 1e3, 2) for n, t in times.items()}
        pick = fs.which_backend(h, w, key, **gen.fused_kwargs())
        rec = dict(dtype=dtype, B=b, config=name, **ms,
                   dense_over_xla=round(ms["dense"] / ms["xla"], 2), auto=pick)
        print(json.dumps(rec), flush=True)
        rows.append(rec)
  print("\n| weight | B | config | xla ms | dense ms | dense / xla | baseline ms | auto |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['dtype']} | {r['B']} | {r['config']} | {r['xla']} | {r['dense']} | "
          f"{r['dense_over_xla']} | {r['baseline']} | {r['auto']} |")


if __name__ == "__main__":
  main()
