"""Experiment: how should the xla backend walk the vocabulary on a GPU?

Times the streaming backend with a fori_loop over dynamic slices of W
("loop": MAX_UNROLLED=0) against unrolled static slices ordered by an
optimization barrier ("unrolled", the default), at two chunk sizes, next to
the XLA baseline (dot + categorical), with each variant's compiled temp memory.
On the GPU: ``python benchmarks/exp_xla_stream.py`` (``--small`` on a CPU).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks._timing import median_us  # noqa: E402
from flashsample_jax import _validate, xla_backend  # noqa: E402


def main():
  small = "--small" in sys.argv
  d, v = (128, 4096) if small else (4096, 151936)
  kw, kh = jax.random.split(jax.random.key(0))
  w = (jax.random.normal(kw, (v, d), jnp.float32) * 0.05).astype(jnp.bfloat16)
  key = jax.random.key(1)
  base = jax.jit(lambda k, h, w: jax.random.categorical(
      k, jnp.dot(h, w.T, preferred_element_type=jnp.float32)))
  for b in ((8,) if small else (1, 64, 256)):
    h = jax.random.normal(kh, (b, d), jnp.bfloat16)
    want = base(key, h, w)
    print(json.dumps(dict(B=b, variant="baseline", us=median_us(base, key, h, w)[0])))
    for mode in ("loop", "unrolled"):
      for elems in (2**20, 2**22):
        chunk = min(v, max(512, elems // b) // 128 * 128)
        unroll = xla_backend.MAX_UNROLLED
        xla_backend.MAX_UNROLLED = {} if mode == "loop" else {"gpu": 32, "cpu": 32}
        f = jax.jit(lambda k, h, w, c=chunk: xla_backend.candidates(
            _validate.prepare(h, w, k), chunk=c)[1])
        compiled = f.lower(key, h, w).compile()
        xla_backend.MAX_UNROLLED = unroll
        temp = compiled.memory_analysis().temp_size_in_bytes
        agree = float((compiled(key, h, w) == want).mean())
        print(json.dumps(dict(B=b, variant=f"{mode} chunk={chunk}",
                              us=median_us(compiled, key, h, w)[0],
                              temp_mib=temp / 2**20, agree=agree)), flush=True)


if __name__ == "__main__":
  main()
