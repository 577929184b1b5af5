"""Where a ping-pong launch's time goes, warpgroup by warpgroup (issue #20).

Runs plain sampling once per point with Mosaic GPU's profiler on
(``MosaicBackend(profile_dir=...)``), which records the start and end of
each compute warpgroup's named regions per tile (``mma``: its wgmma steps
over the stream, with their barrier waits; ``acc_wait``: waiting for the
shared accumulator buffer; ``epilogue``) and the memory warpgroup's
``stream``. Then summarizes, over the CTAs of the launch:

* ``span_us``: a CTA's first start to last end;
* ``mma_any``: the share of the span where at least one warpgroup is in its
  ``mma`` region (the tensor cores can only be busy then), ``mma_both``:
  where both are (one waits for the other's steps: the stream is in order);
* per tile and warpgroup: ``mma_us``, ``epilogue_us``, ``acc_wait_us``.

  python3 -m benchmarks.experiments.exp_timeline S:256 L:256 --variants blocks,p4_f1

``--variants`` as in ``exp_blocks`` (default: the heuristic's launch). The
trace files stay in ``--out`` (default a temporary directory); they open in
Perfetto.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import statistics
import sys
import tempfile

import jax
import numpy as np

import flashsample_jax as fs
from benchmarks.experiments.exp_blocks import variant_config
from benchmarks.shapes import points
from flashsample_jax.backends.mosaic import MosaicBackend

_WGS = 3  # two compute warpgroups and the memory warpgroup


def _union(intervals):
  total, end = 0.0, float("-inf")
  for a, b in sorted(intervals):
    if b > end:
      total += b - max(a, end)
      end = b
  return total


def _intersection(xs, ys):
  """Total length where an interval of ``xs`` overlaps one of ``ys`` (each
  list's intervals disjoint)."""
  total = 0.0
  for a, b in xs:
    for c, d in ys:
      total += max(0.0, min(b, d) - max(a, c))
  return total


def summarize(trace_path):
  events = json.load(open(trace_path))["traceEvents"]
  regions = collections.defaultdict(list)  # (cta, wg, name) -> [(start, end)]
  open_ = {}
  for e in events:
    cta, wg = divmod(e["tid"] - 1, _WGS)
    key = (cta, wg, e["name"])
    if e["ph"] == "B":
      open_[key] = e["ts"]
    else:
      regions[key].append((open_.pop(key), e["ts"]))
  ctas = sorted({k[0] for k in regions})
  rows = []
  for cta in ctas:
    spans = [iv for k, ivs in regions.items() if k[0] == cta for iv in ivs]
    span = max(b for _, b in spans) - min(a for a, _ in spans)
    mma = [regions.get((cta, wg, "mma"), []) for wg in (0, 1)]
    tiles = sum(len(m) for m in mma)
    per_tile = lambda name: sum(b - a for wg in (0, 1)
                                for a, b in regions.get((cta, wg, name), [])) / tiles
    rows.append(dict(span=span, mma_any=_union(mma[0] + mma[1]) / span,
                     mma_both=_intersection(mma[0], mma[1]) / span, tiles=tiles,
                     mma=per_tile("mma"), epilogue=per_tile("epilogue"),
                     acc_wait=per_tile("acc_wait")))
  med = lambda k: round(statistics.median(r[k] for r in rows), 3)
  return dict(ctas=len(rows), span_us=med("span"), mma_any=med("mma_any"),
              mma_both=med("mma_both"), tiles_per_cta=med("tiles"),
              mma_us=med("mma"), epilogue_us=med("epilogue"),
              acc_wait_us=med("acc_wait"))


def main(specs, names, out):
  key = jax.random.key(7)
  for head, d, v, b, w, h in points(specs):
    for name in names:
      cfg = None if name == "auto" else variant_config(name, b, d, v)
      where = os.path.join(out, f"{head}_{b}_{name}")
      os.makedirs(where, exist_ok=True)
      be = MosaicBackend(config=cfg, profile_dir=where)
      f = jax.jit(lambda h, w, k, be=be: fs.sample(h, w, k, temperature=0.7, backend=be))
      tok = np.asarray(f(h, w, key))
      jax.effects_barrier()
      traces = sorted(glob.glob(os.path.join(where, "*trace.json")))
      rec = dict(head=head, b=b, variant=name, tokens=int(tok.sum()),
                 trace=traces[-1] if traces else None)
      if traces:
        rec.update(summarize(traces[-1]))
      print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  args = sys.argv[1:]
  names, out = ("auto",), None
  if "--variants" in args:
    i = args.index("--variants")
    names = tuple(args[i + 1].split(","))
    del args[i:i + 2]
  if "--out" in args:
    i = args.index("--out")
    out = args[i + 1]
    del args[i:i + 2]
  main(args, names, out or tempfile.mkdtemp())
