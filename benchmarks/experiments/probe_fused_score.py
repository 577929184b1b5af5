"""How does XLA round ``l / t + g`` inside one fusion on the GPU?

Candidates, computed exactly in NumPy from XLA's own reciprocal ``r = 1 / t``
(equal to ``rcp.approx.f32``, probe_reciprocal.py): ``round(round(l * r) +
g)`` (two roundings) and ``round(l * r + g)`` (one fma), against XLA's
``l / t[:, None] + g`` and the same with an optimization barrier on the
quotient.

  PYTHONPATH=. python3 benchmarks/experiments/probe_fused_score.py
"""

import jax
import jax.numpy as jnp
import numpy as np


def main():
  print(jax.devices()[0].device_kind)
  rng = np.random.default_rng(1)
  b, v = 64, 20000
  t = np.r_[[0.6, 0.7, 1.3, 0.8], rng.uniform(0.1, 3.0, b - 4)].astype(np.float32)
  l = (rng.standard_normal((b, v)) * 300).astype(np.float32)
  g = rng.gumbel(size=(b, v)).astype(np.float32)
  lj, tj, gj = jnp.asarray(l), jnp.asarray(t), jnp.asarray(g)
  fused = np.asarray(jax.jit(lambda l, t, g: l / t[:, None] + g)(lj, tj, gj))
  barrier = np.asarray(jax.jit(
      lambda l, t, g: jax.lax.optimization_barrier(l / t[:, None]) + g)(lj, tj, gj))
  r = np.asarray(jax.jit(lambda t: 1.0 / t)(tj))
  two = ((l * r[:, None]).astype(np.float32) + g).astype(np.float32)
  prod = l.astype(np.float64) * r[:, None].astype(np.float64)        # exact
  one = (prod + g.astype(np.float64)).astype(np.float32)             # ~fma
  bits = lambda a: a.view(np.uint32)
  for name, got in (("fused l / t + g", fused), ("barrier(l / t) + g", barrier)):
    for cname, c in (("two roundings", two), ("one fma", one)):
      print(f"{name:20s} vs {cname:14s}: {int((bits(got) != bits(c)).sum()):>8d} of {got.size} differ")


if __name__ == "__main__":
  main()
