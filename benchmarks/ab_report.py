"""Table (and plot) of a jax-version A/B (benchmarks/jax_versions_gpu.sh ab).

  python3 -m benchmarks.ab_report RUN.jsonl [RUN.jsonl ...] [--plot OUT.png]

Reads the JSON lines of ``benchmarks.experiments.ab_versions`` from one or
more runs on the same GPU and prints, per point, each version's times (one
per round), the ratio of their medians and whether both versions drew the
same tokens (the sum of the token ids, per point, across every round).
"""

from __future__ import annotations

import collections
import json
import statistics
import sys

VERSIONS = ("0.11", "0.12")


def load(paths):
  us, toks = collections.defaultdict(list), collections.defaultdict(set)
  device = None
  for path in paths:
    for line in open(path):
      r = json.loads(line)
      point = (r["shape"], r["batch"], r["control"])
      us[point + (r["jax"][:4],)].append(r["us"])
      toks[point].add(r["token_sum"])
      device = r["device"]
  return device, us, toks


def table(device, us, toks) -> str:
  lines = [device, "", "| shape | B | control | jax 0.11.2 us (per round) | jax 0.12.0.1 us | "
           "median 0.12 / 0.11 | same tokens |", "|---|---|---|---|---|---|---|"]
  for p in sorted(toks):
    a, b = (us.get(p + (v,)) for v in VERSIONS)
    if a and b:
      ratio = statistics.median(b) / statistics.median(a)
      lines.append(f"| {p[0]} | {p[1]} | {p[2]} | {' / '.join(map(str, a))} | "
                   f"{' / '.join(map(str, b))} | {ratio:.3f} | {len(toks[p]) == 1} |")
  return "\n".join(lines)


def plot(device, us, out: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  pts = sorted({k[:3] for k in us if k[2] != "xla"},
               key=lambda p: (p[0], p[2] != "plain", p[1]))
  ratio = [statistics.median(us[p + (VERSIONS[1],)]) / statistics.median(us[p + (VERSIONS[0],)])
           for p in pts]
  fig, ax = plt.subplots(figsize=(8, 3.5))
  ax.bar(range(len(pts)), ratio,
         color=["tab:green" if abs(r - 1) <= 0.03 else "tab:red" for r in ratio])
  ax.axhline(1.0, color="k", lw=0.8)
  ax.axhspan(0.97, 1.03, color="0.9", zorder=0)
  ax.set_xticks(range(len(pts)), [f"{s} B={b}\n{c}" for s, b, c in pts], fontsize=7)
  ax.set_ylim(0.9, 1.1)
  ax.set_ylabel("time jax 0.12.0.1 / jax 0.11.2")
  ax.set_title(f"fs.sample (auto), {device}, median of rounds (grey: within 3%)")
  fig.tight_layout()
  fig.savefig(out, dpi=120)


if __name__ == "__main__":
  args = sys.argv[1:]
  out = None
  if "--plot" in args:
    i = args.index("--plot")
    out = args[i + 1]
    del args[i:i + 2]
  device, us, toks = load(args)
  print(table(device, us, toks))
  if out:
    plot(device, us, out)
