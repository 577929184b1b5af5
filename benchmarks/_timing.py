"""Timing helpers shared by the benchmarks (docs/design.md, "Performance: how it is measured";
docs/performance.md, "How it is measured").

JAX exposes no device events, so a timed sample is a block of ``inner``
back-to-back asynchronous calls between two host clock reads, synchronized
at both ends; dispatch overlaps the device work, so the per-call time is the
device time plus any launch gap XLA leaves. The median over ``reps`` blocks
is reported.
"""

from __future__ import annotations

import statistics
import time

import jax


def first_call_seconds(f, *args) -> float:
  """Wall time of the first call (trace, compile, run) of a fresh jit."""
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  return time.perf_counter() - t0


def median_us(f, *args, warmup: int = 5, reps: int = 15, inner: int = 10):
  """Median microseconds per call of ``f(*args)`` after ``warmup`` calls."""
  for _ in range(warmup):
    out = f(*args)
  jax.block_until_ready(out)
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = f(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner * 1e6)
  return statistics.median(samples), samples


def enqueue_us(f, args, calls: int = 8) -> float:
  """Host microseconds per asynchronous call of ``f(*args)``, the device idle
  at the start (best of 5 blocks of ``calls``): the host's dispatch cost
  while the device queue is not full. Where it reaches the device's time
  per call, the device waits on the host (docs/performance.md, "Small
  batches")."""
  best = float("inf")
  for _ in range(5):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
      out = f(*args)
    best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    jax.block_until_ready(out)
  return best


def timed_rounds(variants, *args, rounds: int, **tags):
  """Times ``variants`` (name -> function of ``args``) in turn, ``rounds``
  times, and prints one JSON line per round: ``tags`` and each variant's
  median us. At the power cap a variant's time depends on what ran just
  before it, so a decision should rest on the rounds' spread
  (docs/performance.md, "Measuring at the power cap")."""
  import json
  for r in range(rounds):
    rec = dict(tags, round=r)
    for name, f in variants.items():
      rec[name] = round(median_us(f, *args, reps=7, inner=20)[0], 1)
    print(json.dumps(rec), flush=True)


def trace_events(f, *args, calls: int = 6, synced: bool = False):
  """Device and host events of ``calls`` back-to-back calls of ``f(*args)``
  (after one warm-up call), from a JAX profiler trace. ``synced``: each call
  waits for the one before it (no two in flight, so each reuses the last
  one's buffers where the allocator gives them back).

  Returns ``(device, host)``, each sorted by start: ``device`` holds
  ``(start_ns, duration_ns, name, line)`` of the GPU streams' kernels and
  copies (empty on a CPU), ``host`` ``(start_ns, duration_ns, thread, name)``
  of the host's events.
  """
  import glob
  import os
  import tempfile
  jax.block_until_ready(f(*args))
  trace_dir = tempfile.mkdtemp()
  jax.profiler.start_trace(trace_dir)
  for _ in range(calls):
    out = f(*args)
    if synced:
      out = jax.block_until_ready(out)
  jax.block_until_ready(out)
  jax.profiler.stop_trace()
  path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
  device, host = [], []
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    for line in plane.lines:
      if plane.name.startswith("/device:GPU") and "stream" in line.name.lower():
        device += [(e.start_ns, e.duration_ns, e.name, line.name) for e in line.events]
      elif plane.name == "/host:CPU":
        host += [(e.start_ns, e.duration_ns, line.name, e.name) for e in line.events]
  return sorted(device), sorted(host)


def device_period_us(f, *args, calls: int = 20):
  """Device microseconds per call of ``calls`` back-to-back calls of
  ``f(*args)``: the span from the first kernel's start to the last one's
  end in a profiler trace, over ``calls`` (the launch gaps between calls
  included, the host's block overhead not). None on a CPU (no device
  events)."""
  device, _ = trace_events(f, *args, calls=calls)
  if not device:
    return None
  return (device[-1][0] + device[-1][1] - device[0][0]) / calls / 1e3


def read_bandwidth(gib: float = 4.0, reps: int = 20, device: bool = False) -> float:
  """Device read bandwidth in bytes/s: a large ``jnp.sum`` over ``gib`` GiB.

  The sum reads every byte once and writes a scalar; its time is the
  weight-read floor's denominator (docs/design.md). By wall time (blocks
  of 5 calls), or with ``device`` by its device time per call
  (:func:`device_period_us`; the wall time where there is none, a CPU).
  """
  import jax.numpy as jnp
  n = int(gib * 2**30) // 2
  x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), jnp.bfloat16)
  f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  us = device_period_us(f, x, calls=10) if device else None
  if us is None:
    us, _ = median_us(f, x, reps=reps, inner=5)
  del x
  return n * 2 / (us * 1e-6)


def head_run(head: str, smoke: bool, logit_std: float = 1.3):
  """``(d, v, w, res)``: the shape of ``head`` (a tiny 256 x 4096 one with
  ``smoke``), its random bf16 weight ``[V, D]`` whose logits against N(0, 1)
  hidden states have standard deviation about ``logit_std``, and a results
  dict with the device, jax, the head and its weight-read floor (W's bytes
  over a large ``jnp.sum``'s read bandwidth) for a benchmark to add points to."""
  from benchmarks import shapes
  d, v = (256, 4096) if smoke else shapes.HEADS[head]
  w = shapes.random_weight(d, v, logit_std)
  gbs = read_bandwidth(0.0625 if smoke else 4.0)
  res = dict(gpu=device_name(), jax=jax.__version__, head=head, D=d, V=v,
             floor_us=round(v * d * 2 / gbs * 1e6, 1), read_gbs=round(gbs / 1e9, 1),
             points=[])
  return d, v, w, res


def add_point(res: dict, point: dict, on_point) -> None:
  """Appends ``point`` to ``res["points"]``, prints it and calls
  ``on_point(res)`` (which writes the results so far)."""
  res["points"].append(point)
  print(point, flush=True)
  on_point(res)


def head_line(res: dict) -> str:
  """The markdown tables' first words on the head of :func:`head_run`."""
  return (f"Head {res['head']} ({res['D']} x {res['V']}, bf16); weight-read floor "
          f"{res['floor_us']} us ({res['read_gbs']} GB/s).")


def device_name() -> str:
  """The first device's name: ``"NVIDIA H100 80GB HBM3"``, or ``"cpu (x86_64)"``."""
  import platform
  d = jax.devices()[0]
  return d.device_kind if d.platform != "cpu" else f"cpu ({platform.machine()})"


def slug(name: str) -> str:
  """A file-name stem: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``; a CPU -> ``"cpu"``."""
  import re
  if name.startswith("cpu"):
    return "cpu"
  s = re.sub(r"^nvidia\s+", "", name.strip().lower())
  return re.sub(r"[^a-z0-9]+", "-", s).strip("-")


def pow2_axis(ax, xs, xlabel: str, ylabel: str | None = None, title: str | None = None) -> None:
  """A matplotlib axis over batch sizes or TP degrees: log2 x with a tick
  at each of ``xs``, y from 0 when ``ylabel`` is given, a light grid."""
  ax.set_xscale("log", base=2)
  ax.set_xticks(xs, [str(x) for x in xs])
  ax.minorticks_off()
  ax.set_xlabel(xlabel)
  if ylabel is not None:
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
  if title is not None:
    ax.set_title(title)
  ax.grid(alpha=0.3)


def panels(n: int):
  """``(fig, axes)``: a row of ``n`` matplotlib panels (Agg), 5 x 4 inches each."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
  return fig, axes[0]


def save_panels(fig, axes, path) -> None:
  """The first panel's legend, a tight layout, and the figure written to ``path``."""
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def write_results(res: dict, out, stem: str, *, markdown, plot=None) -> None:
  """``stem``.json and ``stem``.md (``markdown(res)``) under ``out``, and
  ``stem``.png by ``plot(res, path)`` when given: what the end-to-end
  benchmarks write after every point and at the end."""
  import json
  from pathlib import Path
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
  (out / f"{stem}.md").write_text(markdown(res))
  if plot is not None:
    plot(res, out / f"{stem}.png")


def run_and_write(bench, args, stem: str, *, markdown, plot) -> dict:
  """Runs ``bench(args, on_point=...)``, writing the results after every
  point (no plot) and at the end (with ``plot`` unless ``args.no_plot``),
  then prints the table: the end-to-end benchmarks' ``main``."""
  res = bench(args, on_point=lambda r: write_results(r, args.out, stem, markdown=markdown))
  write_results(res, args.out, stem, markdown=markdown, plot=None if args.no_plot else plot)
  print(markdown(res))
  print(f"wrote {args.out / stem}.{{json,md{'' if args.no_plot else ',png'}}}")
  return res
