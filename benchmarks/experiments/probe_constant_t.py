"""Does XLA fold a constant temperature's reciprocal, and how does it divide then?

``l / T + g`` with ``T`` a constant of the program (a Python float, or an
array closed over) against two-rounding candidates built from
``rcp.approx`` (XLA's runtime ``1 / T``) and from IEEE ``1 / T``; and
``1 / T`` of a constant behind ``optimization_barrier``.

  PYTHONPATH=. python3 benchmarks/experiments/probe_constant_t.py
"""

import jax
import jax.numpy as jnp
import numpy as np


def main():
  print(jax.devices()[0].device_kind)
  rng = np.random.default_rng(2)
  b, v = 16, 50000
  l = (rng.standard_normal((b, v)) * 300).astype(np.float32)
  g = rng.gumbel(size=(b, v)).astype(np.float32)
  lj, gj = jnp.asarray(l), jnp.asarray(g)
  for tv in (0.6, 0.7, 1.3):
    t = np.full(b, tv, np.float32)
    rt = np.asarray(jax.jit(lambda t: 1.0 / t)(jnp.asarray(t)))      # runtime: rcp.approx
    ieee = (np.float32(1) / t).astype(np.float32)
    folded = np.asarray(jax.jit(lambda: 1.0 / jnp.asarray(t))())
    barrier = np.asarray(jax.jit(lambda: 1.0 / jax.lax.optimization_barrier(jnp.asarray(t)))())
    print(f"T={tv}: runtime 1/T == IEEE: {bool((rt == ieee).all())}; constant-folded 1/T == runtime: "
          f"{bool((folded == rt).all())}; barrier 1/T == runtime: {bool((barrier == rt).all())}")
    two = lambda r: ((l * r[:, None]).astype(np.float32) + g).astype(np.float32)
    forms = {
        "python float": jax.jit(lambda l, g: l / tv + g)(lj, gj),
        "closed-over [B]": jax.jit(lambda l, g: l / jnp.asarray(t)[:, None] + g)(lj, gj),
        "argument [B]": jax.jit(lambda l, t, g: l / t[:, None] + g)(lj, jnp.asarray(t), gj),
    }
    for name, got in forms.items():
      got = np.asarray(got).view(np.uint32)
      print(f"   {name:16s}: vs rcp.approx two roundings {int((got != two(rt).view(np.uint32)).sum()):>7d},"
            f" vs IEEE 1/T two roundings {int((got != two(ieee).view(np.uint32)).sum()):>7d}"
            f" of {got.size}")


if __name__ == "__main__":
  main()
