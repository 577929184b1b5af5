"""Fused sampler vs the XLA baseline vs the weight-read floor (DESIGN.md 4).

Run on the GPU (one process, everything measured in the same run)::

    PYTHONPATH=. python3 benchmarks/bench_sampler.py [--out benchmarks/results]
        [--shapes S L] [--batches 1 2 4 ...] [--inner 50]

Providers (names shared with the tests through ``flashsample_jax.BACKENDS``):

* ``mosaic``: ``fs.sample(..., backend="mosaic")``, the fused Hopper kernel;
* ``xla``: ``fs.sample(..., backend="xla")``, the streaming pure-JAX backend;
* ``xla_baseline``: ``jax.random.categorical(k, jnp.dot(h, w.T, f32))``,
  which writes the ``[B, V]`` logits;
* ``floor``: W bytes over the read bandwidth of a large ``jnp.sum`` measured
  in the same process.

Writes ``sampler_<gpu>.json``, ``sampler_<gpu>.md`` and ``sampler_<gpu>.png``
under ``--out``, recording the GPU, jax version and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashsample_jax as fs  # noqa: E402
from benchmarks import _timing  # noqa: E402

SHAPES = {"S": (4096, 151936), "L": (8192, 128256)}  # (D, V): Qwen3-8B, Llama-3-70B
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROVIDERS = ("mosaic", "xla", "xla_baseline")


def _baseline(k, h, w):
  return jax.random.categorical(
      k, jnp.dot(h, w.T, preferred_element_type=jnp.float32))


def _make(provider):
  if provider == "xla_baseline":
    return jax.jit(_baseline)
  return jax.jit(lambda k, h, w: fs.sample(h, w, k, backend=provider))


def _gpu_name() -> str:
  dev = jax.devices()[0]
  return getattr(dev, "device_kind", str(dev))


def _slug(name: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run(shapes, batches, providers, *, reps=15, inner=50):
  bw = _timing.read_bandwidth()
  print(f"read bandwidth: {bw / 1e12:.3f} TB/s", flush=True)
  rows = []
  for name in shapes:
    d, v = SHAPES[name]
    kw = jax.random.key(1)
    w = (jax.random.normal(kw, (v, d), jnp.float32) / np.sqrt(d)).astype(
        jnp.bfloat16)
    floor_us = w.size * 2 / bw * 1e6
    print(f"shape {name}: D={d} V={v} W={w.size * 2 / 1e9:.3f} GB "
          f"floor={floor_us:.1f} us", flush=True)
    for b in batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      key = jax.random.key(7)
      row = dict(shape=name, D=d, V=v, B=b, floor_us=floor_us)
      for prov in providers:
        f = _make(prov)
        try:
          row[f"{prov}_compile_s"] = _timing.first_call_seconds(f, key, h, w)
          row[f"{prov}_us"], row[f"{prov}_samples"] = _timing.median_us(
              f, key, h, w, reps=reps, inner=inner)
        except Exception as e:  # noqa: BLE001 - report and keep going
          print(f"  {prov} B={b}: {type(e).__name__}: {e}"[:500], flush=True)
          row[f"{prov}_us"] = None
      if row.get("mosaic_us"):
        row["ratio_to_floor"] = row["mosaic_us"] / floor_us
        if row.get("xla_baseline_us"):
          row["speedup_vs_xla"] = row["xla_baseline_us"] / row["mosaic_us"]
      rows.append(row)
      print(_fmt_row(row), flush=True)
  return bw, rows


def _f(x, spec=".1f"):
  return "-" if x is None else format(x, spec)


def _fmt_row(r):
  return (f"| {r['shape']} | {r['B']} | {_f(r['floor_us'])} | "
          f"{_f(r.get('mosaic_us'))} | {_f(r.get('ratio_to_floor'), '.3f')} | "
          f"{_f(r.get('xla_baseline_us'))} | {_f(r.get('speedup_vs_xla'), '.2f')} | "
          f"{_f(r.get('xla_us'))} | {_f(r.get('mosaic_compile_s'), '.2f')} |")


_HEADER = ("| shape | B | floor us | mosaic us | mosaic/floor | XLA baseline us "
           "| speedup vs XLA | xla streaming us | mosaic first call s |\n"
           "|---|---|---|---|---|---|---|---|---|")


def write(out, bw, rows, meta):
  os.makedirs(out, exist_ok=True)
  slug = _slug(meta["gpu"])
  base = os.path.join(out, f"sampler_{slug}")
  with open(base + ".json", "w") as fh:
    json.dump(dict(meta, read_bandwidth_Bps=bw, rows=rows), fh, indent=1)
  with open(base + ".md", "w") as fh:
    fh.write(f"# Sampler benchmark on {meta['gpu']}\n\n"
             f"jax {meta['jax']}, {meta['date']}; read bandwidth "
             f"{bw / 1e12:.3f} TB/s (jnp.sum over 4 GiB); median us per call "
             f"(blocks of {meta['inner']} async calls between host syncs, "
             f"{meta['reps']} blocks, after warm-up); bf16.\n\n")
    fh.write(_HEADER + "\n" + "\n".join(_fmt_row(r) for r in rows) + "\n")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing: no plot")
    return
  shapes = sorted({r["shape"] for r in rows})
  fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4),
                           squeeze=False)
  for ax, name in zip(axes[0], shapes):
    rs = [r for r in rows if r["shape"] == name]
    bs = [r["B"] for r in rs]
    for key, label in (("mosaic_us", "mosaic (fused)"),
                       ("xla_baseline_us", "XLA dot + categorical"),
                       ("xla_us", "xla streaming backend"),
                       ("floor_us", "weight-read floor")):
      ys = [r.get(key) for r in rs]
      if any(y is not None for y in ys):
        ax.plot(bs, [np.nan if y is None else y for y in ys], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("B")
    ax.set_ylabel("us")
    ax.set_title(f"{name}: D={rs[0]['D']} V={rs[0]['V']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
  fig.suptitle(f"{meta['gpu']}, jax {meta['jax']}, {meta['date']}")
  fig.tight_layout()
  fig.savefig(base + ".png", dpi=110)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
  ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
  ap.add_argument("--providers", nargs="+", default=list(PROVIDERS))
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--inner", type=int, default=50,
                  help="calls per timed block: the first call of a block pays "
                       "the host's dispatch latency, so long blocks measure "
                       "the steady state of a decode loop that does not sync "
                       "every step (10 before 2026-11-26's fourth session)")
  args = ap.parse_args(argv)
  meta = dict(gpu=_gpu_name(), jax=jax.__version__,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              host=platform.node(), shapes={k: SHAPES[k] for k in args.shapes},
              inner=args.inner, reps=args.reps)
  print(meta, flush=True)
  bw, rows = run(args.shapes, args.batches, args.providers, reps=args.reps,
                 inner=args.inner)
  print(_HEADER)
  for r in rows:
    print(_fmt_row(r))
  write(args.out, bw, rows, meta)


if __name__ == "__main__":
  main()
