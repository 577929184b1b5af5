"""Sampling controls: fused vs XLA baselines that materialize the logits.

Run on the GPU (one process, one run)::

    python3 -m benchmarks.bench_controls [--out DIR] [--smoke] [--backend NAME] [--shape L]
    python3 -m benchmarks.bench_controls --report RESULTS.json  # table + plot again

Shape S (D 4096, V 151936, bf16; ``--shape`` another of
``benchmarks.shapes.HEADS``), logits with std ~3, B in {1, 16, 64, 128,
256}. Each control is timed fused (``fs.sample``, backend auto: the mosaic
kernel on an sm90 GPU) and as an XLA baseline that materializes the
``[B, V]`` logits and applies the same filter, in the same run:

* ``plain``: temperature only | ``jax.random.categorical(k, dot(h, w.T))``;
* ``topk_topp`` (k=50, p=0.9): fused, and fused on the xla backend
  (``topk_topp_xlabackend``) | ``lax.top_k(50)``, top-p on the 50,
  categorical (``xla_topk_topp``); full sort + cumsum (``xla_sort_topp``);
* ``topk_topp_<output>``: the same with an RL output (``logprobs``,
  ``entropy``, ``kept64``: ``return_kept=64``, ``rl_all``: all of them and
  the raw log-probability), fused only: their cost over ``topk_topp``;
* ``logprobs``: ``return_logprobs=True`` | categorical + ``log_softmax``;
* ``bias_mask``: ``logit_bias`` + ``allowed_mask`` | add, mask, categorical;
* ``softcap`` (c=30): | ``c * tanh(l / c)``, categorical;
* ``samples4``: ``num_samples=4`` | ``categorical(shape=(4, B))``;
* ``top_logprobs20``: ``top_logprobs=20`` | categorical, ``lax.top_k`` of
  ``log_softmax``;
* ``penalties256``: repetition 1.2, presence 0.5, frequency 0.3 over a
  history of 128 prompt + 128 output ids per row | counts scattered into
  ``[B, V]``, the penalties applied to the logits (vLLM's way), categorical.

Each B also times the cuBLAS dot alone (``dot``: the f32 logits written).
Also reports how many rows took the exact materialized fallback for top-k +
top-p on these logits (``fallback_rows``; with an RL output asked for,
also with ``return_logprobs``, where top-p's edge shortcut is off). Writes ``controls_<gpu>.json`` /
``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import _timing
from benchmarks._fallback import exact_path_rows
from benchmarks.shapes import HEADS

TOP_K, TOP_P, SOFTCAP = 50, 0.9, 30.0
TOP_N = 20
PENALTIES = dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)
HISTORY = 128       # prompt ids and output ids per row (256 in all)
# The backend of the fused columns (--backend): "auto" by default. A list so
# that main() can set it before the providers are traced.
_BACKEND = ["auto"]


def _logits(h, w):
  return jnp.dot(h, w.T, preferred_element_type=jnp.float32)


def _xla_topk_topp(k, h, w, **_):
  vals, ids = jax.lax.top_k(_logits(h, w), TOP_K)           # sorted descending
  q = jax.nn.softmax(vals, axis=-1)
  vals = jnp.where(jnp.cumsum(q, axis=-1) - q < TOP_P, vals, -jnp.inf)
  return jnp.take_along_axis(ids, jax.random.categorical(k, vals)[:, None], 1)[:, 0]


def _xla_sort_topp(k, h, w, **_):
  l = _logits(h, w)
  order = jnp.argsort(-l, axis=-1)
  ls = jnp.take_along_axis(l, order, axis=-1)
  q = jax.nn.softmax(ls, axis=-1)
  ls = jnp.where(jnp.cumsum(q, axis=-1) - q < TOP_P, ls, -jnp.inf)
  return jnp.take_along_axis(order, jax.random.categorical(k, ls)[:, None], 1)[:, 0]


def _xla_logprobs(k, h, w, **_):
  l = _logits(h, w)
  tok = jax.random.categorical(k, l)
  return tok, jnp.take_along_axis(jax.nn.log_softmax(l), tok[:, None], 1)[:, 0]


def _xla_top_logprobs(k, h, w, **_):
  l = _logits(h, w)
  return jax.random.categorical(k, l), jax.lax.top_k(jax.nn.log_softmax(l), TOP_N)


def _xla_penalties(k, h, w, prompt, output, **_):
  l = _logits(h, w)
  b, v = l.shape
  rows = jnp.arange(b)[:, None]
  count = jnp.zeros((b, v), jnp.int32).at[rows, output].add(1)
  seen = (count > 0) | (jnp.zeros((b, v), jnp.int32).at[rows, prompt].add(1) > 0)
  r = PENALTIES["repetition_penalty"]
  l = jnp.where(seen, jnp.where(l > 0, l / r, l * r), l)
  l = l - PENALTIES["frequency_penalty"] * count - PENALTIES["presence_penalty"] * (count > 0)
  return jax.random.categorical(k, l)


def _xla_bias_mask(k, h, w, bias, mask, **_):
  l = _logits(h, w) + bias
  v = l.shape[1]
  ids = jnp.arange(v)
  bits = (jnp.take(mask, ids // 32, axis=1) >> (ids % 32).astype(jnp.uint32)) & 1
  return jax.random.categorical(k, jnp.where(bits == 1, l, -jnp.inf))


# The RL outputs timed beside plain top-k + top-p (``topk_topp_<name>``).
RL_OUTPUTS = {
    "logprobs": dict(return_logprobs=True),
    "entropy": dict(return_entropy=True),
    "kept64": dict(return_kept=64),
    "rl_all": dict(return_logprobs=True, return_raw_logprobs=True, return_entropy=True,
                   return_kept=64),
}


def _topk_topp_with(**outputs):
  return lambda k, h, w, **_: fs.sample(h, w, k, backend=_BACKEND[0], top_k=TOP_K,
                                        top_p=TOP_P, **outputs)


# name -> (fused sampler, XLA baseline or None)
PROVIDERS = {
    "plain": (lambda k, h, w, **_: fs.sample(h, w, k, backend=_BACKEND[0]),
              lambda k, h, w, **_: jax.random.categorical(k, _logits(h, w))),
    "topk_topp": (lambda k, h, w, **_: fs.sample(h, w, k, backend=_BACKEND[0], top_k=TOP_K, top_p=TOP_P),
                  _xla_topk_topp),
    "topk_topp_xlabackend": (
        lambda k, h, w, **_: fs.sample(h, w, k, top_k=TOP_K, top_p=TOP_P, backend="xla"),
        _xla_sort_topp),
    # The RL outputs (issue #39) on top of top-k + top-p: fused only (their
    # cost is read against ``topk_topp`` of the same run).
    **{f"topk_topp_{name}": (_topk_topp_with(**kw), None) for name, kw in RL_OUTPUTS.items()},
    "logprobs": (lambda k, h, w, **_: fs.sample(h, w, k, backend=_BACKEND[0], return_logprobs=True),
                 _xla_logprobs),
    "bias_mask": (lambda k, h, w, bias, mask, **_: fs.sample(h, w, k, backend=_BACKEND[0], logit_bias=bias,
                                                         allowed_mask=mask),
                  _xla_bias_mask),
    "softcap": (lambda k, h, w, **_: fs.sample(h, w, k, backend=_BACKEND[0], softcap=SOFTCAP),
                lambda k, h, w, **_: jax.random.categorical(
                    k, SOFTCAP * jnp.tanh(_logits(h, w) / SOFTCAP))),
    "samples4": (lambda k, h, w, **_: fs.sample(h, w, k, backend=_BACKEND[0], num_samples=4),
                 lambda k, h, w, **_: jax.random.categorical(
                     k, _logits(h, w), shape=(4, h.shape[0]))),
    "top_logprobs20": (lambda k, h, w, **_: fs.sample(h, w, k, backend=_BACKEND[0],
                                                       top_logprobs=TOP_N),
                       _xla_top_logprobs),
    "penalties256": (lambda k, h, w, prompt, output, **_: fs.sample(
        h, w, k, backend=_BACKEND[0], prompt_ids=prompt, output_ids=output, **PENALTIES),
                     _xla_penalties),
}


def _fallback_rows(key, h, w, **outputs):
  """Rows of a top-k + top-p call that take the materialized path."""
  return exact_path_rows(h, w, key, backend=_BACKEND[0], top_k=TOP_K, top_p=TOP_P,
                         **outputs)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--smoke", action="store_true", help="tiny shape, for a CPU")
  ap.add_argument("--backend", default="auto", help="backend of the fused columns")
  ap.add_argument("--inner", type=int, default=None,
                  help="calls per timed block (default 50; 10 before 2026-11-26's "
                       "fourth session): long blocks measure a decode loop's "
                       "steady state, without the host latency of a sync")
  ap.add_argument("--providers", nargs="+", choices=list(PROVIDERS),
                  help="a subset of the controls (default: all; plain and "
                       "topk_topp are always timed, the table's ratios need them)")
  ap.add_argument("--batches", nargs="+", type=int, help="default 1 16 64 128 256")
  ap.add_argument("--shape", default="S", choices=sorted(HEADS),
                  help="the LM head (benchmarks.shapes.HEADS; default S, Qwen3-8B's)")
  ap.add_argument("--report", metavar="JSON",
                  help="only rewrite the table and plot of a saved run")
  args = ap.parse_args(argv)
  if args.report:
    return report_from_json(args.report)
  _BACKEND[0] = args.backend
  inner = args.inner or (3 if args.smoke else 50)
  providers = {k: v for k, v in PROVIDERS.items()
               if not args.providers or k in args.providers or k in ("plain", "topk_topp")}
  d, v = (256, 8192) if args.smoke else HEADS[args.shape]
  batches = args.batches or ((1, 16) if args.smoke else (1, 16, 64, 128, 256))
  reps = 3 if args.smoke else 15
  kw, kh, kb, km = jax.random.split(jax.random.key(0), 4)
  # Logits with std ~3, an LLM-like spread.
  w = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / d**0.5)).astype(jnp.bfloat16)
  bias = jax.random.normal(kb, (v,), jnp.float32)
  rows = []
  for b in batches:
    h = jax.random.normal(kh, (b, d), jnp.bfloat16)
    # About 3/4 of the ids allowed.
    mask = (jax.random.bits(km, (b, -(-v // 32)), jnp.uint32)
            | jax.random.bits(jax.random.fold_in(km, 1), (b, -(-v // 32)), jnp.uint32))
    key = jax.random.key(1)
    pick = lambda **kw: (args.backend if args.backend != "auto"
                         else fs.which_backend(h, w, key, **kw))
    row = dict(B=b, D=d, V=v, backend_plain=pick(),
               backend_controls=pick(top_k=TOP_K, top_p=TOP_P),
               fallback_rows=_fallback_rows(key, h, w))
    # Histories of random ids (the worst case: no weight row shared).
    prompt = jax.random.randint(jax.random.fold_in(km, 2), (b, HISTORY), 0, v)
    output = jax.random.randint(jax.random.fold_in(km, 3), (b, HISTORY), 0, v)
    extra = dict(bias=bias, mask=mask, prompt=prompt, output=output)
    # The cuBLAS dot alone (f32 logits written): what writing the logits
    # costs, the mark that fused sampling aims to stay under.
    row["dot_us"] = _timing.median_us(jax.jit(_logits), h, w, reps=reps, inner=inner)[0]
    for name, (fused, xla) in providers.items():
      f = jax.jit(lambda k, h, w, extra, f=fused: f(k, h, w, **extra))
      row[name + "_us"] = _timing.median_us(f, key, h, w, extra, reps=reps,
                                            inner=inner)[0]
      if xla is not None:
        g = jax.jit(lambda k, h, w, extra, g=xla: g(k, h, w, **extra))
        row["xla_" + name + "_us"] = _timing.median_us(g, key, h, w, extra,
                                                       reps=reps, inner=inner)[0]
    for name in ("topk_topp", "top_logprobs20", "penalties256"):
      if name + "_us" in row:
        row[name + "_over_plain"] = row[name + "_us"] / row["plain_us"]
    for name in RL_OUTPUTS:
      if f"topk_topp_{name}_us" in row:
        row[f"topk_topp_{name}_over_topk_topp"] = (row[f"topk_topp_{name}_us"]
                                                   / row["topk_topp_us"])
    if any(f"topk_topp_{name}" in providers for name in RL_OUTPUTS):
      # With the kept set asked for, top-p's edge shortcut is off.
      row["fallback_rows_logprobs"] = _fallback_rows(key, h, w, return_logprobs=True)
    row["speedup_vs_xla_topk"] = row["xla_topk_topp_us"] / row["topk_topp_us"]
    rows.append(row)
    print(json.dumps(row), flush=True)
  meta = dict(gpu=_timing.device_name(), jax=jax.__version__,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              top_k=TOP_K, top_p=TOP_P, softcap=SOFTCAP, inner=inner, reps=reps,
              backend=args.backend)
  os.makedirs(args.out, exist_ok=True)
  suffix = ("" if args.backend == "auto" else "_" + args.backend) + (
      "" if args.shape == "S" or args.smoke else "_" + args.shape)
  stem = os.path.join(args.out, "controls_" + _timing.slug(meta["gpu"]) + suffix)
  with open(stem + ".json", "w") as fh:
    json.dump(dict(meta, rows=rows), fh, indent=1)
  _report(stem, meta, rows)


def _report(stem, meta, rows):
  """``stem``.md (the table) and ``stem``.png (the plot) from the results."""
  r0 = rows[0]
  names = [k[:-3] for k in r0 if k.endswith("_us") and not k.startswith("xla_")]
  with open(stem + ".md", "w") as fh:
    fh.write(f"# Sampling controls on {meta['gpu']}\n\njax {meta['jax']}, {meta['date']}; "
             f"shape D={r0['D']} V={r0['V']} bf16, logits std ~3; top_k={meta['top_k']}, "
             f"top_p={meta['top_p']}, softcap={meta['softcap']}; median us over "
             f"{meta['reps']} blocks of {meta['inner']} async calls between host "
             f"syncs, fused (backend {meta.get('backend', 'auto')}) / XLA "
             "baseline that materializes the "
             "logits (speedup); dot: the cuBLAS dot alone, f32 logits written "
             "(runs before 2026-11-27's thirteenth session lack it).\n\n")
    ratios = [n for n in ("topk_topp", "top_logprobs20", "penalties256")
              if n + "_over_plain" in r0]
    rl = [n for n in RL_OUTPUTS if f"topk_topp_{n}_over_topk_topp" in r0]
    fh.write("| B | backend | fallback rows | " + " | ".join(names) + " | "
             + " | ".join(f"{n} / plain" for n in ratios)
             + "".join(f" | topk_topp_{n} / topk_topp" for n in rl) + " |\n")
    fh.write("|---" * (len(names) + len(ratios) + len(rl) + 3) + "|\n")
    for r in rows:
      cells = []
      for name in names:
        x = r.get("xla_" + name + "_us")
        cells.append(f"{r[name + '_us']:.0f}" if x is None else
                     f"{r[name + '_us']:.0f} / {x:.0f} ({x / r[name + '_us']:.2f}x)")
      fb = r["fallback_rows"]
      if "fallback_rows_logprobs" in r:        # "<token only> / <with logprobs>"
        fb = f"{fb} / {r['fallback_rows_logprobs']}"
      fh.write(f"| {r['B']} | {r['backend_controls']} | {fb} | "
               + " | ".join(cells) + " | "
               + " | ".join(f"{r[n + '_over_plain']:.3f}" for n in ratios)
               + "".join(f" | {r[f'topk_topp_{n}_over_topk_topp']:.3f}" for n in rl) + " |\n")
  print(open(stem + ".md").read())
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing: no plot")
    return
  bs = [r["B"] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  for name in names:
    line, = axes[0].plot(bs, [r[name + "_us"] for r in rows], "o-", label=name)
    if "xla_" + name + "_us" in r0:
      axes[0].plot(bs, [r["xla_" + name + "_us"] for r in rows], "x--",
                   color=line.get_color(), alpha=0.6)
  axes[0].set_ylabel("us (solid: fused; dashed: XLA baseline)")
  for n in ("topk_topp", "top_logprobs20", "penalties256"):
    if n + "_over_plain" in r0:
      axes[1].plot(bs, [r[n + "_over_plain"] for r in rows], "o-",
                   label=f"{n} / plain (fused)")
  axes[1].axhline(1.15, color="gray", ls=":", label="goal 1.15 (B <= 64)")
  axes[1].set_ylabel("ratio")
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("B")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(f"Sampling controls, {meta['gpu']}, jax {meta['jax']}, {meta['date']}")
  fig.tight_layout()
  fig.savefig(stem + ".png", dpi=110)


def report_from_json(path):
  """Rewrites the table and the plot of a saved run (``--report PATH``)."""
  with open(path) as fh:
    data = json.load(fh)
  rows = data.pop("rows")
  _report(os.path.splitext(path)[0], data, rows)


if __name__ == "__main__":
  main()
