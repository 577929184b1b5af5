"""Where the time of a top-k + top-p call goes (mosaic backend, GPU).

    PYTHONPATH=. python3 benchmarks/exp_controls_parts.py

Times, on shape S (D 4096, V 151936, bf16, logits std ~3): the plain fused
call; the controls kernel alone with and without candidate lists (the
per-warpgroup outputs merged); the finish stage alone on a fixed state; and
the whole call. Medians in us, one line of JSON per B.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashsample_jax as fs  # noqa: E402
from benchmarks import _timing  # noqa: E402
from flashsample_jax import _validate, controls, xla_backend  # noqa: E402
from pallas_kernels import mosaic_controls  # noqa: E402


def main():
  if "--no-cond" in sys.argv:
    # Experiment only: every lax.cond takes its false branch (no fallback).
    # Caveat (PERF_LOG c3): XLA then drops the certification as dead code,
    # so this times the kernel plus little else; exp_cond.py --finish keeps
    # the predicate alive and is the right comparison.
    jax.lax.cond = lambda pred, t, f, *a: f(*a)
  batches = [int(x) for x in sys.argv[1:] if x.isdigit()] or (1, 64, 128)
  d, v = 4096, 151936
  kw, kh = jax.random.split(jax.random.key(0))
  w = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / d**0.5)).astype(jnp.bfloat16)
  for b in batches:
    h = jax.random.normal(kh, (b, d), jnp.bfloat16)
    key = jax.random.key(1)

    def state(h, w, key, **ctl):
      p = _validate.prepare(h, w, key)
      c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, **ctl)
      return mosaic_controls.controls_state(p, c)

    def finish(st, h, w, key):
      p = _validate.prepare(h, w, key)
      c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, top_k=50, top_p=0.9)
      return xla_backend.finish_controls(p, c, st)[0]

    st = jax.jit(lambda h, w, k: state(h, w, k, top_k=50, top_p=0.9))(h, w, key)
    row = dict(B=b)
    timed = {
        "plain": (jax.jit(lambda h, w, k: fs.sample(h, w, k)), (h, w, key)),
        "kernel_transforms": (jax.jit(lambda h, w, k: state(h, w, k, softcap=30.0)),
                              (h, w, key)),
        "kernel_logprobs": (jax.jit(lambda h, w, k: state(h, w, k, return_logprobs=True)),
                            (h, w, key)),
        "kernel_lists": (jax.jit(lambda h, w, k: state(h, w, k, top_k=50, top_p=0.9)),
                         (h, w, key)),
        "finish": (jax.jit(finish), (st, h, w, key)),
        "topk_topp": (jax.jit(lambda h, w, k: fs.sample(h, w, k, top_k=50, top_p=0.9)),
                      (h, w, key)),
    }
    for name, (f, args) in timed.items():
      row[name] = round(_timing.median_us(f, *args, reps=15)[0], 1)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
