"""Batch invariance: does a row's result depend on what else is in the batch?

Run on the GPU (one process)::

    python3 -m benchmarks.batch_invariance [--heads S qwen3-1.7b] [--backends mosaic triton xla]
        [--batches 1 16 48 ... | --schedule-edges] [--modes plain qwen3_topk_topp rl]
        [--out DIR] [--smoke]

Random bf16 inputs (the hidden states of the largest batch, ``--full`` rows,
per-row keys, temperature 0.7), each backend: the first B rows sampled as a
call of B rows against the same rows of the full call, for every B of
``--batches``. Counted per B: rows whose token differs, and rows whose
float outputs (the log-probabilities, ``logsumexp`` and, where the mode
asks for them, entropies, raw log-probabilities and ``top_logprobs``)
differ in any bit. Modes: plain with ``return_logprobs``; Qwen3's
generation config (top-k 20, top-p 0.95) with ``return_logprobs``; ``rl``:
that config with every float output. A row's
noise depends only on its key, so a token can move only where the logits
or a truncation edge do; log-probabilities move with the order in which a
schedule adds each row's terms (docs/design.md, "Determinism and RL").
Writes ``batch_invariance_<gpu>.json`` / ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks import _timing
from benchmarks.shapes import HEADS, random_head

MODES = {
    "plain": dict(return_logprobs=True),
    "qwen3_topk_topp": dict(top_k=20, top_p=0.95, return_logprobs=True),
    # Every float field a call can report, with truncation.
    "rl": dict(top_k=20, top_p=0.95, return_logprobs=True, return_entropy=True,
               return_raw_logprobs=True, top_logprobs=5),
}
# The float fields compared where a call returns them (None otherwise).
FIELDS = ("logprob", "logprob_truncated", "logsumexp", "logprob_raw", "entropy",
          "entropy_truncated", "top_logprobs")
TEMPERATURE = 0.7


def _bits(x) -> np.ndarray:
  return np.asarray(x, np.float32).view(np.uint32)


def differing_rows(part, full, b: int) -> dict:
  """Rows of ``part`` (a call of b rows) that differ from the first b rows
  of ``full``: in the token, and in any bit of any log-probability."""
  tok = np.asarray(part.tokens) != np.asarray(full.tokens)[:b]
  bits = np.zeros(b, bool)
  per_field = {}
  for name in FIELDS:
    if getattr(part, name, None) is None:
      continue
    diff = _bits(getattr(part, name)) != _bits(getattr(full, name))[:b]
    if diff.ndim > 1:   # top_logprobs: a row differs in any of its entries
      diff = diff.any(axis=tuple(range(1, diff.ndim)))
    per_field[name + "_bit_rows"] = int(diff.sum())
    bits |= diff
  return dict(token_rows=int(tok.sum()), any_bit_rows=int(bits.sum()), **per_field)


def measure(w, h, keys, backend, mode: str, batches, label: str | None = None) -> list[dict]:
  """One row of counts per B (the full call: every row of ``h``).
  ``backend``: a name or a backend instance (then ``label`` names it)."""
  kw = MODES[mode]
  # The weight is an argument: a closure would make it a constant of the
  # program, which XLA then compiles in (minutes for a 2 GB head).
  run = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=TEMPERATURE,
                                          backend=backend, **kw))
  full = run(h, w, keys)
  out = []
  for b in batches:
    part = run(h[:b], w, keys[:b])
    out.append(dict(backend=label or backend, mode=mode, B=b,
                    **differing_rows(part, full, b)))
    print(json.dumps(out[-1]), flush=True)
  return out


def schedule_edges(full: int) -> list[int]:
  """B = 1..16 and both sides of every multiple of 32 below ``full``: where
  the kernels' schedules, batch blocks and launches change."""
  edges = set(range(1, 17))
  for m in range(32, full + 1, 32):
    edges.update((m - 1, m, m + 1))
  return sorted(b for b in edges if b < full)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S"], choices=sorted(HEADS))
  ap.add_argument("--backends", nargs="+", default=["mosaic", "triton", "xla"])
  ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
  ap.add_argument("--batches", nargs="+", type=int,
                  default=[1, 2, 16, 48, 49, 64, 100, 128, 200, 256, 384, 511])
  ap.add_argument("--full", type=int, default=512, help="rows of the full call")
  ap.add_argument("--schedule-edges", action="store_true",
                  help="instead of --batches: 1..16 and both sides of every multiple of 32")
  ap.add_argument("--out", default="benchmarks/results/batch_invariance")
  ap.add_argument("--smoke", action="store_true", help="a tiny head, for a CPU")
  args = ap.parse_args(argv)
  batches = schedule_edges(args.full) if args.schedule_edges else args.batches
  rows = []
  for head in args.heads:
    if args.smoke:
      d, v = 64, 1000
      w = (jax.random.normal(jax.random.key(1), (v, d)) * (3.0 / d**0.5)).astype(jnp.bfloat16)
    else:
      d, v = HEADS[head]
      w = random_head(head)
    h = jax.random.normal(jax.random.key(7), (args.full, d), jnp.bfloat16)
    keys = jax.random.split(jax.random.key(3), args.full)
    for backend in args.backends:
      for mode in args.modes:
        for r in measure(w, h, keys, backend, mode, [b for b in batches if b < args.full]):
          rows.append(dict(r, head="smoke" if args.smoke else head))
  meta = dict(gpu=_timing.device_name(), jax=jax.__version__, full=args.full,
              temperature=TEMPERATURE,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "batch_invariance_" + _timing.slug(meta["gpu"]))
  with open(stem + ".json", "w") as fh:
    json.dump(dict(meta, rows=rows), fh, indent=1)
  with open(stem + ".md", "w") as fh:
    fh.write(_table(meta, rows))
  print(open(stem + ".md").read())


def _table(meta, rows) -> str:
  """Per head, backend and mode: the B's with differing rows (tokens /
  float-output bits), out of every B measured."""
  lines = [f"# Batch invariance on {meta['gpu']}\n",
           f"jax {meta['jax']}, {meta['date']}; random bf16 inputs, per-row keys, T "
           f"{meta['temperature']}; the first B rows of a call of B against the same "
           f"rows of a call of {meta['full']}: rows whose token / any bit of a float "
           "output differs.\n",
           "| head | backend | mode | B measured | B with token rows | "
           "B with float-output bit rows (rows) |",
           "|---|---|---|---|---|---|"]
  groups = {}
  for r in rows:
    groups.setdefault((r["head"], r["backend"], r["mode"]), []).append(r)
  for (head, backend, mode), rs in groups.items():
    tok = ", ".join(f"{r['B']} ({r['token_rows']})" for r in rs if r["token_rows"]) or "none"
    lp = ", ".join(f"{r['B']} ({r['any_bit_rows']})" for r in rs
                   if r["any_bit_rows"]) or "none"
    lines.append(f"| {head} | {backend} | {mode} | {len(rs)} | {tok} | {lp} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
