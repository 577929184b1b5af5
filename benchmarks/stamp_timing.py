"""A second, independent harness for bench_sampler's small-batch numbers:
each call's device time read off the GPU's own clock, inside the program.

    python3 -m benchmarks.stamp_timing [--shapes S L qwen3-1.7b gpt-oss]
        [--batches 1 16] [--weight-dtype bf16] [--providers dot auto ...] [--calls 60]
        [--out benchmarks/results/small_b] [--name SUFFIX]
    python3 -m benchmarks.stamp_timing --smoke     # CPU, seconds: a tiny head

bench_sampler times blocks of asynchronous calls by the host's clock
(``benchmarks/_timing.py``), and with ``--device-time`` reads kernel spans
from a profiler trace. This harness shares neither: each timed call is
compiled with a stamp before and after it, a one-thread Triton kernel that
stores the GPU's ``%globaltimer`` (nanoseconds), ordered around the call
by data dependencies (:func:`bracketed`). ``stamp after - stamp before`` is
the call's kernels and the gaps between them, and one launch gap at each
end; the host's dispatch and synchronization are outside it, and so is a
profiler. The same bracket times the cuBLAS dot alone and a ``jnp.sum`` over
4 GiB, whose bytes over its time give the floor's read bandwidth, so that
the ratios compare like with like. The timed functions are bench_sampler's
own (:func:`benchmarks.bench_sampler.make_provider`).

Per point: the median and the minimum over ``--calls`` calls after a warm
up, enqueued back to back. Writes ``stamps_<gpu>[_<name>].json`` and ``.md``
under ``--out``. On a CPU (``--smoke``) the stamps are the host's clock,
read by an ordered callback: the harness runs, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

import flashsample_jax as fs
from benchmarks import bench_sampler

FLOOR_GIB = 4.0
PROVIDERS = ("dot", "auto")


# -- the stamps ---------------------------------------------------------------


@functools.cache
def _timer_kernel():
  """The Triton kernel that stores ``%globaltimer`` as two uint32 words
  (jax keeps 64-bit integers off by default). Its input only orders it."""
  import triton  # pylint: disable=import-outside-toplevel
  import triton.language as tl  # pylint: disable=import-outside-toplevel

  @triton.jit
  def globaltimer_kernel(dep_ptr, out_ptr):  # pylint: disable=unused-argument
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.uint64,
                                  is_pure=False, pack=1)
    tl.store(out_ptr, t.to(tl.uint32))
    tl.store(out_ptr + 1, (t >> 32).to(tl.uint32))

  return globaltimer_kernel


def _host_ns(dep):
  del dep
  ns = time.perf_counter_ns()
  return np.array([ns & 0xFFFFFFFF, ns >> 32], np.uint32)


def stamp(dep):
  """uint32 ``[2]``: the device's clock (ns, low and high words) once
  ``dep`` has been computed: the GPU's ``%globaltimer``, on a CPU the
  host's clock."""
  out = jax.ShapeDtypeStruct((2,), jnp.uint32)
  if jax.default_backend() != "gpu":
    return io_callback(_host_ns, out, dep, ordered=True)
  import jax_triton as jt  # pylint: disable=import-outside-toplevel
  return jt.triton_call(dep, kernel=_timer_kernel(), out_shape=out, grid=(1,), num_warps=1,
                        name="stamp_globaltimer")


def bracketed(f):
  """``g(*args) -> (t0, t1, f(*args))`` jitted: ``t0`` stamped before any
  of ``f``'s work can start (its arguments pass through a barrier with
  ``t0``), ``t1`` after all of its results exist (they pass through a
  barrier that ``t1``'s kernel reads)."""
  def g(*args):
    arrays = [x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)
              and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
    t0 = stamp(arrays[0])
    t0, args = lax.optimization_barrier((t0, args))
    y = f(*args)
    done = lax.optimization_barrier(jax.tree.leaves(y))
    return t0, stamp(done[0]), y
  return jax.jit(g)


def nanoseconds(t0, t1) -> np.ndarray:
  """``t1 - t0`` per call in ns, from the stamps' two words (``[..., 2]``)."""
  join = lambda t: (np.asarray(t, np.uint64)[..., 1] << np.uint64(32)) | np.asarray(
      t, np.uint64)[..., 0]
  return (join(t1) - join(t0)).astype(np.int64)


def device_us(f, *args, calls: int = 60, warmup: int = 5) -> dict:
  """``f(*args)``'s device time per call between its stamps (us):
  ``calls`` calls enqueued back to back after ``warmup``; median, min, max."""
  g = bracketed(f)
  for _ in range(warmup):
    jax.block_until_ready(g(*args))
  stamps = [g(*args)[:2] for _ in range(calls)]
  stamps = jax.device_get(stamps)
  ns = nanoseconds(np.stack([s[0] for s in stamps]), np.stack([s[1] for s in stamps]))
  return dict(median_us=float(np.median(ns)) / 1e3, min_us=float(ns.min()) / 1e3,
              max_us=float(ns.max()) / 1e3)


# -- the benchmark -------------------------------------------------------------


def read_bandwidth(gib: float, calls: int) -> tuple[float, dict]:
  """Bytes/s of a ``jnp.sum`` over ``gib`` GiB of bf16 by its stamps' median."""
  n = int(gib * 2**30) // 2
  x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), jnp.bfloat16)
  t = device_us(lambda x: jnp.sum(x, dtype=jnp.float32), x, calls=calls)
  del x
  return n * 2 / (t["median_us"] * 1e-6), t


def run(shapes, batches, weight_dtype: str, *, calls: int, gib: float = FLOOR_GIB,
        providers=PROVIDERS):
  """Rows of every (shape, B): the floor and each provider (the dot alone
  and ``auto`` at least) by their stamps, and the ratios to the floor, the
  dot and ``auto``."""
  bw, sum_t = read_bandwidth(gib, calls)
  print(f"read bandwidth {bw / 1e12:.3f} TB/s (sum over {gib:g} GiB: "
        f"{sum_t['median_us']:.1f} us)", flush=True)
  rows = []
  for name in shapes:
    w, s = bench_sampler.make_head(name, weight_dtype)
    d = w.shape[1]
    floor_us = w.size * w.dtype.itemsize / bw * 1e6
    for b in batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      k = jax.random.key(7)
      row = dict(shape=name, B=b, weight_dtype=weight_dtype, floor_us=floor_us,
                 read_tbs=bw / 1e12)
      for p in dict.fromkeys((*PROVIDERS, *providers)):
        t = device_us(bench_sampler.make_provider(p), k, h, w, s, calls=calls)
        row.update({f"{p}_us": t["median_us"], f"{p}_min_us": t["min_us"],
                    f"{p}_max_us": t["max_us"]})
      row["auto_to_floor"] = row["auto_us"] / floor_us
      row["auto_to_dot"] = row["auto_us"] / row["dot_us"]
      for p in providers:
        if p not in PROVIDERS:
          row[f"{p}_to_auto"] = row[f"{p}_us"] / row["auto_us"]
      print(json.dumps(row), flush=True)
      rows.append(row)
  return rows, bw


def table(rows) -> str:
  extra = [k[:-len("_to_auto")] for k in rows[0] if k.endswith("_to_auto")] if rows else []
  cols = ["head", "B", "floor us", "cuBLAS dot alone", "auto", "auto / floor", "auto / dot"]
  cols += [c for p in extra for c in (p, f"{p} / auto")]
  out = "| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|\n"
  for r in rows:
    cells = [r["shape"], str(r["B"]), f"{r['floor_us']:.1f}", f"{r['dot_us']:.1f}",
             f"{r['auto_us']:.1f}", f"{r['auto_to_floor']:.3f}", f"{r['auto_to_dot']:.3f}"]
    cells += [c for p in extra for c in (f"{r[p + '_us']:.1f}", f"{r[p + '_to_auto']:.3f}")]
    out += "| " + " | ".join(cells) + " |\n"
  return out


def write(out: str, name: str, rows, meta) -> None:
  os.makedirs(out, exist_ok=True)
  slug = bench_sampler.slug(meta["gpu"]) + (f"_{name}" if name else "")
  with open(os.path.join(out, f"stamps_{slug}.json"), "w") as fh:
    json.dump(dict(meta, rows=rows), fh, indent=1)
  with open(os.path.join(out, f"stamps_{slug}.md"), "w") as fh:
    fh.write(f"# Device time by in-program stamps ({meta['gpu']}, jax {meta['jax']}, "
             f"{meta['date']})\n\n`{meta['command']}`\n\n"
             f"Each call's span between two `%globaltimer` stamps, median of "
             f"{meta['calls']} calls; floor: W's bytes over a `jnp.sum` over "
             f"{meta['gib']:g} GiB timed the same way ({meta['read_tbs']:.3f} TB/s). "
             f"Weight dtype {meta['weight_dtype']}.\n\n")
    fh.write(table(rows))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", nargs="+", default=["S", "L", "qwen3-1.7b", "gpt-oss"])
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--weight-dtype", default="bf16", choices=sorted(bench_sampler.WEIGHT_DTYPES))
  ap.add_argument("--providers", nargs="+", default=list(PROVIDERS),
                  choices=[*fs.BACKENDS, *bench_sampler.EXTRA,
                           *bench_sampler.TOPK_TOPP],
                  help="timed beside the floor, the dot and auto (e.g. auto_topk_topp)")
  ap.add_argument("--calls", type=int, default=60)
  ap.add_argument("--out", default=None,
                  help="default benchmarks/results/small_b (--smoke: nothing written)")
  ap.add_argument("--name", default="")
  ap.add_argument("--smoke", action="store_true", help="CPU: a tiny head, a tiny sum")
  args = ap.parse_args(argv)
  if args.calls < 1 or min(args.batches) < 1:
    ap.error(f"--calls={args.calls}, --batches={args.batches} must be >= 1")
  shapes, gib = args.shapes, FLOOR_GIB
  if args.smoke:
    shapes, gib, args.batches, args.calls = ["smoke"], 1 / 64, [1], 5
  meta = dict(gpu=bench_sampler.gpu_name(), jax=jax.__version__,
              date=datetime.date.today().isoformat(), calls=args.calls, gib=gib,
              weight_dtype=args.weight_dtype,
              command="python3 -m benchmarks.stamp_timing " + shlex.join(sys.argv[1:]))
  rows, bw = run(shapes, args.batches, args.weight_dtype, calls=args.calls, gib=gib,
                 providers=args.providers)
  meta["read_tbs"] = bw / 1e12
  if args.out or not args.smoke:
    write(args.out or "benchmarks/results/small_b", args.name, rows, meta)
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
