"""Sustained calls at S, B = 256: the fused kernel against XLA's dot +
categorical, 8 s each, to read the GPU's power and clocks beside them
(issue #20: is the large-B kernel power-bound?).

  nvidia-smi dmon -s pc -d 1 > dmon.txt &
  python3 -m benchmarks.experiments.power_sustained

Each call takes a fresh key from a Python loop, so its time includes that
dispatch: compare the two lines with each other, not with the benchmarks.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks.shapes import HEADS, random_head


def main(seconds: float = 8.0):
  d, v = HEADS["S"]
  w = random_head("S", 1.3)
  h = jax.random.normal(jax.random.key(2), (256, d), jnp.bfloat16)
  fused = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=0.7, backend="mosaic"))
  xla = jax.jit(lambda h, w, k: jax.random.categorical(
      k, jnp.dot(h, w.T, preferred_element_type=jnp.float32)))
  for name, fn in (("mosaic", fused), ("xla", xla)):
    fn(h, w, jax.random.key(0)).block_until_ready()
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
      for i in range(50):
        out = fn(h, w, jax.random.key(i))
      out.block_until_ready()
      n += 50
    us = (time.time() - t0) / n * 1e6
    print(f"{name} {time.strftime('%H:%M:%S')} {us:.1f} us/call over {n} calls", flush=True)
    time.sleep(3)


if __name__ == "__main__":
  main()
