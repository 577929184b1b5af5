"""Where does the mosaic kernel's time go? (PERF_LOG v4 groundwork)

Two modes, both on the GPU:

* ``time``: median us of ``mosaic_sm90.candidates`` at shape S for several B,
  for the real kernel and for ablations that replace a piece of the epilogue
  by a cheap stand-in of the same data dependence (monkeypatched at trace
  time, so the kernel source is untouched): ``no_logs`` (threefry bits
  straight to a float), ``no_noise`` (no threefry either), ``mul`` (multiply
  by 1/T instead of dividing). Tokens of ablations are meaningless.
* ``ncu``: run one config a few times so that Nsight Compute can profile one
  launch (``ncu -k regex:... --launch-skip 2 --launch-count 1``).

  python3 benchmarks/exp_mosaic_profile.py time
  python3 benchmarks/exp_mosaic_profile.py ncu 256
"""
import os
import sys

sys.path.insert(0, os.getcwd())

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import _timing
from flashsample_jax import _validate, noise
from pallas_kernels import mosaic_sm90 as m

D, V = 4096, 151936


def _inputs(b):
  w = (jax.random.normal(jax.random.key(0), (V, D), jnp.float32)
       * (3.0 / np.sqrt(D))).astype(jnp.bfloat16)
  h = jax.random.normal(jax.random.key(b), (b, D), jnp.bfloat16)
  return h, w


def _fn(config=None):
  return jax.jit(lambda h, w: m.candidates(
      _validate.prepare(h, w, jax.random.key(1), temperature=0.9),
      config=config))


def _cheap_bits(k0, k1, hi, lo):
  del k0, k1
  return lax.bitcast_convert_type((hi ^ lo) & np.uint32(0x007FFFFF), jnp.float32)


def _no_logs(k0, k1, hi, lo):
  bits = noise.random_bits(k0, k1, hi, lo)
  return lax.bitcast_convert_type((bits >> 9) | np.uint32(0x3F800000), jnp.float32)


VARIANTS = {
    "full": {},
    "no_logs": {"gumbel": _no_logs},
    "no_noise": {"gumbel": _cheap_bits},
    "mul": {"div": lambda x, y: x * (1.0 / y)},
}


def time_mode(batches=(8, 64, 128, 256)):
  orig_gumbel, orig_div = noise.gumbel, m._div_rn
  rows = []
  for b in batches:
    h, w = _inputs(b)
    for name, patch in VARIANTS.items():
      noise.gumbel = patch.get("gumbel", orig_gumbel)
      m._div_rn = patch.get("div", orig_div)
      try:
        f = _fn()
        jax.block_until_ready(f(h, w))
        us, _ = _timing.median_us(f, h, w, reps=15)
      finally:
        noise.gumbel, m._div_rn = orig_gumbel, orig_div
      line = f"S B={b:4d} {name:9s} {us:8.1f} us  cfg={m.pick_config(m.batch_side(b), D, V)}"
      print(line, flush=True)
      rows.append(line)
  print("\n".join(rows))


def ncu_mode(b):
  h, w = _inputs(b)
  f = _fn()
  for _ in range(4):
    jax.block_until_ready(f(h, w))
  print("done", b, m.pick_config(m.batch_side(b), D, V))


if __name__ == "__main__":
  if sys.argv[1] == "time":
    time_mode()
  else:
    ncu_mode(int(sys.argv[2]))
