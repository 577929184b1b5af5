"""``top_logprobs=N`` near the candidate lists' size: exact-path rows and time
per N (issue #42, defect 10), with plain sampling and XLA's way (the dot,
``categorical`` and ``lax.top_k`` of ``log_softmax``) in the same run.

  python benchmarks/experiments/exp_top_logprobs.py [--head S] [--batch 64]
      [--ns 20 64 100 120 128] [--backends auto triton]

One JSON line per (backend, N): ``exact_rows`` (rows stage 2 redid on the
materialized path), ``us`` (median per call), ``plain_us``, ``xla_us``.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._fallback import exact_path_rows
from benchmarks._timing import device_name, median_us


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--head", default="S", choices=sorted(shapes.HEADS))
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--ns", type=int, nargs="+", default=[20, 64, 100, 120, 128])
  ap.add_argument("--backends", nargs="+", default=["auto", "triton"])
  args = ap.parse_args()
  (_, d, v, b, w, h), = shapes.points([f"{args.head}:{args.batch}"])
  key = jax.random.key(0)
  plain = jax.jit(lambda k, h, w: fs.sample(h, w, k))
  plain_us = median_us(plain, key, h, w)[0]
  for n in args.ns:
    def xla(k, h, w, n=n):
      l = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
      return jax.random.categorical(k, l), jax.lax.top_k(jax.nn.log_softmax(l), n)
    xla_us = median_us(jax.jit(xla), key, h, w)[0]
    for backend in args.backends:
      f = jax.jit(lambda k, h, w, n=n, backend=backend: fs.sample(
          h, w, k, backend=backend, top_logprobs=n))
      rec = dict(gpu=device_name(), jax=jax.__version__, head=args.head, B=b, N=n,
                 backend=fs.which_backend(h, w, key, backend=backend, top_logprobs=n),
                 exact_rows=exact_path_rows(h, w, key, backend=backend, top_logprobs=n),
                 us=round(median_us(f, key, h, w)[0], 1), plain_us=round(plain_us, 1),
                 xla_us=round(xla_us, 1))
      print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
