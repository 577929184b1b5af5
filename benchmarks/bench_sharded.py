"""Vocabulary-parallel sampling benchmark: fused sharded sampler vs all-gather.

Shape L (Llama-3-70B head: D 8192, V 128256, bf16), B in {16, 64, 256},
the vocabulary sharded over TP = 1, 2, 4 GPUs (those that fit the GPUs
present). For every (TP, B), in one process and one run:

* ``fused``: ``flashsample_jax.sample_sharded`` (backend "auto"): each GPU
  samples its vocabulary shard, one all-gather of 8 bytes per row and GPU
  combines the candidates; no ``[B, V]`` logits anywhere;
* ``gather``: the baseline users run today: per-GPU f32 logits of the local
  shard, ``all_gather`` to ``[B, V]`` on every GPU, ``jax.random.categorical``;
* ``matmul``: the per-GPU local matmul ``[B, D] x [D, V/TP]`` alone (bf16 out,
  stays sharded): what a fused sharded sampler can approach (docs/design.md);
* ``exchange``: the candidate exchange alone: ``combine_over_axis`` of a
  ``[B]`` (score, id) per GPU, no matmul: the collective's latency.

Median wall time of many calls after warm-up (each call blocks until every
GPU is done). Goal per B: ``fused(TP=n) <= 1.2 * fused(TP=1) / n + 30 us``
and ``fused(TP=n) < gather(TP=n)``; the table and JSON say which hold.
Also records the share of rows where fused and gather drew the same token
(random inputs: >= 99.9% expected; rounding of the f32 sums may flip
near-ties) and the backend that ran on each shard.

Writes ``benchmarks/results/sharded_<gpu>_tp<list>.{json,md,png}`` with the
GPU, jax version and date.

  python3 -m benchmarks.bench_sharded            # GPUs: shape L, TP 1,2,4
  python3 -m benchmarks.bench_sharded --smoke    # CPU, 8 host devices, tiny
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"L": (8192, 128256), "S": (4096, 151936), "smoke": (256, 4096)}
BATCHES = (16, 64, 256)
TPS = (1, 2, 4)
SAMPLERS = ("fused", "gather", "matmul", "exchange")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny shape on 8 CPU host devices: checks the script runs")
  p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                 help="(D, V) by name; default L (--smoke: smoke)")
  p.add_argument("--batches", default=None, help="default 16,64,256 (smoke 4,16)")
  p.add_argument("--tp", default=None,
                 help="comma-separated TP degrees; default 1,2,4 (smoke 1,2,4,8); "
                 "degrees above the device count are skipped")
  p.add_argument("--iters", type=int, default=None, help="timed calls (default 100; smoke 5)")
  p.add_argument("--warmup", type=int, default=None, help="default 10; smoke 2")
  p.add_argument("--backend", default="auto", help="per-shard backend of the fused sampler")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
  p.add_argument("--no-plot", action="store_true")
  a = p.parse_args(argv)
  a.shape = a.shape or ("smoke" if a.smoke else "L")
  a.batches = [int(x) for x in (a.batches or ("4,16" if a.smoke else "16,64,256")).split(",")]
  a.tp = [int(x) for x in (a.tp or ("1,2,4,8" if a.smoke else "1,2,4")).split(",")]
  a.iters = a.iters or (5 if a.smoke else 100)
  a.warmup = a.warmup or (2 if a.smoke else 10)
  return a


if __name__ == "__main__" and "--smoke" in sys.argv[1:]:
  # Before jax is imported: 8 CPU devices stand in for 8 GPUs.
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import flashsample_jax as fs  # noqa: E402
from benchmarks import _timing  # noqa: E402


device_name = _timing.device_name
slug = _timing.slug


def median_us(f, args, iters: int, warmup: int) -> float:
  """Median per-call device time: blocks of 10 async calls (benchmarks/_timing.py).

  Timing each call with its own host sync would add the multi-device dispatch
  round trip (~0.2 ms on 4 GPUs) to every sample.
  """
  return _timing.median_us(f, *args, warmup=warmup, reps=max(3, iters // 10),
                           inner=10)[0]


def samplers(mesh, temperature: float, backend: str):
  """The three jitted functions ``(hidden, weight, key) -> out`` on ``mesh``."""
  t = jnp.float32(temperature)

  def fused(h, w, k):
    return fs.sample_sharded(h, w, k, mesh=mesh, vocab_axis="tp",
                             temperature=t, backend=backend)

  def gather(h, w, k):
    def local(h, w):
      l = jnp.dot(h, w.T, preferred_element_type=jnp.float32)   # [B, V/TP]
      return jax.lax.all_gather(l, "tp", axis=1, tiled=True, to="invarying")
    l = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("tp", None)),
                      out_specs=P())(h, w)                       # [B, V] everywhere
    return jax.random.categorical(k, l / t).astype(jnp.int32)

  def matmul(h, w, k):
    del k
    return jax.shard_map(lambda h, w: jnp.dot(h, w.T), mesh=mesh,
                         in_specs=(P(), P("tp", None)),
                         out_specs=P(None, "tp"))(h, w)

  def exchange(h, w, k):
    del w, k
    def local(h):
      score = h[:, 0].astype(jnp.float32)
      idx = jnp.full(score.shape, jax.lax.axis_index("tp"), jnp.int32)
      return fs.sharding.combine_over_axis(score, idx, "tp")[1]
    return jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P())(h)

  return {"fused": jax.jit(fused), "gather": jax.jit(gather),
          "matmul": jax.jit(matmul), "exchange": jax.jit(exchange)}


def resolved_backend(b, d, v_local, backend):
  """The backend ``auto`` picks for one shard's problem (no arrays made)."""
  picked = []

  def probe(h, w):
    picked.append(fs.which_backend(h, w, jax.random.key(0), backend=backend))
    return h

  jax.eval_shape(probe, jax.ShapeDtypeStruct((b, d), jnp.bfloat16),
                 jax.ShapeDtypeStruct((v_local, d), jnp.bfloat16))
  return picked[0]


def main(a) -> None:
  d, v = SHAPES[a.shape]
  devices = jax.devices()
  tps = [n for n in a.tp if n <= len(devices)]
  skipped = [n for n in a.tp if n > len(devices)]
  if skipped:
    print(f"skipping TP={skipped}: only {len(devices)} devices")
  for n in tps:
    if v % n:
      raise SystemExit(f"V={v} is not divisible by TP={n}")
  gpu = device_name()
  print(f"{gpu}, {len(devices)} device(s), jax {jax.__version__}, "
        f"shape {a.shape} (D={d}, V={v}), bf16")
  rng = np.random.default_rng(0)
  w_host = (rng.standard_normal((v, d), np.float32) * (3.0 / np.sqrt(d))).astype(jnp.bfloat16)
  records = []
  for n in tps:
    mesh = Mesh(np.array(devices[:n]), ("tp",), axis_types=(AxisType.Auto,))
    w = jax.device_put(w_host, NamedSharding(mesh, P("tp", None)))
    fns = samplers(mesh, a.temperature, a.backend)
    for b in a.batches:
      h = jax.device_put(rng.standard_normal((b, d), np.float32).astype(jnp.bfloat16),
                         NamedSharding(mesh, P()))
      key = jax.random.key(b)
      rec = {"tp": n, "batch": b, "backend": resolved_backend(b, d, v // n, a.backend)}
      for name in SAMPLERS:
        rec[f"{name}_us"] = median_us(fns[name], (h, w, key), a.iters, a.warmup)
      tok_f = np.asarray(fns["fused"](h, w, key))
      tok_g = np.asarray(fns["gather"](h, w, key))
      rec["same_tokens"] = float((tok_f == tok_g).mean())
      records.append(rec)
      print(f"TP={n} B={b:4d} [{rec['backend']}]  fused {rec['fused_us']:9.1f} us  "
            f"gather {rec['gather_us']:9.1f} us  matmul {rec['matmul_us']:9.1f} us  "
            f"exchange {rec['exchange_us']:7.1f} us  "
            f"same tokens {rec['same_tokens']:.4f}")
    del w
  for rec in records:
    one = next((r for r in records if r["tp"] == 1 and r["batch"] == rec["batch"]), None)
    rec["goal_us"] = (1.2 * one["fused_us"] / rec["tp"] + 30.0) if one else None
    rec["meets_scaling_goal"] = (rec["fused_us"] <= rec["goal_us"]) if one else None
    rec["faster_than_gather"] = rec["fused_us"] < rec["gather_us"]
    rec["speedup_vs_gather"] = rec["gather_us"] / rec["fused_us"]

  meta = {
      "benchmark": "bench_sharded", "gpu": gpu, "device_count": len(devices),
      "platform": devices[0].platform, "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "shape": a.shape, "D": d, "V": v, "dtype": "bfloat16",
      "temperature": a.temperature, "iters": a.iters, "warmup": a.warmup,
      "requested_backend": a.backend, "smoke": a.smoke,
      "goal": "fused(TP=n) <= 1.2 * fused(TP=1) / n + 30 us, and < gather(TP=n)",
  }
  a.out.mkdir(parents=True, exist_ok=True)
  stem = a.out / (f"sharded_{slug(gpu)}{'-smoke' if a.smoke else ''}_{a.shape}"
                  f"_tp{'-'.join(map(str, tps))}")
  stem.with_suffix(".json").write_text(
      json.dumps({"meta": meta, "results": records}, indent=2) + "\n")
  md = markdown(meta, records)
  stem.with_suffix(".md").write_text(md)
  print(md)
  if not a.no_plot:
    plot(meta, records, stem.with_suffix(".png"))
  print(f"wrote {stem}.json, .md" + ("" if a.no_plot else ", .png"))


def markdown(meta, records) -> str:
  lines = [
      f"# Vocabulary-parallel sampling, shape {meta['shape']} "
      f"(D {meta['D']}, V {meta['V']}, bf16)", "",
      f"{meta['gpu']} x {meta['device_count']}, jax {meta['jax_version']}, "
      f"{meta['date']}; median per call over blocks of 10 async calls ({meta["iters"]} calls), microseconds.", "",
      f"Goal: {meta['goal']}.", "",
      "| TP | B | backend | fused | gather + categorical | local matmul | "
      "exchange alone | speedup vs gather | goal | meets goal | same tokens |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in records:
    goal = f"{r['goal_us']:.1f}" if r["goal_us"] is not None else "-"
    ok = {True: "yes", False: "no", None: "-"}[r["meets_scaling_goal"]]
    lines.append(
        f"| {r['tp']} | {r['batch']} | {r['backend']} | {r['fused_us']:.1f} | "
        f"{r['gather_us']:.1f} | {r['matmul_us']:.1f} | {r['exchange_us']:.1f} | "
        f"{r['speedup_vs_gather']:.2f}x | {goal} | {ok} | {r['same_tokens']:.4f} |")
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
    ax.set_xscale("log", base=2)
    ax.set_xticks(tp, [str(x) for x in tp])
    ax.set_xlabel("TP (vocabulary shards)")
    ax.set_ylabel("median time (us)")
    ax.set_title(f"B = {b}")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"{meta['gpu']}, shape {meta['shape']} (D {meta['D']}, V {meta['V']}), "
               f"jax {meta['jax_version']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main(parse_args())
