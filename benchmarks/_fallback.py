"""How many rows of a sampling call take the exact materialized path.

The fused sampler decides truncation (top-k / top-p / min-p) and top-N
log-probabilities from per-row candidate lists; rows the lists cannot
certify (a kept set larger than the lists, ties at their end, non-finite
logits) are redone from materialized logits, which costs about a second
matmul and a sort. The benchmarks report that count beside their timings,
so a slow row in a table can be told apart from a slow kernel.
"""

from __future__ import annotations

import numpy as np


def exact_path_rows(hidden, weight, key, *, weight_layout: str = "vd",
                    temperature=1.0, backend: str = "auto", weight_scale=None,
                    **controls) -> int:
  """Rows of ``sample(hidden, weight, key, temperature=..., **controls)``
  that take the exact path (un-timed: the backend's pass, then stage 2)."""
  from flashsample_jax import backends, problem, stage2
  from flashsample_jax import controls as ctl
  p = problem.prepare(hidden, weight, key, temperature=temperature,
                      weight_layout=weight_layout, weight_scale=weight_scale)
  c = ctl.prepare_controls(batch=p.batch, vocab_size=p.vocab_size, rows=p.weight_rows,
                           **controls)
  if not c.lists:
    return 0
  impl = backends.resolve(backend, p, c)
  st = impl.controls_state(p, c)
  return int(np.asarray(stage2.finish(p, c, st, exact_top=impl.exact_top(p, c))[2]).sum())
