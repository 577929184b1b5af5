"""The rows ``batch_invariance`` finds differing, one by one (issue #39):
for each row of a call of B whose token or float bits differ from the same
row of the full call, which fields differ, both values, and whether stage
2 sent the row to the exact path in each call (and how many rows each call
sent there: the exact path's branch depends on that count).

  python3 -m benchmarks.experiments.exp_invariance_rows [--head qwen3-1.7b]
      [--backend auto] [--mode qwen3_topk_topp] [--batches 64 100] [--full 512]

Inputs as ``benchmarks.batch_invariance`` (random bf16, per-row keys, T
0.7). One JSON line per differing row, then one per B with the counts.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks import _fallback
from benchmarks.batch_invariance import FIELDS, MODES, TEMPERATURE, _bits
from benchmarks.shapes import HEADS, random_head


def _flags(h, w, keys, backend, kw) -> np.ndarray:
  """Per row: whether stage 2 sends it to the exact path (all False
  without candidate lists)."""
  run = _fallback._pass(h, w, keys, weight_layout="vd", temperature=TEMPERATURE,
                        backend=backend, weight_scale=None, controls=kw)
  if run is None:
    return np.zeros(h.shape[0], bool)
  return np.asarray(_fallback._flagged(*run))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--head", default="qwen3-1.7b", choices=sorted(HEADS))
  ap.add_argument("--backend", default="auto")
  ap.add_argument("--mode", default="qwen3_topk_topp", choices=list(MODES))
  ap.add_argument("--batches", nargs="+", type=int, default=[64, 100])
  ap.add_argument("--full", type=int, default=512)
  args = ap.parse_args(argv)
  d, _ = HEADS[args.head]
  w = random_head(args.head)
  h = jax.random.normal(jax.random.key(7), (args.full, d), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(3), args.full)
  kw = MODES[args.mode]
  run = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=TEMPERATURE,
                                          backend=args.backend, **kw))
  full = run(h, w, keys)
  full_flags = _flags(h, w, keys, args.backend, kw)
  for b in args.batches:
    part = run(h[:b], w, keys[:b])
    flags = _flags(h[:b], w, keys[:b], args.backend, kw)
    differ = np.asarray(part.tokens) != np.asarray(full.tokens)[:b]
    fields = {}
    for name in FIELDS:
      if getattr(part, name, None) is None:
        continue
      diff = _bits(getattr(part, name)) != _bits(getattr(full, name))[:b]
      if diff.ndim > 1:
        diff = diff.any(axis=tuple(range(1, diff.ndim)))
      fields[name] = diff
      differ |= diff
    for r in np.nonzero(differ)[0]:
      rec = dict(head=args.head, B=b, row=int(r), exact_here=bool(flags[r]),
                 exact_full=bool(full_flags[r]),
                 token=[int(np.asarray(part.tokens)[r]), int(np.asarray(full.tokens)[r])],
                 fields=[n for n, dd in fields.items() if dd[r]])
      for n in rec["fields"]:
        a, f = np.asarray(getattr(part, n))[r], np.asarray(getattr(full, n))[r]
        rec[n] = [np.asarray(a).tolist(), np.asarray(f).tolist()]
      print(json.dumps(rec), flush=True)
    print(json.dumps(dict(head=args.head, B=b, differing=int(differ.sum()),
                          exact_rows_here=int(flags.sum()),
                          exact_rows_full=int(full_flags.sum()),
                          exact_rows_full_first_b=int(full_flags[:b].sum()))), flush=True)


if __name__ == "__main__":
  main()
