"""Where the list kernels' row program spends its time (#40): per phase, from
clock stamps inside the kernel.

  python3 -m benchmarks.experiments.exp_row_phases [--heads S L] [--batches 1 16 64]
      [--out FILE.jsonl]

``pallas_kernels.triton_lists._row_lists_kernel`` is one program per row, a
chain of block-wide steps; its wall time alone says nothing of which step
bounds it. This script writes an instrumented copy of the kernel's source to
a temporary module (the kernel itself is not changed): before each phase
comment of the source (the best, the log-sum-exp, tau's radix select, the
selected slots and their first entries, the slots read again, the sort) and
at its end, a barrier and the SM's ``%clock64`` and ``%globaltimer`` stored
per row. Each phase's cycles are the
difference of consecutive stamps (median and max over rows); the clock rate
is the row's cycles over its global-timer span. The instrumented kernel's
lists are checked equal to the kernel's own, and the kernel's own time per
launch is given beside (median of 50 launches, events through jax).

On random rows (``t`` as XLA's GEMM would give at logit std 1.3).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import shapes
from benchmarks._timing import device_name, median_us
from flashsample_jax import dense_lists
from pallas_kernels import triton_lists as tls
from pallas_kernels import triton_noise as noise

# The phase comments of the kernel's source, in order: a stamp goes before each.
PHASES = ("# The best:", "# The log-sum-exp", "# tau's key", "# The slots that may hold",
          "# The values >= tau of the slots read again", "# Sorted by")
NAMES = ("load", "best", "lse", "radix", "select", "gather", "sort")
_STAMPS = len(PHASES) + 2

_PRELUDE = '''
import triton
import triton.language as tl
from pallas_kernels.triton_lists import order_key, load_tempered, _INT_MAX, _KEY_NEG_INF


@triton.jit
def _stamp(times_ptr, r, k: tl.constexpr):
  tl.debug_barrier()
  c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                is_pure=False, pack=1)
  g = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                is_pure=False, pack=1)
  tl.store(times_ptr + r * {n2} + 2 * k, c)
  tl.store(times_ptr + r * {n2} + 2 * k + 1, g)


'''


def instrumented_source() -> str:
  """The row kernel's source with a ``times_ptr`` argument and stamps."""
  src = inspect.getsource(tls._row_lists_kernel.fn)
  src = src.replace("cand_i_ptr,", "cand_i_ptr, times_ptr,", 1)
  lines = src.splitlines()
  out, k = [], 0
  for line in lines:
    stripped = line.strip()
    if stripped.startswith("off = tl.load(off_ptr)"):
      out.append("  _stamp(times_ptr, r, 0)")
      k = 1
    for phase in PHASES:
      if stripped.startswith(phase):
        out.append(f"  _stamp(times_ptr, r, {k})")
        k += 1
    out.append(line)
  if k != len(PHASES) + 1:
    raise RuntimeError(f"found {k - 1} of {len(PHASES)} phase comments in the kernel")
  out.append(f"  _stamp(times_ptr, r, {k})")
  return _PRELUDE.format(n2=2 * _STAMPS) + "\n".join(out) + "\n"


def instrumented_kernel():
  """The instrumented kernel, imported from a temporary file (Triton reads a
  kernel's source from its file)."""
  path = tempfile.NamedTemporaryFile("w", suffix="_row_phases.py", delete=False)
  path.write(instrumented_source())
  path.close()
  spec = importlib.util.spec_from_file_location("_row_phases_kernel", path.name)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod
  spec.loader.exec_module(mod)
  return mod._row_lists_kernel


def stamped_launch(kernel, t, m: int, slot: int):
  """The slot pass, then the instrumented row kernel: its lists and stamps."""
  jt = noise.jax_triton_module()
  b, _ = t.shape
  first, second = tls.constexprs(t.shape[1], m, slot, entries=tls.keeps_entries(b))
  s = first["S"]
  scale, inv_t = jnp.ones((1,), jnp.float32), jnp.ones((b,), jnp.float32)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  stats = jt.triton_call(
      t, scale, inv_t, kernel=tls._slot_stats_kernel,
      out_shape=(f32(b, s), f32(b, s), i32(b, s), f32(b, s), i32(b, s), f32(b, s)),
      grid=(b, -(-s // first["SPP"])), num_warps=tls._STATS_WARPS,
      num_stages=tls._STAGES, **first)
  outs = jt.triton_call(
      *stats, t, scale, inv_t, jnp.zeros((1,), jnp.int32), kernel=kernel,
      out_shape=(f32(b, m), i32(b, m), f32(b), f32(b), f32(b), f32(b), i32(b),
                 i32(b, second["SLOT_CAP"]), f32(b, second["CAP"]), i32(b, second["CAP"]),
                 jax.ShapeDtypeStruct((b, 2 * _STAMPS), jnp.int64)),
      grid=(b,), num_warps=tls._LISTS_WARPS, num_stages=tls._STAGES, **second)
  return outs[0], outs[1], outs[-1]


def phases(stamps: np.ndarray) -> dict:
  """Per phase: median and max cycles over rows; the clock in GHz."""
  clock = stamps[:, 0::2].astype(np.int64)
  glob = stamps[:, 1::2].astype(np.int64)
  cycles = np.diff(clock, axis=1)
  ghz = (clock[:, -1] - clock[:, 0]) / np.maximum(glob[:, -1] - glob[:, 0], 1)
  out = {name: dict(median=int(np.median(cycles[:, i])), max=int(cycles[:, i].max()))
         for i, name in enumerate(NAMES)}
  out["total_cycles"] = int(np.median(clock[:, -1] - clock[:, 0]))
  out["total_ns_globaltimer"] = int(np.median(glob[:, -1] - glob[:, 0]))
  out["ghz"] = round(float(np.median(ghz)), 3)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S", "L"], choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
  ap.add_argument("--m", type=int, default=128)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  kernel = instrumented_kernel()
  for head in args.heads:
    v = shapes.HEADS[head][1]
    slot = dense_lists.slot_size(v, args.m)
    for b in args.batches:
      t = jax.random.normal(jax.random.key(b), (b, v), jnp.float32) * 1.3
      vals, ids, stamps = jax.jit(stamped_launch, static_argnums=(0, 2, 3))(
          kernel, t, args.m, slot)
      ref = jax.jit(lambda x: tls.row_lists(x, 0, args.m, slot=slot))(t)
      same = bool(np.array_equal(np.asarray(vals), np.asarray(ref["cand_vals"]))
                  and np.array_equal(np.asarray(ids), np.asarray(ref["cand_ids"])))
      own = jax.jit(lambda x: tls.row_lists(x, 0, args.m, slot=slot))
      row = dict(device=device_name(), head=head, B=b, V=v, m=args.m, slot=slot,
                 same_lists=same, launch_us=round(median_us(own, t, reps=9, inner=50)[0], 2),
                 **phases(np.asarray(stamps)))
      print(json.dumps(row), flush=True)
      if args.out:
        with open(args.out, "a") as f:
          f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
