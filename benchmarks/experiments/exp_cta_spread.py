"""Where the mosaic kernel's time above a read of W goes at small B, CTA by
CTA (#41, #40).

  python3 -m benchmarks.experiments.exp_cta_spread [--heads S L qwen3-1.7b gpt-oss]
      [--batches 1 16] [--weight-dtypes bf16 fp8] [--calls 6] [--out DIR]

At B = 1 and 16 the plain kernel takes 1.00-1.04x a ``jnp.sum`` over the
same weight (docs/performance.md, "Small batches"), and the 8-bit kernel
1.07-1.16x its floor. A persistent launch ends when its slowest CTA ends:
its tiles are dealt out in a fixed order (tile ``cta + i * num_ctas``), so
a CTA that reads a little slower than the others, or starts later, is the
kernel's tail, where XLA's reduction hands its many blocks to whichever SM
is free. This script measures that spread with Mosaic GPU's profiler
(``MosaicBackend(profile_dir=...)``: every compute warpgroup's ``mma`` and
``epilogue`` regions per tile, the memory warpgroup's ``stream``):

* ``clock_ghz``: the SM clock that converts the profiler's cycles (below);
* ``start_spread_us``: the last CTA's first event after the first CTA's;
* ``end_us`` (min / p10 / median / p90 / max over the CTAs): when each CTA's
  last event ends, from the first CTA's start; ``tail_us`` = max - median:
  what a perfectly balanced schedule could at most save;
* ``first_mma_us``: a tile's first ``mma`` region (the ring's first copies
  land in it), median over the CTAs; ``mma_us``: the median of the others;
  ``last_epilogue_us``: the median CTA's last tile's epilogue (the part of
  the kernel after its last weight byte arrived);
* ``kernel_us``: the same program unprofiled, its kernel's time per call
  in a trace of back-to-back calls, and ``sum_kernel_us``: a ``jnp.sum``
  over W alone (the read it is compared with; over an 8-bit W, XLA's sum
  runs slower than a read, and the floor is the measure).

Each profiled call is synced before the next (the profiler writes its trace
after the call); the last of ``--calls`` calls is summarized (the first call
of a process runs far slower than the others). ``--out`` keeps the last
traces (they open in Perfetto).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name, trace_events
from benchmarks.experiments.exp_small_b_kernel import kernel_us
from flashsample_jax.backends.mosaic import MosaicBackend

_WGS = 3  # two compute warpgroups and the memory warpgroup, per CTA


def regions(events):
  """``{(cta, wg, name): [(start, end), ...]}`` from a Mosaic GPU profiler
  trace's begin/end events (``tid`` numbers warpgroups CTA by CTA from 1)."""
  out = collections.defaultdict(list)
  open_ = {}
  for e in events:
    if e.get("ph") not in ("B", "E"):
      continue
    cta, wg = divmod(e["tid"] - 1, _WGS)
    key = (cta, wg, e["name"])
    if e["ph"] == "B":
      open_[key] = e["ts"]
    else:
      out[key].append((open_.pop(key), e["ts"]))
  return out


def summarize(events, kernel_time_us: float) -> dict:
  """The spread over CTAs of one launch's trace (see the module's doc).

  Mosaic GPU's profiler stamps regions with the SM's cycle counter (the
  trace's ``ts`` is a CTA's start by the global timer plus its cycles over
  1000), so times are scaled to microseconds by the clock that makes the
  last CTA's end the unprofiled kernel's time (``clock_ghz``)."""
  reg = regions(events)
  sm_of = {divmod(e["tid"] - 1, _WGS)[0]: e["pid"] - 1 for e in events if "pid" in e}
  per_cta = collections.defaultdict(list)
  for (cta, wg, name), ivs in reg.items():
    per_cta[cta] += [(a, b, wg, name) for a, b in ivs]
  t0 = min(a for evs in per_cta.values() for a, _, _, _ in evs)
  ctas = sorted(per_cta)
  ends = np.array([max(b for _, b, _, _ in per_cta[c]) - t0 for c in ctas])
  clock = float(ends.max()) / kernel_time_us
  us = lambda x: round(float(x) / clock, 2)
  starts, first_mma, mma, last_epi, tiles = [], [], [], [], []
  for cta in ctas:
    evs = per_cta[cta]
    starts.append(min(a for a, _, _, _ in evs) - t0)
    for wg in (0, 1):
      m = sorted(reg.get((cta, wg, "mma"), []))
      if m:
        first_mma.append(m[0][1] - m[0][0])
        mma += [b - a for a, b in m[1:]]
    epis = sorted(iv for wg in (0, 1) for iv in reg.get((cta, wg, "epilogue"), []))
    if epis:
      last_epi.append(epis[-1][1] - epis[-1][0])
    tiles.append(sum(len(reg.get((cta, wg, "mma"), [])) for wg in (0, 1)))
  q = lambda xs, p: us(np.percentile(xs, p))
  med = lambda xs: us(statistics.median(xs)) if xs else None
  latest = [ctas[i] for i in np.argsort(ends)[-5:][::-1]]
  return dict(ctas=len(ends), clock_ghz=round(clock, 3), tiles_per_cta=[min(tiles), max(tiles)],
              start_spread_us=q(starts, 100),
              end_us=[q(ends, p) for p in (0, 10, 50, 90, 100)],
              tail_us=round(q(ends, 100) - q(ends, 50), 2),
              first_mma_us=med(first_mma), mma_us=med(mma),
              last_epilogue_us=med(last_epi),
              latest_ctas=[int(c) for c in latest],
              latest_sms=[int(sm_of.get(c, -1)) for c in latest])


def profiled_trace(h, w, key, scale, where: str, calls: int):
  """The last of ``calls`` synced profiled calls' trace events."""
  os.makedirs(where, exist_ok=True)
  be = MosaicBackend(profile_dir=where)
  f = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=0.7, weight_scale=scale,
                                        backend=be))
  events = None
  for i in range(calls):
    jax.block_until_ready(f(h, w, key))
    jax.effects_barrier()
    traces = glob.glob(os.path.join(where, "*trace.json"))
    if not traces:
      raise RuntimeError(f"no profiler trace in {where}")
    # The trace's file name is fixed when the call is traced and the profiler
    # never overwrites it: each call's trace is read, then removed (the last
    # one is kept for --out).
    with open(traces[0]) as fh:
      events = json.load(fh)["traceEvents"]
    if i + 1 < calls:
      os.remove(traces[0])
  return events, traces


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S", "L", "qwen3-1.7b", "gpt-oss"],
                  choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--weight-dtypes", nargs="+", default=["bf16", "fp8"],
                  choices=["bf16", "fp8"])
  ap.add_argument("--calls", type=int, default=6)
  ap.add_argument("--out", default=None, help="keep the last traces here (gzipped)")
  args = ap.parse_args()
  tmp = tempfile.mkdtemp()
  key = jax.random.key(0)
  for head in args.heads:
    d, v = shapes.HEADS[head]
    w16 = shapes.random_head(head, 1.3)
    for wd in args.weight_dtypes:
      w, scale = (w16, None) if wd == "bf16" else fs.quantize_weight(w16)
      sum_w = jax.jit(lambda w: jnp.sum(w, dtype=jnp.float32))
      sum_kernel = max(d for _, d, _, _ in trace_events(sum_w, w, calls=1)[0]) / 1e3
      for b in args.batches:
        h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
        plain = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=0.7,
                                                  weight_scale=scale, backend="mosaic"))
        tok = plain(h, w, key)
        where = os.path.join(tmp, f"{head}_{wd}_{b}")
        events, traces = profiled_trace(h, w, key, scale, where, args.calls)
        kernel = kernel_us(plain, h, w, key)
        rec = dict(gpu=device_name(), jax=jax.__version__, head=head, weight=wd, B=b,
                   sum_kernel_us=round(sum_kernel, 1), kernel_us=round(kernel, 1),
                   tokens_checksum=int(np.asarray(tok).sum()), **summarize(events, kernel))
        print(json.dumps(rec), flush=True)
        if args.out:
          os.makedirs(args.out, exist_ok=True)
          with open(traces[-1], "rb") as src, gzip.open(
              os.path.join(args.out, f"trace_{head}_{wd}_{b}.json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
  main()
