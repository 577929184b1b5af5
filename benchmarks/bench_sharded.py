"""Vocabulary-parallel sampling inside a jitted decode loop: fused vs all-gather.

Shape L (Llama-3-70B head: D 8192, V 128256, bf16), B in {16, 64, 256},
the vocabulary sharded over TP = 1, 2, 4 GPUs (those that fit the GPUs
present). Each sampler runs ``--steps`` sampling steps in one jitted
``lax.fori_loop`` inside one ``shard_map`` over the TP mesh, as it would
inside a model's decode step: the multi-device program is launched once per
loop, not once per sample (timing single calls measures the host's launch of
a multi-GPU program at small B, not the sampler). Each step's hidden states
depend on the previous step's tokens, so XLA cannot hoist the matmul out of
the loop. Per (TP, B), in one process and one run:

* ``fused``: ``flashsample_jax.sample(..., vocab_axis="tp")`` on each GPU's
  vocabulary shard: one all-gather of 8 bytes per row and GPU combines the
  candidates; no ``[B, V]`` logits anywhere;
* ``gather``: the baseline users write today: per-GPU f32 logits of the local
  shard, ``lax.all_gather`` to ``[B, V]`` on every GPU, ``jax.random.categorical``;
* ``matmul``: the per-GPU local matmul ``[B, D] x [D, V/TP]`` alone (bf16
  out, stays sharded): what a fused sharded sampler can approach
  (docs/design.md);
* ``exchange``: the candidate exchange alone (``combine_over_axis`` of a
  ``[B]`` (score, id) per GPU, no matmul): the collective's latency.

Reported per step: the median over blocks of loop calls, divided by the
steps. Goal per B: ``fused(TP=n) <= 1.2 * fused(TP=1) / n + 30 us`` and
``fused(TP=n) < gather(TP=n)``; the table and JSON say which hold. Also the
share of rows whose tokens over all steps are the same for fused and gather
(same keys; random inputs: rounding of the f32 sums may flip a near-tie,
after which that row's later steps differ too) and the backend of each shard.

Writes ``benchmarks/results/sharded_<gpu>_<shape>_tp<list>.{json,md,png}``
with the GPU, jax version and date.

  python3 -m benchmarks.bench_sharded            # GPUs: shape L, TP 1,2,4
  python3 -m benchmarks.bench_sharded --smoke    # CPU, 4 host devices, tiny
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BATCHES = (16, 64, 256)
TPS = (1, 2, 4)
SAMPLERS = ("fused", "gather", "matmul", "exchange")
SMOKE_DEVICES = 4


def parse_args(argv=None):
  from benchmarks.shapes import HEADS
  shapes = {**HEADS, "smoke": (256, 4096)}
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help=f"tiny shape on {SMOKE_DEVICES} CPU host devices: checks the script runs")
  p.add_argument("--shape", default=None, choices=sorted(shapes),
                 help="(D, V) by name (benchmarks/shapes.py); default L (--smoke: smoke)")
  p.add_argument("--batches", default=None, help="default 16,64,256 (smoke 4,16)")
  p.add_argument("--tp", default=None,
                 help="comma-separated TP degrees; default 1,2,4; degrees above the "
                 "device count are skipped")
  p.add_argument("--steps", type=int, default=None,
                 help="sampling steps per jitted loop (default 32; smoke 4)")
  p.add_argument("--reps", type=int, default=None,
                 help="timed blocks of 2 loop calls (default 10; smoke 2)")
  p.add_argument("--warmup", type=int, default=None, help="loop calls first (default 2; smoke 1)")
  p.add_argument("--backend", default="auto", help="per-shard backend of the fused sampler")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
  p.add_argument("--no-plot", action="store_true")
  a = p.parse_args(argv)
  a.shape = a.shape or ("smoke" if a.smoke else "L")
  a.d, a.v = shapes[a.shape]
  a.batches = [int(x) for x in (a.batches or ("4,16" if a.smoke else "16,64,256")).split(",")]
  a.tp = [int(x) for x in (a.tp or "1,2,4").split(",")]
  a.steps = a.steps or (4 if a.smoke else 32)
  a.reps = a.reps or (2 if a.smoke else 10)
  a.warmup = a.warmup or (1 if a.smoke else 2)
  if not a.temperature > 0:
    p.error(f"--temperature={a.temperature} must be > 0")
  for name in ("steps", "reps", "warmup"):
    if getattr(a, name) < 1:
      p.error(f"--{name}={getattr(a, name)} must be >= 1")
  if min(a.batches) < 1 or min(a.tp) < 1:
    p.error(f"--batches={a.batches} and --tp={a.tp} must be >= 1")
  return a


if __name__ == "__main__" and "--smoke" in sys.argv[1:]:
  # Before jax is imported: CPU devices stand in for GPUs.
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={SMOKE_DEVICES}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import flashsample_jax as fs  # noqa: E402
from benchmarks import _timing  # noqa: E402

device_name = _timing.device_name
slug = _timing.slug
AXIS = "tp"


def step_fns(temperature: float, backend: str):
  """Per-shard ``(h [B, D], w [V/TP, D], key) -> tokens [B]`` of each sampler."""
  t = jnp.float32(temperature)

  def fused(h, w, k):
    return fs.sample(h, w, k, vocab_axis=AXIS, temperature=t, backend=backend)

  def gather(h, w, k):
    l = jnp.dot(h, w.T, preferred_element_type=jnp.float32)     # [B, V/TP]
    l = lax.all_gather(l, AXIS, axis=1, tiled=True)              # [B, V] on every GPU
    return jax.random.categorical(k, l / t).astype(jnp.int32)

  def matmul(h, w, k):
    del k
    # The barrier keeps XLA from computing only the column read below.
    out = lax.optimization_barrier(jnp.dot(h, w.T))             # [B, V/TP] bf16, local
    return (out[:, 0] > 0).astype(jnp.int32)

  def exchange(h, w, k):
    del w, k
    score = h[:, 0].astype(jnp.float32)
    idx = jnp.full(score.shape, lax.axis_index(AXIS), jnp.int32)
    return fs.sharding.combine_over_axis(score, idx, AXIS)[1]

  return {"fused": fused, "gather": gather, "matmul": matmul, "exchange": exchange}


def looped(step, mesh, steps: int):
  """``steps`` calls of ``step`` in one jitted loop on ``mesh``: tokens ``[steps, B]``.

  The next step's hidden states are this step's plus a bump where the token is
  odd: the matmul cannot move out of the loop, and it costs one small
  elementwise pass over ``[B, D]``, the same for every sampler.
  check_vma=False: a kernel's outputs carry no variance typing (see
  flashsample_jax.sharding); the fused and gather tokens are the same on every
  shard by construction.
  """
  def body(h, w, key):
    bump = jnp.asarray(2.0 ** -6, h.dtype)

    def one(i, carry):
      h, toks = carry
      tok = step(h, w, jax.random.fold_in(key, i))
      h = h + bump * (tok % 2).astype(h.dtype)[:, None]
      return h, toks.at[i].set(tok)
    return lax.fori_loop(0, steps, one, (h, jnp.zeros((steps, h.shape[0]), jnp.int32)))[1]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS, None), P()),
                               out_specs=P(), check_vma=False))


def resolved_backend(b, d, v_local, backend, temperature):
  """The backend ``auto`` picks for one shard's problem (no arrays made)."""
  picked = []

  def probe(h, w):
    picked.append(fs.which_backend(h, w, jax.random.key(0), backend=backend,
                                   temperature=temperature))
    return h

  jax.eval_shape(probe, jax.ShapeDtypeStruct((b, d), jnp.bfloat16),
                 jax.ShapeDtypeStruct((v_local, d), jnp.bfloat16))
  return picked[0]


def per_step_us(f, args, a) -> float:
  """Median microseconds per step: blocks of 2 loop calls (benchmarks/_timing.py)."""
  return _timing.median_us(f, *args, warmup=a.warmup, reps=a.reps, inner=2)[0] / a.steps


def main(a) -> None:
  d, v = a.d, a.v
  devices = jax.devices()
  tps = [n for n in a.tp if n <= len(devices)]
  skipped = [n for n in a.tp if n > len(devices)]
  if skipped:
    print(f"skipping TP={skipped}: only {len(devices)} devices")
  for n in tps:
    if v % n:
      raise SystemExit(f"V={v} is not divisible by TP={n}")
  gpu = device_name()
  print(f"{gpu}, {len(devices)} device(s), jax {jax.__version__}, shape {a.shape} "
        f"(D={d}, V={v}), bf16, {a.steps} steps per loop")
  meta = {
      "benchmark": "bench_sharded", "gpu": gpu, "device_count": len(devices),
      "platform": devices[0].platform, "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "shape": a.shape, "D": d, "V": v, "dtype": "bfloat16",
      "temperature": a.temperature, "steps": a.steps, "reps": a.reps, "warmup": a.warmup,
      "timing": "per step: median over blocks of 2 calls of a jitted loop of `steps` steps",
      "requested_backend": a.backend, "smoke": a.smoke,
      "goal": "fused(TP=n) <= 1.2 * fused(TP=1) / n + 30 us, and < gather(TP=n)",
  }
  fns = step_fns(a.temperature, a.backend)
  records = []
  for n in tps:
    mesh = Mesh(np.array(devices[:n]), (AXIS,), axis_types=(AxisType.Explicit,))
    # Made on the devices, the same values for every TP (partitionable threefry).
    w = jax.jit(lambda k: (jax.random.normal(k, (v, d), jnp.float32)
                           * (3.0 / np.sqrt(d))).astype(jnp.bfloat16),
                out_shardings=NamedSharding(mesh, P(AXIS, None)))(jax.random.key(0))
    loops = {name: looped(fns[name], mesh, a.steps) for name in SAMPLERS}
    for b in a.batches:
      h = jax.device_put(jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16),
                         NamedSharding(mesh, P()))
      key = jax.device_put(jax.random.key(b + 1), NamedSharding(mesh, P()))
      rec = {"tp": n, "batch": b, "steps": a.steps,
             "backend": resolved_backend(b, d, v // n, a.backend, a.temperature)}
      for name in SAMPLERS:
        rec[f"{name}_us"] = per_step_us(loops[name], (h, w, key), a)
      tok_f = np.asarray(loops["fused"](h, w, key))
      tok_g = np.asarray(loops["gather"](h, w, key))
      rec["same_tokens"] = float((tok_f == tok_g).mean())
      rec["same_rows"] = float((tok_f == tok_g).all(axis=0).mean())
      records.append(rec)
      print(f"TP={n} B={b:4d} [{rec['backend']}] per step: fused {rec['fused_us']:8.1f} us  "
            f"gather {rec['gather_us']:8.1f} us  matmul {rec['matmul_us']:8.1f} us  "
            f"exchange {rec['exchange_us']:6.1f} us  same rows {rec['same_rows']:.4f}",
            flush=True)
      write(a, meta, records, tps, final=False)
    del w, loops
  write(a, meta, records, tps, final=True)


def summarize(records) -> None:
  """The goal and speedup fields of each record (TP=1 of the same B is the base)."""
  for rec in records:
    one = next((r for r in records if r["tp"] == 1 and r["batch"] == rec["batch"]), None)
    rec["goal_us"] = (1.2 * one["fused_us"] / rec["tp"] + 30.0) if one else None
    rec["meets_scaling_goal"] = (rec["fused_us"] <= rec["goal_us"]) if one else None
    rec["faster_than_gather"] = rec["fused_us"] < rec["gather_us"]
    rec["speedup_vs_gather"] = rec["gather_us"] / rec["fused_us"]


def write(a, meta, records, tps, final: bool) -> None:
  """JSON and Markdown (and the plot when ``final``), also after every point,
  so that a run stopped by a time limit keeps what it measured."""
  summarize(records)
  a.out.mkdir(parents=True, exist_ok=True)
  stem = a.out / (f"sharded_{slug(meta['gpu'])}{'-smoke' if a.smoke else ''}_{a.shape}"
                  f"_tp{'-'.join(map(str, tps))}")
  stem.with_suffix(".json").write_text(
      json.dumps({"meta": {**meta, "complete": final}, "results": records}, indent=2) + "\n")
  md = markdown(meta, records)
  stem.with_suffix(".md").write_text(md)
  if final:
    print(md)
    if not a.no_plot:
      plot(meta, records, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md" + ("" if a.no_plot else ", .png"))


def markdown(meta, records) -> str:
  lines = [
      f"# Vocabulary-parallel sampling in a decode loop, shape {meta['shape']} "
      f"(D {meta['D']}, V {meta['V']}, bf16)", "",
      f"{meta['gpu']} x {meta['device_count']}, jax {meta['jax_version']}, {meta['date']}; "
      f"microseconds per sampling step inside a jitted loop of {meta['steps']} steps in "
      f"one shard_map (median over {meta['reps']} blocks of 2 loop calls), temperature "
      f"{meta['temperature']}.", "",
      f"Goal: {meta['goal']}.", "",
      "| TP | B | backend | fused | gather + categorical | local matmul | "
      "exchange alone | speedup vs gather | goal | meets goal | same rows |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in records:
    goal = f"{r['goal_us']:.1f}" if r["goal_us"] is not None else "-"
    ok = {True: "yes", False: "no", None: "-"}[r["meets_scaling_goal"]]
    lines.append(
        f"| {r['tp']} | {r['batch']} | {r['backend']} | {r['fused_us']:.1f} | "
        f"{r['gather_us']:.1f} | {r['matmul_us']:.1f} | {r['exchange_us']:.1f} | "
        f"{r['speedup_vs_gather']:.2f}x | {goal} | {ok} | {r['same_rows']:.4f} |")
  return "\n".join(lines) + "\n"


def plot(meta, records, path) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  batches = sorted({r["batch"] for r in records})
  fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4), squeeze=False)
  for ax, b in zip(axes[0], batches):
    rs = sorted((r for r in records if r["batch"] == b), key=lambda r: r["tp"])
    tp = [r["tp"] for r in rs]
    ax.plot(tp, [r["fused_us"] for r in rs], "o-", label="fused sharded sampler")
    ax.plot(tp, [r["gather_us"] for r in rs], "s-", label="all-gather logits + categorical")
    ax.plot(tp, [r["matmul_us"] for r in rs], "^:", label="local matmul only")
    if rs[0]["goal_us"] is not None:
      ax.plot(tp, [r["goal_us"] for r in rs], "k--", lw=1, label="goal 1.2 t1/n + 30 us")
    _timing.pow2_axis(ax, tp, "TP (vocabulary shards)", "us per step, in a loop", f"B = {b}")
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"{meta['gpu']}, shape {meta['shape']} (D {meta['D']}, V {meta['V']}), "
               f"jax {meta['jax_version']}, {meta['steps']}-step loop", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main(parse_args())
