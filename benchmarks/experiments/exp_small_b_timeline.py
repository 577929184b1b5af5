"""Where a small-batch call's time goes above the weight-read floor (#41):
the device timeline of plain sampling next to the two programs that bound it.

  python3 -m benchmarks.experiments.exp_small_b_timeline [--heads S L qwen3-1.7b gpt-oss]
      [--batches 1 16] [--calls 20] [--weight-dtype bf16|fp8|int8]

For each head and batch size, three programs in one process: ``jnp.sum`` over
``W`` itself (the floor's own kernel at this size: its tail and ramp are what
any one-pass read pays), the cuBLAS dot alone, and ``fs.sample`` (``auto``,
plain). For each: the wall time per call (median of blocks of ``--calls``
async calls), and from a profiler trace of ``--calls`` back-to-back calls the
device time per call of each kernel, the busy time and the idle time per
call (the period minus the busy time: launch gaps), and the last call's
kernels in order with the gap before each. The floor is ``W``'s bytes over a
4 GiB ``jnp.sum``'s read bandwidth, as in ``bench_sampler``. With an 8-bit
``--weight-dtype`` the head is ``bench_sampler.make_head``'s per-row
quantization, the floor its bytes, and the dot XLA's way (the converted
weight's dot times the scale).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import bench_sampler, shapes
from benchmarks._timing import device_name, median_us, read_bandwidth, trace_events


def timeline(f, *args, calls: int):
  """Wall us per call, and the trace's per-call kernel times, busy and idle
  time, and the last call's kernels with the gap before each."""
  wall = median_us(f, *args, reps=9, inner=calls)[0]
  device, _ = trace_events(f, *args, calls=calls)
  per = collections.Counter()
  for _, dur, name, _ in device:
    per[name[:60]] += dur / calls / 1e3
  busy = sum(d for _, d, _, _ in device) / calls / 1e3
  span = (device[-1][0] + device[-1][1] - device[0][0]) / 1e3 if device else 0.0
  k = len(device) // calls
  last, prev = [], None
  for start, dur, name, _ in device[-k:]:
    last.append([0.0 if prev is None else round((start - prev) / 1e3, 2),
                 round(dur / 1e3, 2), name[:50]])
    prev = start + dur
  return dict(wall_us=round(wall, 1), period_us=round(span / calls, 1),
              busy_us=round(busy, 1), idle_us=round(span / calls - busy, 1),
              kernels_per_call=k, per_kernel={n: round(t, 2) for n, t in per.most_common(8)},
              last_call=last)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S", "L", "qwen3-1.7b", "gpt-oss"],
                  choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--calls", type=int, default=20)
  ap.add_argument("--weight-dtype", default="bf16", choices=sorted(bench_sampler.WEIGHT_DTYPES))
  args = ap.parse_args()
  gbs = read_bandwidth(4.0)
  key = jax.random.key(0)

  programs = {
      "sum_w": jax.jit(lambda h, w, s: jnp.sum(w, dtype=jnp.float32)),
      "dot": functools.partial(bench_sampler.make_provider("dot"), key),
      "sample": jax.jit(lambda h, w, s: fs.sample(h, w, key, weight_scale=s)),
  }
  for head in args.heads:
    d, v = shapes.HEADS[head]
    if args.weight_dtype == "bf16":
      w, s = shapes.random_head(head, 1.3), None
    else:
      w, s = bench_sampler.make_head(head, args.weight_dtype)
    floor = w.size * w.dtype.itemsize / gbs * 1e6
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      for name, f in programs.items():
        if name == "sum_w" and b != args.batches[0]:
          continue
        t = timeline(f, h, w, s, calls=args.calls)
        print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, head=head, B=b,
                              weight_dtype=args.weight_dtype,
                              program=name, floor_us=round(floor, 1),
                              wall_over_floor=round(t["wall_us"] / floor, 3), **t)),
              flush=True)


if __name__ == "__main__":
  main()
