"""The FP8 register path's kernel against the head's width (#40).

  python3 -m benchmarks.experiments.exp_fp8_width [--dims 2880 2944 3072]
      [--vocab 201088] [--batches 1 16]

gpt-oss' FP8 kernel (D = 2880) takes 1.10x its floor where S's (D = 4096)
takes its floor's time (docs/performance.md, "Steps that do not divide D").
2880-byte rows are not a multiple of 128 bytes, so its W tiles take the
64-byte swizzle, and its last 256-column step is padded. Heads of the same
vocabulary with D = 2944 (a multiple of 128: the 128-byte swizzle, a padded
last step) and 3072 (neither) tell the two apart: for each, the sampling
kernel's device time (profiler trace of back-to-back calls) and its bytes
over that time, beside a ``jnp.sum`` over the same weight.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks._timing import device_name
from benchmarks.experiments.exp_small_b_timeline import timeline


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dims", type=int, nargs="+", default=[2880, 2944, 3072])
  ap.add_argument("--vocab", type=int, default=201088)
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
  args = ap.parse_args()
  key = jax.random.key(0)
  sample = jax.jit(lambda h, w, s: fs.sample(h, w, key, weight_scale=s, backend="mosaic"))
  total = jax.jit(lambda h, w, s: jnp.sum(w.view(jnp.uint8), dtype=jnp.uint32))
  for d in args.dims:
    w = jax.random.normal(jax.random.key(d), (args.vocab, d), jnp.bfloat16) * 0.02
    w, s = fs.quantize_weight(w)
    nbytes = args.vocab * d
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      for name, f in (("sample", sample), ("sum_w", total)):
        if name == "sum_w" and b != args.batches[0]:
          continue
        t = timeline(f, h, w, s, calls=20)
        kernel = max(t["per_kernel"].values())
        print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, D=d, V=args.vocab, B=b,
                              program=name, kernel_us=kernel,
                              kernel_tb_s=round(nbytes / kernel / 1e6, 3), **t)), flush=True)
    del w, s


if __name__ == "__main__":
  main()
