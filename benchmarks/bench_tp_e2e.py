"""End-to-end decode with the LM head sharded over the vocabulary on 1, 2 and 4 GPUs.

A 32B-class decoder (Qwen2.5-32B's sizes: D 5120, 40/8 heads, F 27648,
V 152064; Qwen3-style blocks) with 4 of its 64 layers, so that the LM head is
a large share of the step, decoding with a generation config (default
``qwen3``: T 0.6, top-k 20, top-p 0.95). Only the LM head is sharded (its
``[D, V]`` kernel split over the vocabulary on mesh axis "tp"); embedding,
layers and KV cache are replicated, and every GPU runs the whole decoder
(examples/_model.Decoding with ``mesh``). That keeps the model simple and
isolates what the sampler does with a sharded head:

* ``fused``: ``flashsample_jax.sample(..., vocab_axis="tp")`` on each GPU's
  slice of the head: candidates of O(B) bytes are exchanged, never logits;
* ``xla``: each GPU's f32 logits of its slice, ``lax.all_gather`` to
  ``[B, V]`` on every GPU, then the generation config's baseline
  (examples/_model.baseline_tokens: ``lax.top_k``, top-p on the k,
  categorical over the k for ``qwen3``).

TPOT = wall time of N back-to-back decode steps / N, median over repeats,
samplers interleaved; beside it the per-GPU weight-read floor (the layers
plus ``1 / TP`` of the head) and token agreement as in benchmarks/bench_e2e.py.
Writes ``benchmarks/results/tp_e2e_<gpu>.{json,md,png}``.

  python3 -m benchmarks.bench_tp_e2e                 # 4 GPUs: TP 1, 2, 4
  python3 -m benchmarks.bench_tp_e2e --smoke         # CPU, 4 host devices, tiny
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE_DEVICES = 4

if __name__ == "__main__" and "--smoke" in sys.argv[1:]:
  # Before jax is imported: CPU devices stand in for GPUs.
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={SMOKE_DEVICES}").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

from benchmarks import _timing, bench_e2e  # noqa: E402
from examples import _model  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help=f"tiny config on {SMOKE_DEVICES} CPU host devices: checks the script runs")
  p.add_argument("--config", default=None, choices=sorted(_model.CONFIGS),
                 help="an untied model config; default 32b-4l (--smoke: tiny-tp)")
  p.add_argument("--generation-config", default="qwen3",
                 choices=sorted(_model.GENERATION_CONFIGS))
  p.add_argument("--tp", default="1,2,4",
                 help="comma-separated TP degrees; those above the device count are skipped")
  p.add_argument("--batches", default=None, help="default 1,16,64,256 (smoke 2)")
  bench_e2e.add_decode_args(p, point="(TP, B) point")
  a = p.parse_args(argv)
  a.config = a.config or ("tiny-tp" if a.smoke else "32b-4l")
  if _model.CONFIGS[a.config].tied:
    p.error(f"--config {a.config} has a tied head; the sharded head must be an untied one")
  a.tp = [int(x) for x in a.tp.split(",")]
  a.batches = [int(x) for x in (a.batches or ("2" if a.smoke else "1,16,64,256")).split(",")]
  if min(a.batches) < 1 or min(a.tp) < 1:
    p.error(f"--batches={a.batches} and --tp={a.tp} must be >= 1")
  bench_e2e.check_decode_args(p, a, smoke_tokens=3, smoke_prompt_len=4, gpu_compile_threads=2)
  return a


def bench(a, on_point=None) -> dict:
  t_start = time.perf_counter()
  cfg, gen = _model.CONFIGS[a.config], _model.GENERATION_CONFIGS[a.generation_config]
  devices = jax.devices()
  tps = [n for n in a.tp if n <= len(devices) and cfg.vocab % n == 0]
  skipped = sorted(set(a.tp) - set(tps))
  if skipped:
    print(f"skipping TP={skipped}: {len(devices)} devices, V={cfg.vocab}")
  bandwidth = a.bandwidth or bench_e2e.measure_bandwidth()
  gpu = _timing.device_name()
  res = dict(
      benchmark="tp_e2e_decode", gpu=gpu, device_count=len(devices),
      jax_version=jax.__version__, backend=jax.default_backend(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      config=cfg.name, layers=cfg.layers, dim=cfg.dim, vocab=cfg.vocab,
      params=cfg.params, generation=gen.name, baseline=gen.describe_baseline(),
      tokens=a.tokens, prompt_len=a.prompt_len, repeats=a.repeats, attention=a.attention,
      requested_backend=a.backend, read_bandwidth_Bps=bandwidth,
      sharding="LM head split over the vocabulary; embedding, layers, KV cache replicated",
      smoke=a.smoke, complete=False, rows=[])
  graphdef, state = _model.init(cfg, logit_std=a.logit_std)
  jax.block_until_ready(state)
  stopped = False
  for n in tps:
    mesh = Mesh(np.array(devices[:n]), (_model.VOCAB_AXIS,), axis_types=(AxisType.Explicit,))
    placed = _model.place_state(cfg, state, mesh)
    floor_ms = _model.weight_read_floor_ms(cfg, bandwidth, vocab_shards=n)
    for b in a.batches:
      if a.budget_s is not None and time.perf_counter() - t_start > a.budget_s:
        print(f"time budget of {a.budget_s:.0f} s spent: skipping TP={n} B={b} and later")
        stopped = True
        break
      decs = {s: _model.Decoding(cfg, graphdef, placed, batch=b, tokens=a.tokens,
                                 prompt_len=a.prompt_len, sampler=s, generation=gen,
                                 backend=a.backend, attention=a.attention, mesh=mesh)
              for s in _model.SAMPLERS[::-1]}
      bench_e2e.compile_all(list(decs.values()), a.compile_threads)
      runs = {s: [] for s in _model.SAMPLERS}
      for r in range(a.repeats):
        for s in _model.SAMPLERS:  # interleaved, so drift hits both alike
          runs[s].append(decs[s].run(seed=r))
      same_rows = float(np.mean([np.all(f.tokens == x.tokens, axis=1).mean()
                                 for f, x in zip(runs["fused"], runs["xla"])]))
      same_first = bench_e2e.first_token_agreement(runs, graphdef, state, gen, a.prompt_len)
      for s in _model.SAMPLERS:
        tpots = [r.tpot_ms for r in runs[s]]
        tpot = statistics.median(tpots)
        res["rows"].append(dict(
            tp=n, batch=b, sampler=s,
            fused_backend=(_model.fused_backend(cfg, b, a.backend, vocab_shards=n,
                                                generation=gen) if s == "fused" else None),
            tpot_ms=tpot, tpot_ms_runs=tpots, tokens_per_s=b / (tpot / 1e3),
            floor_ms=floor_ms, tpot_over_floor=tpot / floor_ms,
            compile_s=decs[s].compile_s, same_tokens_rows=same_rows,
            same_first_token_rows=same_first))
      f, x = res["rows"][-2:]
      print(f"TP={n} B={b:4d}: fused {f['tpot_ms']:.3f} ms, xla {x['tpot_ms']:.3f} ms "
            f"({x['tpot_ms'] / f['tpot_ms']:.3f}x), floor {floor_ms:.3f} ms, same first "
            f"token {100 * same_first:.1f}%", flush=True)
      if on_point:
        on_point(res)
      del decs
    _model.forget_programs()
    del placed
    if stopped:
      break
  res["complete"] = not stopped
  res["wall_s"] = time.perf_counter() - t_start
  return res


def markdown(res: dict) -> str:
  lines = [
      f"# Vocabulary-parallel LM head, end to end: {res['config']} "
      f"(D {res['dim']}, V {res['vocab']}, {res['layers']} layers)", "",
      f"{res['gpu']} x {res['device_count']}, jax {res['jax_version']}, {res['date']}. "
      f"{res['sharding']}. Generation config {res['generation']}; xla baseline: logits "
      f"all-gathered over the vocabulary, then {res['baseline']}. Prompt "
      f"{res['prompt_len']}, N={res['tokens']} tokens, median of {res['repeats']} runs. "
      f"Floor: one GPU's weights (layers + 1/TP of the head) at "
      f"{res['read_bandwidth_Bps'] / 1e12:.2f} TB/s."
      + ("" if res.get("complete", True) else " **Stopped early by its time budget.**"), "",
      "| TP | B | fused backend | fused TPOT ms | xla TPOT ms | speedup | floor ms | "
      "fused / floor | same tokens | same first token |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  by = {(r["tp"], r["batch"], r["sampler"]): r for r in res["rows"]}
  for (n, b, s), f in by.items():
    if s != "fused" or (n, b, "xla") not in by:
      continue
    x = by[(n, b, "xla")]
    lines.append(
        f"| {n} | {b} | {f['fused_backend']} | {f['tpot_ms']:.3f} | {x['tpot_ms']:.3f} | "
        f"{x['tpot_ms'] / f['tpot_ms']:.3f}x | {f['floor_ms']:.3f} | "
        f"{f['tpot_over_floor']:.2f} | {100 * f['same_tokens_rows']:.1f}% | "
        f"{100 * f['same_first_token_rows']:.1f}% |")
  return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  batches = sorted({r["batch"] for r in res["rows"]})
  if not batches:
    return
  fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
  for ax, b in zip(axes[0], batches):
    for s, style in (("fused", "o-"), ("xla", "s--")):
      rs = sorted((r for r in res["rows"] if r["batch"] == b and r["sampler"] == s),
                  key=lambda r: r["tp"])
      ax.plot([r["tp"] for r in rs], [r["tpot_ms"] for r in rs], style,
              label="fused" if s == "fused" else "all-gather + baseline")
    rs = sorted((r for r in res["rows"] if r["batch"] == b and r["sampler"] == "fused"),
                key=lambda r: r["tp"])
    tp = [r["tp"] for r in rs]
    ax.plot(tp, [r["floor_ms"] for r in rs], "k:", lw=1, label="weight-read floor")
    _timing.pow2_axis(ax, tp, "TP (vocabulary shards of the head)",
                      "time per output token (ms)", f"B = {b}")
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"{res['config']}, {res['generation']} config, {res['gpu']}, "
               f"jax {res['jax_version']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  a = parse_args(argv)
  stem = f"tp_e2e_{a.name or _timing.slug(_timing.device_name())}" + ("-smoke" if a.smoke else "")
  _timing.run_and_write(bench, a, stem, markdown=markdown, plot=plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())
