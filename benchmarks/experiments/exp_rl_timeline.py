"""Where the RL outputs' time goes (issue #39): the device timeline of
top-k + top-p sampling with each RL output and with all of them.

  python3 -m benchmarks.experiments.exp_rl_timeline [--heads S] [--batches 16 64]
      [--backend auto] [--calls 20]

For each head, B and output set (``bench_controls.RL_OUTPUTS`` on top of
top-k 50 + top-p 0.9, T 1, the benchmark's logits): the wall time per call,
the device time per kernel, busy and idle time per call and the last call's
kernels in order (``exp_small_b_timeline.timeline``), and the rows stage 2
sent to the exact path (``benchmarks._fallback.exact_path_rows``, un-timed).
One JSON line each.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._fallback import exact_path_rows
from benchmarks._timing import device_name
from benchmarks.bench_controls import RL_OUTPUTS, TOP_K, TOP_P
from benchmarks.experiments.exp_small_b_timeline import timeline

SETS = {"none": {}, **RL_OUTPUTS}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S"], choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
  ap.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
  ap.add_argument("--backend", default="auto")
  ap.add_argument("--calls", type=int, default=20)
  args = ap.parse_args(argv)
  key = jax.random.key(0)
  for head in args.heads:
    d, _ = shapes.HEADS[head]
    w = shapes.random_head(head)
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      for name in args.sets:
        kw = dict(top_k=TOP_K, top_p=TOP_P, **SETS[name])
        f = jax.jit(lambda h, w, kw=kw: fs.sample(h, w, key, backend=args.backend, **kw))
        t = timeline(f, h, w, calls=args.calls)
        exact = exact_path_rows(h, w, key, backend=args.backend, **kw)
        print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, head=head, B=b,
                              outputs=name, backend=args.backend,
                              exact_rows=exact, **t)), flush=True)


if __name__ == "__main__":
  main()
