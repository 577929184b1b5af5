"""End-to-end decode benchmark: time per output token, fused sampler vs XLA.

For each model config and batch size B, decodes N tokens with the Qwen3-style
model of examples/_model.py (random bf16 weights made on the device) twice
per repeat, once per sampler, in the same process:

* ``fused``: ``flashsample_jax.sample`` (backend "auto") from the LM head as
  stored, no ``[B, V]`` logits;
* ``xla``: f32 logits ``hidden @ W.T`` then ``jax.random.categorical``
  (the baseline of docs/design.md, "Performance").

TPOT = wall time of N back-to-back decode steps / N (the whole batch gets one
token per step), median over repeats, samplers interleaved. Also records
whether both samplers drew the same token sequences (same keys).

Writes ``benchmarks/results/e2e_<gpu>.{json,md,png}`` with the GPU name, jax
version and date.

  python3 -m benchmarks.bench_e2e                 # GPU: qwen3-1.7b, qwen3-8b
  python3 -m benchmarks.bench_e2e --smoke         # CPU: tiny config, seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks import _timing  # noqa: E402
from examples import _model  # noqa: E402

BATCHES = (1, 4, 16, 64)
GPU_CONFIGS = ("qwen3-1.7b", "qwen3-8b")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny config, few tokens: a CPU check that the script works")
  p.add_argument("--configs", default=None,
                 help=f"comma-separated, from {sorted(_model.CONFIGS)}; default "
                 f"{','.join(GPU_CONFIGS)} (--smoke: tiny)")
  p.add_argument("--batches", default=",".join(map(str, BATCHES)))
  p.add_argument("--tokens", type=int, default=None, help="N per run (default 64; smoke 8)")
  p.add_argument("--prompt-len", type=int, default=None, help="default 64; smoke 8")
  p.add_argument("--repeats", type=int, default=None, help="runs per sampler (default 3; smoke 2)")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--backend", default="auto",
                 help="flashsample_jax backend of the fused sampler (auto, mosaic, xla)")
  p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
  p.add_argument("--name", default=None, help="file stem suffix (default: the device)")
  a = p.parse_args(argv)
  a.configs = (a.configs or ("tiny" if a.smoke else ",".join(GPU_CONFIGS))).split(",")
  for c in a.configs:
    if c not in _model.CONFIGS:
      p.error(f"unknown config {c!r}; choose from {sorted(_model.CONFIGS)}")
  a.batches = [int(b) for b in a.batches.split(",")]
  a.tokens = a.tokens or (8 if a.smoke else 64)
  a.prompt_len = a.prompt_len or (8 if a.smoke else 64)
  a.repeats = a.repeats or (2 if a.smoke else 3)
  return a


device_name = _timing.device_name
slug = _timing.slug


def bench(args) -> dict:
  rows = []
  total = len(args.configs) * len(args.batches)
  bar = tqdm(total=total * len(_model.SAMPLERS) * args.repeats, desc="e2e", unit="run")
  for cfg_name in args.configs:
    cfg = _model.CONFIGS[cfg_name]
    bar.set_postfix_str(f"{cfg_name}: init")
    graphdef, state = _model.init(cfg)
    jax.block_until_ready(state)
    for b in args.batches:
      decs = {}
      for name in _model.SAMPLERS:
        bar.set_postfix_str(f"{cfg_name} B={b}: compile {name}")
        decs[name] = _model.Decoding(cfg, graphdef, state, batch=b, tokens=args.tokens,
                                     prompt_len=args.prompt_len, sampler=name,
                                     backend=args.backend)
      runs = {name: [] for name in _model.SAMPLERS}
      for r in range(args.repeats):
        for name, dec in decs.items():  # interleaved, so drift hits both alike
          bar.set_postfix_str(f"{cfg_name} B={b}: {name} #{r}")
          runs[name].append(dec.run(seed=r, temperature=args.temperature))
          bar.update()
      # Same seed, same keys: the samplers should draw the same tokens (rows
      # may differ where bf16 rounding of two matmuls flips a near-tie).
      same_rows = np.mean([
          np.all(f.tokens == x.tokens, axis=1).mean()
          for f, x in zip(runs["fused"], runs["xla"])])
      for name in _model.SAMPLERS:
        tpots = [r.tpot_ms for r in runs[name]]
        rows.append(dict(
            config=cfg_name, params=cfg.params, dim=cfg.dim, vocab=cfg.vocab,
            tied=cfg.tied, batch=b, sampler=name,
            fused_backend=_model.fused_backend(cfg, b, args.backend) if name == "fused" else None,
            tpot_ms=statistics.median(tpots), tpot_ms_runs=tpots,
            tokens_per_s=b / (statistics.median(tpots) / 1e3),
            prefill_ms=statistics.median(1e3 * r.prefill_s for r in runs[name]),
            compile_s=decs[name].compile_s, same_tokens_rows=float(same_rows)))
      del decs
    del state
  bar.close()
  gpu = device_name()
  return dict(
      benchmark="e2e_decode", gpu=gpu, device_count=jax.device_count(),
      jax_version=jax.__version__, backend=jax.default_backend(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      tokens=args.tokens, prompt_len=args.prompt_len, repeats=args.repeats,
      temperature=args.temperature, dtype="bfloat16", samplers=list(_model.SAMPLERS),
      rows=rows)


def markdown(res: dict) -> str:
  lines = [
      "# End-to-end decode: time per output token (TPOT)",
      "",
      f"{res['gpu']}, jax {res['jax_version']}, {res['date']}. Random bf16 weights, "
      f"prompt {res['prompt_len']}, N={res['tokens']} tokens, median of "
      f"{res['repeats']} runs. fused = flashsample_jax.sample (auto); xla = f32 logits + "
      "jax.random.categorical.",
      "",
      "| config | B | fused backend | fused TPOT ms | xla TPOT ms | speedup | fused tokens/s | xla tokens/s | same tokens |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  by = {(r["config"], r["batch"], r["sampler"]): r for r in res["rows"]}
  for (cfg, b, s), r in by.items():
    if s != "fused":
      continue
    x = by[(cfg, b, "xla")]
    lines.append(
        f"| {cfg} | {b} | {r['fused_backend']} | {r['tpot_ms']:.3f} | {x['tpot_ms']:.3f} | "
        f"{x['tpot_ms'] / r['tpot_ms']:.3f}x | {r['tokens_per_s']:,.0f} | "
        f"{x['tokens_per_s']:,.0f} | {100 * r['same_tokens_rows']:.0f}% |")
  return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  configs = list(dict.fromkeys(r["config"] for r in res["rows"]))
  fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4), squeeze=False)
  for ax, cfg in zip(axes[0], configs):
    for s, style in zip(res["samplers"], ("o-", "s--")):
      rs = sorted((r for r in res["rows"] if r["config"] == cfg and r["sampler"] == s),
                  key=lambda r: r["batch"])
      ax.plot([r["batch"] for r in rs], [r["tpot_ms"] for r in rs], style, label=s)
    ax.set_xscale("log", base=2)
    bs = sorted({r["batch"] for r in res["rows"]})
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.minorticks_off()
    ax.set_xlabel("batch B")
    ax.set_ylabel("time per output token (ms)")
    ax.set_title(cfg)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(f"End-to-end decode TPOT, {res['gpu']}, jax {res['jax_version']}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  args = parse_args(argv)
  res = bench(args)
  stem = f"e2e_{args.name or slug(res['gpu'])}"
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
  md = markdown(res)
  (args.out / f"{stem}.md").write_text(md)
  plot(res, args.out / f"{stem}.png")
  print(md)
  print(f"wrote {args.out / stem}.{{json,md,png}}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
