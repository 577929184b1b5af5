"""Which reciprocal of T reproduces XLA's ``l / T`` inside a sampling fusion?

XLA on the GPU divides ``l / t`` (elementwise) as ``div.full.f32``, which
equals ``l * rcp.approx.f32(t)`` (probe_division.py). A kernel that cannot
emit ``rcp.approx`` can multiply by a reciprocal computed elsewhere; this
compares candidate reciprocals (XLA's ``1.0 / t``, XLA's ``ones / t`` with
the ones opaque to the compiler, Triton's ``rcp.approx``) against XLA's
quotient in the xla backend's own fusion (``l / t[:, None]`` plus noise).

  PYTHONPATH=. python3 benchmarks/experiments/probe_reciprocal.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _rcp(t_ptr, out_ptr, n, BLOCK: tl.constexpr):
  i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  t = tl.load(t_ptr + i, mask=i < n)
  r = tl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=r,r", [t],
                                dtype=tl.float32, is_pure=True, pack=1)
  tl.store(out_ptr + i, r, mask=i < n)


def main():
  print(jax.devices()[0].device_kind)
  rng = np.random.default_rng(0)
  b, v = 64, 20000
  t = np.r_[[0.6, 0.7, 1.3, 0.8, 0.9, 0.95, 1.5, 0.3],
            rng.uniform(0.05, 4.0, b - 8)].astype(np.float32)
  l = (rng.standard_normal((b, v)) * 10.0 ** rng.uniform(-2, 3, (b, 1))).astype(np.float32)
  tj, lj = jnp.asarray(t), jnp.asarray(l)
  # The quotient as the xla backend's fusion computes it (with noise added
  # after, as there; the noise is subtracted back out exactly only when it
  # is 0, so compare the plain quotient from the same expression shape).
  fused = np.asarray(jax.jit(lambda l, t: l / jnp.where(t == 0, 1.0, t)[:, None])(lj, tj))
  elementwise = np.asarray(jax.jit(lambda a, b: a / b)(
      lj, jnp.broadcast_to(tj[:, None], (b, v))))
  cands = {
      "xla 1.0 / t": np.asarray(jax.jit(lambda t: 1.0 / t)(tj)),
      "xla ones / t (ones an argument)": np.asarray(
          jax.jit(lambda o, t: o / t)(jnp.ones_like(tj), tj)),
      "xla ones / t (optimization_barrier)": np.asarray(jax.jit(
          lambda t: jax.lax.optimization_barrier(jnp.ones_like(t)) / t)(tj)),
  }
  dev = torch.device("cuda")
  out = torch.empty(b, device=dev)
  _rcp[(1,)](torch.from_numpy(t).to(dev), out, b, BLOCK=64)
  cands["triton rcp.approx"] = out.cpu().numpy()
  for name, target in (("fused l / t[:, None]", fused), ("elementwise l / t", elementwise)):
    for cname, inv in cands.items():
      prod = (l * inv[:, None]).astype(np.float32)
      print(f"{name:24s} vs l * [{cname:36s}]: {int((prod.view(np.uint32) != target.view(np.uint32)).sum()):>8d} of {target.size} differ")
  r = cands["triton rcp.approx"].view(np.uint32)
  for cname, inv in cands.items():
    print(f"{cname:36s} equals rcp.approx on {int((inv.view(np.uint32) == r).sum())}/{b}")
  print("fused == elementwise:", int((fused.view(np.uint32) != elementwise.view(np.uint32)).sum()), "differ")


if __name__ == "__main__":
  main()
