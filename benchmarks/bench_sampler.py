"""Every backend vs the XLA baseline, the cuBLAS dot alone and the weight-read floor.

Run on the GPU from the repository root (one process, everything measured in
the same run)::

    python3 -m benchmarks.bench_sampler [--out benchmarks/results]
        [--shapes S L qwen3-1.7b gpt-oss] [--batches 1 16 ...] [--inner 50]
        [--weight-dtype bf16 fp8 fp8_e5m2 int8] [--name SUFFIX]
    python3 -m benchmarks.bench_sampler --smoke    # CPU, seconds: a tiny head

Columns (provider names: ``flashsample_jax.BACKENDS`` plus these):

* each backend ``fs.sample(..., backend=name)`` that can run here (its
  ``check()`` passes; else ``-`` and the reason in the JSON), and ``auto``
  (with the backend it picked);
* ``xla_baseline``: ``jax.random.categorical(k, jnp.dot(h, w.T, f32))``,
  which writes the ``[B, V]`` f32 logits;
* ``dot``: the cuBLAS dot alone (what writing the logits costs);
* ``floor``: W bytes over the read bandwidth of a large ``jnp.sum`` measured
  in the same process;
* ``--device-time``: beside each wall time, the device time per call from a
  profiler trace of ``inner`` back-to-back calls (``_timing.device_period_us``:
  kernels and the gaps between them, not a block's first dispatch and last
  sync), and the floor over the 4 GiB sum's device time: the same numbers
  from a second harness (docs/performance.md, "Small batches");
* on request (``--providers``; by default with a quantized head) top-k 50 +
  top-p 0.9 (bench_controls' values): ``auto_topk_topp`` (``fs.sample`` with
  those controls) against ``xla_topk_topp`` (f32 logits, ``lax.top_k``,
  top-p on the k candidates, categorical over them: MaxText / T5X's way).

``--weight-dtype`` (docs/design.md, "Quantized heads"): ``bf16`` (the
default) times the bf16 head; ``fp8`` (float8_e4m3fn), ``fp8_e5m2`` and
``int8`` time the same head quantized per vocabulary row with
:func:`flashsample_jax.quantize_weight` (absmax: ``scale[v] = max |W[v]| /
qmax``). The fused providers get ``weight_scale``; XLA's providers convert
the 8-bit head to bf16 inside the dot and multiply the f32 product by the
scales (``f32(h @ W8.astype(bf16).T) * scale``, the logits the sampler
draws from); the floor is ``V x D x 1`` byte (the 4V bytes of scales, 0.1%
of it, are not counted). Several dtypes run one after the other in one
process, each written to its own files.

Writes ``sampler_<gpu>[_<dtype>][_<name>].json``, ``.md`` and ``.png``
(``<dtype>`` for quantized heads only) under ``--out`` with the GPU, jax
version, date and command; the JSON and table are rewritten after every row,
so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks import _timing
from benchmarks.shapes import HEADS

BATCHES = (1, 16, 64, 128, 256, 512, 1024)
# A head small enough for a CPU (--smoke, --shapes smoke).
SHAPES = {**HEADS, "smoke": (256, 4096)}
EXTRA = ("auto", "xla_baseline", "dot")
TOPK_TOPP = ("auto_topk_topp", "xla_topk_topp")
TOP_K, TOP_P = 50, 0.9        # bench_controls' top-k + top-p point
# --weight-dtype name -> the dtype fs.quantize_weight takes (None: the bf16 head).
WEIGHT_DTYPES = {"bf16": None, "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                 "int8": "int8"}


def _logits(h, w, s):
  """The f32 logits ``[B, V]`` the sampler draws from, written out: the bf16
  head as it is; an 8-bit one converted to bf16 in the dot, times ``s [V]``."""
  if s is None:
    return jnp.dot(h, w.T, preferred_element_type=jnp.float32)
  return jnp.dot(h, w.astype(h.dtype).T, preferred_element_type=jnp.float32) * s


def _baseline(k, h, w, s):
  return jax.random.categorical(k, _logits(h, w, s))


def _dot(k, h, w, s):
  del k
  return _logits(h, w, s)


def _xla_topk_topp(k, h, w, s):
  # bench_controls._xla_topk_topp on these logits.
  vals, ids = jax.lax.top_k(_logits(h, w, s), TOP_K)           # sorted descending
  q = jax.nn.softmax(vals, axis=-1)
  vals = jnp.where(jnp.cumsum(q, axis=-1) - q < TOP_P, vals, -jnp.inf)
  return jnp.take_along_axis(ids, jax.random.categorical(k, vals)[:, None], 1)[:, 0]


def make_provider(provider):
  """The jitted function ``f(k, h, w, s)`` a provider times (the extra
  providers' XLA programs, else ``fs.sample`` on that backend); shared with
  :mod:`benchmarks.stamp_timing`, so that both harnesses time one program."""
  if provider == "xla_baseline":
    return jax.jit(_baseline)
  if provider == "dot":
    return jax.jit(_dot)
  if provider == "xla_topk_topp":
    return jax.jit(_xla_topk_topp)
  if provider == "auto_topk_topp":
    return jax.jit(lambda k, h, w, s: fs.sample(h, w, k, weight_scale=s, top_k=TOP_K,
                                                top_p=TOP_P))
  return jax.jit(lambda k, h, w, s: fs.sample(h, w, k, backend=provider, weight_scale=s))


def gpu_name() -> str:
  dev = jax.devices()[0]
  return getattr(dev, "device_kind", str(dev))


def slug(name: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def read_bandwidth(device: bool = False) -> tuple[float, str]:
  """Read bandwidth in bytes/s, and how it was measured: a ``jnp.sum`` over
  4 GiB on a GPU; over a token amount on a CPU (where the number only has
  to exist). ``device``: by its device time (on a CPU, its wall time)."""
  gib = 1 / 16 if jax.default_backend() == "cpu" else 4.0
  return (_timing.read_bandwidth(gib=gib, reps=3 if gib < 1 else 20, device=device),
          f"jnp.sum over {gib:g} GiB")


def make_head(name: str, weight_dtype: str = "bf16"):
  """``(w, s)``: head ``name``'s random bf16 weight ``[V, D]`` (logits of
  std ~3 against N(0, 1) hidden states), or for a quantized ``weight_dtype``
  its per-row quantization ``(w8, scale [V])``; ``s`` is None for bf16."""
  d, v = SHAPES[name]
  kw = jax.random.key(1)
  w = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / np.sqrt(d))).astype(
      jnp.bfloat16)
  if WEIGHT_DTYPES[weight_dtype] is None:
    return w, None
  return fs.quantize_weight(w, WEIGHT_DTYPES[weight_dtype])


def run(shapes, batches, providers, weight_dtypes=("bf16",), *, bw, reps=15, inner=50,
        on_row=None, device_bw=None):
  """Rows of every (shape, weight dtype, B), each tagged with ``weight_dtype``;
  ``on_row(rows)`` after each (a run stopped by a time limit keeps its rows).
  ``device_bw``: the read bandwidth by device time; given, each provider's
  device time per call is measured too (``--device-time``)."""
  rows = []
  for name in shapes:
    d, v = SHAPES[name]
    for wdt in weight_dtypes:
      w, s = make_head(name, wdt)
      w_bytes = w.size * w.dtype.itemsize
      floor_us = w_bytes / bw * 1e6
      print(f"shape {name} {wdt}: D={d} V={v} W={w_bytes / 1e9:.3f} GB "
            f"floor={floor_us:.1f} us", flush=True)
      for b in batches:
        h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
        key = jax.random.key(7)
        row = dict(shape=name, D=d, V=v, B=b, weight_dtype=wdt, floor_us=floor_us,
                   weight_bytes=w_bytes, scale_bytes=0 if s is None else s.size * 4,
                   auto_backend=fs.which_backend(h, w, key, weight_scale=s))
        if device_bw:
          row["device_floor_us"] = w_bytes / device_bw * 1e6
        if s is not None:        # the bf16 head's floor, for the ratio quantizing buys
          row["bf16_floor_us"] = d * v * 2 / bw * 1e6
        if "auto_topk_topp" in providers:
          row["auto_topk_topp_backend"] = fs.which_backend(
              h, w, key, weight_scale=s, top_k=TOP_K, top_p=TOP_P)
        for prov in providers:
          f = make_provider(prov)
          try:
            row[f"{prov}_compile_s"] = _timing.first_call_seconds(f, key, h, w, s)
            row[f"{prov}_us"], _ = _timing.median_us(f, key, h, w, s, reps=reps,
                                                     inner=inner)
            if device_bw:
              row[f"{prov}_device_us"] = _timing.device_period_us(f, key, h, w, s,
                                                                  calls=inner)
          except NotImplementedError as e:
            row[f"{prov}_us"] = None
            row[f"{prov}_why"] = str(e)[:200]
          except Exception as e:  # noqa: BLE001 - report and keep going
            print(f"  {prov} B={b}: {type(e).__name__}: {e}"[:500], flush=True)
            row[f"{prov}_us"] = None
        if row.get("auto_us") and row.get("xla_baseline_us"):
          row["auto_speedup_vs_xla"] = row["xla_baseline_us"] / row["auto_us"]
        if row.get("auto_us"):
          row["auto_to_floor"] = row["auto_us"] / floor_us
        if row.get("auto_device_us"):
          row["auto_device_to_floor"] = row["auto_device_us"] / row["device_floor_us"]
        if row.get("auto_topk_topp_us") and row.get("xla_topk_topp_us"):
          row["auto_topk_topp_speedup_vs_xla"] = (row["xla_topk_topp_us"]
                                                  / row["auto_topk_topp_us"])
        rows.append(row)
        print(_fmt_row(row, providers), flush=True)
        if on_row is not None:
          on_row(rows)
      del w, s
  return rows


def _f(x, spec=".1f"):
  return "-" if x is None else format(x, spec)


def _fmt_row(r, providers):
  cells = [r["shape"], str(r["B"]), _f(r["floor_us"]), _f(r.get("dot_us")),
           _f(r.get("xla_baseline_us"))]
  cells += [_f(r.get(f"{p}_us")) for p in providers if p not in EXTRA + TOPK_TOPP]
  cells += [f"{_f(r.get('auto_us'))} ({r['auto_backend']})",
            _f(r.get("auto_speedup_vs_xla"), ".2f"), _f(r.get("auto_to_floor"), ".3f")]
  if "xla_topk_topp" in providers:
    cells.append(_f(r.get("xla_topk_topp_us")))
  if "auto_topk_topp" in providers:
    cells.append(f"{_f(r.get('auto_topk_topp_us'))} ({r['auto_topk_topp_backend']})")
  if set(TOPK_TOPP) <= set(providers):
    cells.append(_f(r.get("auto_topk_topp_speedup_vs_xla"), ".2f"))
  if "device_floor_us" in r:
    cells += [_f(r["device_floor_us"]), _f(r.get("dot_device_us")),
              _f(r.get("auto_device_us")), _f(r.get("auto_device_to_floor"), ".3f")]
  return "| " + " | ".join(cells) + " |"


def _header(providers, device_time=False):
  cols = ["shape", "B", "floor", "cuBLAS dot alone", "XLA dot + categorical"]
  cols += [p for p in providers if p not in EXTRA + TOPK_TOPP]
  cols += ["auto (backend)", "auto speedup vs XLA", "auto / floor"]
  if "xla_topk_topp" in providers:
    cols.append("XLA top-k + top-p")
  if "auto_topk_topp" in providers:
    cols.append("auto top-k + top-p (backend)")
  if set(TOPK_TOPP) <= set(providers):
    cols.append("top-k + top-p speedup vs XLA")
  if device_time:
    cols += ["floor (device)", "dot (device)", "auto (device)", "auto / floor (device)"]
  return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def _describe(weight_dtype: str) -> str:
  if WEIGHT_DTYPES[weight_dtype] is None:
    return "bf16"
  return (f"the head quantized per row to {WEIGHT_DTYPES[weight_dtype]} (absmax, "
          "fs.quantize_weight; f32 scales [V]), bf16 hidden states; XLA's columns: "
          "f32(h @ W8.astype(bf16).T) * scale; floor: V x D x 1 byte")


def write(out, bw, rows, meta, providers, *, plot=True):
  os.makedirs(out, exist_ok=True)
  wdt = meta["weight_dtype"]
  base = os.path.join(out, f"sampler_{slug(meta['gpu'])}"
                      + ("" if wdt == "bf16" else f"_{wdt}")
                      + (f"_{meta['name']}" if meta.get("name") else ""))
  with open(base + ".json", "w") as fh:
    json.dump(dict(meta, read_bandwidth_Bps=bw, rows=rows), fh, indent=1)
  topk = (f" Top-k + top-p: k {TOP_K}, p {TOP_P}."
          if set(TOPK_TOPP) & set(providers) else "")
  with open(base + ".md", "w") as fh:
    fh.write(f"# Sampler benchmark on {meta['gpu']}\n\n"
             f"jax {meta['jax']}, {meta['date']}; read bandwidth "
             f"{bw / 1e12:.3f} TB/s ({meta['bandwidth_from']}); median us per call "
             f"(blocks of {meta['inner']} async calls between host syncs, "
             f"{meta['reps']} blocks, after warm-up); {_describe(wdt)}; '-': the "
             f"backend does not run here or for this call.{topk} Command: "
             f"`{meta['command']}`.\n\n")
    if meta.get("device_read_bandwidth_Bps"):
      fh.write(f"Device columns: us per call on the device (a profiler trace of "
               f"{meta['inner']} back-to-back calls, the gaps between them included); "
               f"their floor over the 4 GiB sum's device read bandwidth, "
               f"{meta['device_read_bandwidth_Bps'] / 1e12:.3f} TB/s.\n\n")
    fh.write(_header(providers, bool(meta.get("device_read_bandwidth_Bps"))) + "\n"
             + "\n".join(_fmt_row(r, providers) for r in rows) + "\n")
  if not plot:
    return
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
    ax.set_title(f"{name} ({wdt}): D={rs[0]['D']} V={rs[0]['V']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(f"{meta['gpu']}, jax {meta['jax']}, {meta['date']}")
  fig.tight_layout()
  fig.savefig(base + ".png", dpi=110)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--smoke", action="store_true",
                  help="a tiny head (D 256, V 4096), B 1 and 4, few reps: a CPU check "
                       "that the script works")
  ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None,
                  help=f"default {' '.join(HEADS)} (--smoke: smoke)")
  ap.add_argument("--batches", nargs="+", type=int, default=None,
                  help=f"default {' '.join(map(str, BATCHES))} (--smoke: 1 4)")
  ap.add_argument("--weight-dtype", nargs="+", choices=list(WEIGHT_DTYPES),
                  default=["bf16"], dest="weight_dtypes",
                  help="the head's dtype: bf16, or quantized per row (fp8 = "
                       "float8_e4m3fn, fp8_e5m2, int8); several: one file each")
  ap.add_argument("--providers", nargs="+", default=None,
                  choices=[*fs.BACKENDS, *EXTRA, *TOPK_TOPP],
                  help=f"default: {' '.join([*fs.BACKENDS, *EXTRA])}, and "
                       f"{' '.join(TOPK_TOPP)} when a quantized dtype is asked for")
  ap.add_argument("--reps", type=int, default=None, help="timed blocks (default 15)")
  ap.add_argument("--inner", type=int, default=None,
                  help="calls per timed block (default 50): long blocks measure the "
                       "steady state of a decode loop that does not sync every step")
  ap.add_argument("--bandwidth", type=float, default=None,
                  help="read bandwidth in bytes/s for the floor (default: measured)")
  ap.add_argument("--device-time", action="store_true",
                  help="also each provider's device time per call from a profiler trace, "
                       "and the floor by the 4 GiB sum's device time")
  ap.add_argument("--name", default=None, help="file stem suffix")
  ap.add_argument("--no-plot", action="store_true")
  args = ap.parse_args(argv)
  shapes = args.shapes or (["smoke"] if args.smoke else list(HEADS))
  batches = args.batches or ([1, 4] if args.smoke else list(BATCHES))
  reps = args.reps or (2 if args.smoke else 15)
  inner = args.inner or (2 if args.smoke else 50)
  dtypes = list(dict.fromkeys(args.weight_dtypes))
  providers = args.providers or [
      *fs.BACKENDS, *EXTRA, *(TOPK_TOPP if set(dtypes) != {"bf16"} else ())]
  if min(batches) < 1 or reps < 1 or inner < 1:
    ap.error(f"--batches={batches}, --reps={reps}, --inner={inner} must be >= 1")
  argv = sys.argv[1:] if argv is None else argv
  meta = dict(gpu=gpu_name(), jax=jax.__version__,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              host=platform.node(), shapes={k: SHAPES[k] for k in shapes},
              inner=inner, reps=reps, name=args.name, providers=providers,
              top_k=TOP_K, top_p=TOP_P,
              command=shlex.join(["python3", "-m", "benchmarks.bench_sampler", *argv]))
  print(meta, flush=True)
  if args.bandwidth:
    bw, meta["bandwidth_from"] = args.bandwidth, "given: --bandwidth"
  else:
    bw, meta["bandwidth_from"] = read_bandwidth()
  print(f"read bandwidth: {bw / 1e12:.3f} TB/s", flush=True)
  device_bw = None
  if args.device_time:
    device_bw = read_bandwidth(device=True)[0]
    meta["device_read_bandwidth_Bps"] = device_bw
    print(f"read bandwidth by device time: {device_bw / 1e12:.3f} TB/s", flush=True)
  def write_all(rows, plot=False):
    for wdt in dict.fromkeys(r["weight_dtype"] for r in rows):
      write(args.out, bw, [r for r in rows if r["weight_dtype"] == wdt],
            dict(meta, weight_dtype=wdt), providers, plot=plot)

  rows = run(shapes, batches, providers, dtypes, bw=bw, reps=reps, inner=inner,
             on_row=write_all, device_bw=device_bw)
  write_all(rows, plot=not args.no_plot)
  for wdt in dtypes:
    print(f"\nweight dtype {wdt}:")
    print(_header(providers, args.device_time))
    for r in rows:
      if r["weight_dtype"] == wdt:
        print(_fmt_row(r, providers))


if __name__ == "__main__":
  main()
