"""Which f32 division does XLA emit on the GPU, and what matches it bit for bit?

Prints the division instructions in the PTX XLA dumps for ``l / t``, then
compares XLA's quotients, bit for bit, with Triton kernels computing
``div.full.f32``, ``div.rn.f32``, ``tl.fdiv(ieee_rounding=False)`` and
``l * rcp.approx.f32(t)``, over random ``l`` of many magnitudes and the
temperatures people use. Needs a GPU, torch and triton (the device image).

  PYTHONPATH=. python3 benchmarks/experiments/probe_division.py
"""

from __future__ import annotations

import glob
import os
import re
import tempfile

dump = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _kernels(l_ptr, t_ptr, full_ptr, rn_ptr, fdiv_ptr, rcp_ptr, n, BLOCK: tl.constexpr):
  i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  m = i < n
  l = tl.load(l_ptr + i, mask=m)
  t = tl.load(t_ptr + i, mask=m)
  full = tl.inline_asm_elementwise("div.full.f32 $0, $1, $2;", "=r,r,r", [l, t],
                                   dtype=tl.float32, is_pure=True, pack=1)
  rn = tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=r,r,r", [l, t],
                                 dtype=tl.float32, is_pure=True, pack=1)
  r = tl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=r,r", [t],
                                dtype=tl.float32, is_pure=True, pack=1)
  tl.store(full_ptr + i, full, mask=m)
  tl.store(rn_ptr + i, rn, mask=m)
  tl.store(fdiv_ptr + i, tl.fdiv(l, t, ieee_rounding=False), mask=m)
  tl.store(rcp_ptr + i, l * r, mask=m)


def main():
  print(jax.devices()[0].device_kind, "jax", jax.__version__, "triton", triton.__version__)
  rng = np.random.default_rng(0)
  n_l = 1 << 20
  mags = 10.0 ** rng.uniform(-6, 4, n_l)
  l = (rng.standard_normal(n_l) * mags).astype(np.float32)
  temps = np.r_[[0.6, 0.7, 0.8, 0.9, 0.95, 1.3, 1.5, 0.3, 0.1, 3.0, 0.55, 0.65],
                rng.uniform(0.05, 4.0, 20)].astype(np.float32)
  lt = np.repeat(l[None], temps.size, 0).ravel()
  tt = np.repeat(temps[:, None], n_l, 1).ravel()
  xla = np.asarray(jax.jit(lambda a, b: a / b)(jnp.asarray(lt), jnp.asarray(tt)))
  ptx = "".join(open(f).read() for f in glob.glob(os.path.join(dump, "*.ptx")))
  print("division instructions in XLA's PTX:",
        sorted(set(re.findall(r"\b(div\.[a-z0-9.]+|rcp\.[a-z0-9.]+)", ptx))))
  dev = torch.device("cuda")
  lt_d, tt_d = torch.from_numpy(lt).to(dev), torch.from_numpy(tt).to(dev)
  outs = [torch.empty_like(lt_d) for _ in range(4)]
  grid = (triton.cdiv(lt.size, 1024),)
  _kernels[grid](lt_d, tt_d, *outs, lt.size, BLOCK=1024)
  names = ("div.full.f32", "div.rn.f32", "tl.fdiv(ieee_rounding=False)", "l * rcp.approx(t)")
  xb = xla.view(np.uint32)
  for name, o in zip(names, outs):
    ob = o.cpu().numpy().view(np.uint32)
    diff = ob != xb
    print(f"{name:32s} differs from XLA on {int(diff.sum()):>9d} of {lt.size} quotients"
          + (f" (e.g. l={lt[diff][0]!r} t={tt[diff][0]!r})" if diff.any() else ""))
  ieee = (lt.astype(np.float64) / tt).astype(np.float32)
  print(f"{'numpy IEEE':32s} differs from XLA on {int((ieee.view(np.uint32) != xb).sum()):>9d}")


if __name__ == "__main__":
  main()
