"""Which f32 ``exp`` does XLA emit on the GPU, and does a Triton kernel match
it bit for bit?

Stage 2's top-p mass (``controls.nucleus_terms``: ``exp(t - max t)``) runs in
XLA. A Triton kernel can only take over that step if its ``exp`` gives XLA's
bits on every input. This prints the exp-related instructions and calls in
the PTX XLA dumps for ``jnp.exp``, then compares XLA's results, bit for bit,
over every one of the 2**32 f32 bit patterns, with Triton kernels computing
libdevice's ``__nv_expf`` (``libdevice.exp``), ``tl.exp`` (``ex2.approx`` of
``x * log2 e``) and libdevice's ``__nv_fast_expf``. NaN outputs count as
equal whatever their payload. Needs a GPU, torch and triton (the device
image).

  PYTHONPATH=. python3 benchmarks/experiments/probe_exp.py [--chunk-log2 28]
"""

from __future__ import annotations

import argparse
import glob
import json
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
from triton.language.extra.cuda import libdevice  # noqa: E402


@triton.jit
def _exps(x_ptr, lib_ptr, approx_ptr, fast_ptr, n, BLOCK: tl.constexpr):
  i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
  m = i < n
  x = tl.load(x_ptr + i, mask=m)
  tl.store(lib_ptr + i, libdevice.exp(x), mask=m)
  tl.store(approx_ptr + i, tl.exp(x), mask=m)
  tl.store(fast_ptr + i, libdevice.fast_expf(x), mask=m)


NAMES = ("libdevice.exp (__nv_expf)", "tl.exp", "libdevice.fast_expf")


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
  """Where two f32 tensors differ in their bits, NaN equal to NaN."""
  both_nan = torch.isnan(a) & torch.isnan(b)
  return (a.view(torch.int32) != b.view(torch.int32)) & ~both_nan


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--chunk-log2", type=int, default=28)
  ap.add_argument("--out", default=None, help="JSON result file")
  args = ap.parse_args()
  print(jax.devices()[0].device_kind, "jax", jax.__version__, "triton", triton.__version__,
        flush=True)
  n = 1 << args.chunk_log2
  xla_exp = jax.jit(lambda base: jnp.exp(lax_bits(base, n)))
  dev = torch.device("cuda")
  counts = {name: 0 for name in NAMES}
  examples = {name: [] for name in NAMES}
  outs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in NAMES]
  for c in range(1 << (32 - args.chunk_log2)):
    base = c * n
    xla = torch.from_dlpack(xla_exp(jnp.uint32(base)))
    # The bit patterns base .. base + n - 1 as int32, then as f32.
    x = torch.arange(base, base + n, dtype=torch.int64, device=dev)
    x = ((x + 2**31) % 2**32 - 2**31).to(torch.int32).view(torch.float32)
    _exps[(triton.cdiv(n, 1024),)](x, *outs, n, BLOCK=1024)
    for name, o in zip(NAMES, outs):
      d = _differs(o, xla)
      k = int(d.sum())
      counts[name] += k
      if k and len(examples[name]) < 5:
        j = int(torch.nonzero(d)[0])
        examples[name].append({"x": float(x[j]), "x_bits": hex(base + j),
                               "xla": float(xla[j]), "triton": float(o[j])})
  ptx = "".join(open(f).read() for f in glob.glob(os.path.join(dump, "*.ptx")))
  instrs = sorted(set(re.findall(r"\b(ex2\.[a-z0-9.]+|call[^;]*__nv_[a-z_]+|fma\.[a-z0-9.]+)",
                                 ptx)))
  result = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
            "triton": triton.__version__, "inputs": 2**32, "xla_ptx": instrs,
            "differs": counts, "examples": examples}
  print("exp-related instructions in XLA's PTX:", instrs)
  for name in NAMES:
    print(f"{name:28s} differs from XLA on {counts[name]:>10d} of 2**32 inputs"
          + (f" (e.g. {examples[name][0]})" if examples[name] else ""))
  print(json.dumps(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


def lax_bits(base, n: int):
  """f32 values of the bit patterns ``base .. base + n - 1`` (uint32 wraps)."""
  bits = jnp.arange(n, dtype=jnp.uint32) + base
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


if __name__ == "__main__":
  main()
