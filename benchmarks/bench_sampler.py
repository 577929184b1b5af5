"""Every backend vs the XLA baseline, the cuBLAS dot alone and the weight-read floor.

Run on the GPU from the repository root (one process, everything measured in
the same run)::

    python3 -m benchmarks.bench_sampler [--out benchmarks/results]
        [--shapes S L qwen3-1.7b gpt-oss] [--batches 1 16 ...] [--inner 50]

Columns (provider names: ``flashsample_jax.BACKENDS`` plus these):

* each backend ``fs.sample(..., backend=name)`` that can run here, and
  ``auto`` (with the backend it picked);
* ``xla_baseline``: ``jax.random.categorical(k, jnp.dot(h, w.T, f32))``,
  which writes the ``[B, V]`` f32 logits;
* ``dot``: the cuBLAS dot alone (what writing the logits costs);
* ``floor``: W bytes over the read bandwidth of a large ``jnp.sum`` measured
  in the same process.

Writes ``sampler_<gpu>.json``, ``.md`` and ``.png`` under ``--out`` with the
GPU, jax version and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks import _timing
from benchmarks.shapes import HEADS

BATCHES = (1, 16, 64, 128, 256, 512, 1024)
EXTRA = ("auto", "xla_baseline", "dot")


def _baseline(k, h, w):
  return jax.random.categorical(
      k, jnp.dot(h, w.T, preferred_element_type=jnp.float32))


def _dot(k, h, w):
  del k
  return jnp.dot(h, w.T, preferred_element_type=jnp.float32)


def _make(provider):
  if provider == "xla_baseline":
    return jax.jit(_baseline)
  if provider == "dot":
    return jax.jit(_dot)
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
    d, v = HEADS[name]
    kw = jax.random.key(1)
    w = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / np.sqrt(d))).astype(
        jnp.bfloat16)
    floor_us = w.size * 2 / bw * 1e6
    print(f"shape {name}: D={d} V={v} W={w.size * 2 / 1e9:.3f} GB "
          f"floor={floor_us:.1f} us", flush=True)
    for b in batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      key = jax.random.key(7)
      row = dict(shape=name, D=d, V=v, B=b, floor_us=floor_us,
                 auto_backend=fs.which_backend(h, w, key))
      for prov in providers:
        f = _make(prov)
        try:
          row[f"{prov}_compile_s"] = _timing.first_call_seconds(f, key, h, w)
          row[f"{prov}_us"], _ = _timing.median_us(f, key, h, w, reps=reps,
                                                   inner=inner)
        except NotImplementedError as e:
          row[f"{prov}_us"] = None
          row[f"{prov}_why"] = str(e)[:200]
        except Exception as e:  # noqa: BLE001 - report and keep going
          print(f"  {prov} B={b}: {type(e).__name__}: {e}"[:500], flush=True)
          row[f"{prov}_us"] = None
      if row.get("auto_us") and row.get("xla_baseline_us"):
        row["auto_speedup_vs_xla"] = row["xla_baseline_us"] / row["auto_us"]
        row["auto_to_floor"] = row["auto_us"] / floor_us
      rows.append(row)
      print(_fmt_row(row, providers), flush=True)
  return bw, rows


def _f(x, spec=".1f"):
  return "-" if x is None else format(x, spec)


def _fmt_row(r, providers):
  cells = [r["shape"], str(r["B"]), _f(r["floor_us"]), _f(r.get("dot_us")),
           _f(r.get("xla_baseline_us"))]
  cells += [_f(r.get(f"{p}_us")) for p in providers if p not in EXTRA]
  cells += [f"{_f(r.get('auto_us'))} ({r['auto_backend']})",
            _f(r.get("auto_speedup_vs_xla"), ".2f"), _f(r.get("auto_to_floor"), ".3f")]
  return "| " + " | ".join(cells) + " |"


def _header(providers):
  cols = ["shape", "B", "floor", "cuBLAS dot alone", "XLA dot + categorical"]
  cols += [p for p in providers if p not in EXTRA]
  cols += ["auto (backend)", "auto speedup vs XLA", "auto / floor"]
  return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def write(out, bw, rows, meta, providers):
  os.makedirs(out, exist_ok=True)
  base = os.path.join(out, f"sampler_{_slug(meta['gpu'])}")
  with open(base + ".json", "w") as fh:
    json.dump(dict(meta, read_bandwidth_Bps=bw, rows=rows), fh, indent=1)
  with open(base + ".md", "w") as fh:
    fh.write(f"# Sampler benchmark on {meta['gpu']}\n\n"
             f"jax {meta['jax']}, {meta['date']}; read bandwidth "
             f"{bw / 1e12:.3f} TB/s (jnp.sum over 4 GiB); median us per call "
             f"(blocks of {meta['inner']} async calls between host syncs, "
             f"{meta['reps']} blocks, after warm-up); bf16; '-': the backend "
             "does not run here or for this call. Command: `python3 -m "
             "benchmarks.bench_sampler`.\n\n")
    fh.write(_header(providers) + "\n" + "\n".join(_fmt_row(r, providers) for r in rows)
             + "\n")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing: no plot")
    return
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4),
                           squeeze=False)
  for ax, name in zip(axes[0], shapes):
    rs = [r for r in rows if r["shape"] == name]
    bs = [r["B"] for r in rs]
    for key in [f"{p}_us" for p in providers] + ["floor_us"]:
      ys = [r.get(key) for r in rs]
      if any(y is not None for y in ys):
        ax.plot(bs, [np.nan if y is None else y for y in ys], "o-",
                label=key[:-3].replace("xla_baseline", "XLA dot + categorical"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("B")
    ax.set_ylabel("us")
    ax.set_title(f"{name}: D={rs[0]['D']} V={rs[0]['V']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(f"{meta['gpu']}, jax {meta['jax']}, {meta['date']}")
  fig.tight_layout()
  fig.savefig(base + ".png", dpi=110)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--shapes", nargs="+", default=list(HEADS))
  ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
  ap.add_argument("--providers", nargs="+", default=[*fs.BACKENDS, *EXTRA])
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--inner", type=int, default=50,
                  help="calls per timed block: long blocks measure the steady "
                       "state of a decode loop that does not sync every step")
  args = ap.parse_args(argv)
  meta = dict(gpu=_gpu_name(), jax=jax.__version__,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              host=platform.node(), shapes={k: HEADS[k] for k in args.shapes},
              inner=args.inner, reps=args.reps)
  print(meta, flush=True)
  bw, rows = run(args.shapes, args.batches, args.providers, reps=args.reps,
                 inner=args.inner)
  print(_header(args.providers))
  for r in rows:
    print(_fmt_row(r, args.providers))
  write(args.out, bw, rows, meta, args.providers)


if __name__ == "__main__":
  main()
