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


def _pass(hidden, weight, key, *, weight_layout, temperature, backend, weight_scale,
          controls):
  """``(p, c, impl, state)`` of the call, or None without candidate lists."""
  from flashsample_jax import backends, problem
  from flashsample_jax import controls as ctl
  p = problem.prepare(hidden, weight, key, temperature=temperature,
                      weight_layout=weight_layout, weight_scale=weight_scale)
  c = ctl.prepare_controls(batch=p.batch, vocab_size=p.vocab_size, rows=p.weight_rows,
                           **controls)
  if not c.lists:
    return None
  impl = backends.resolve(backend, p, c)
  return p, c, impl, impl.controls_state(p, c)


def _flagged(p, c, impl, st) -> np.ndarray:
  from flashsample_jax import stage2
  return np.asarray(stage2.finish(p, c, st, exact_top=impl.exact_top(p, c))[2])


def exact_path_rows(hidden, weight, key, *, weight_layout: str = "vd",
                    temperature=1.0, backend: str = "auto", weight_scale=None,
                    **controls) -> int:
  """Rows of ``sample(hidden, weight, key, temperature=..., **controls)``
  that take the exact path (un-timed: the backend's pass, then stage 2)."""
  run = _pass(hidden, weight, key, weight_layout=weight_layout, temperature=temperature,
              backend=backend, weight_scale=weight_scale, controls=controls)
  return 0 if run is None else int(_flagged(*run).sum())


def exact_path_reasons(hidden, weight, key, *, weight_layout: str = "vd",
                       temperature=1.0, backend: str = "auto", weight_scale=None,
                       **controls) -> list[dict]:
  """For each row :func:`exact_path_rows` counts, what its merged lists
  held (un-timed): ``bound`` (no unlisted value is larger), ``last`` (the
  lists' last value or the bound, the larger), ``complete``, the t of the
  top-k-th candidate (with top_k) and whether it lies above ``last`` (the
  top-k set inside the lists; else a list or slot overflowed above it),
  how many listed values lie above ``last``, and whether the row's
  log-sum-exp is finite. Reads stage 2's lists as :func:`stage2.finish`
  does."""
  from flashsample_jax import stage2
  run = _pass(hidden, weight, key, weight_layout=weight_layout, temperature=temperature,
              backend=backend, weight_scale=weight_scale, controls=controls)
  if run is None:
    return []
  p, c, impl, st = run
  rows = np.nonzero(_flagged(p, c, impl, st))[0]
  lists = stage2.merged_lists(p, c, st)
  vals, last = np.asarray(lists.vals), np.asarray(lists.last)
  bound, complete = np.asarray(st.cand_bound), np.asarray(lists.complete)
  lse_max = np.asarray(st.lse_max)
  top_k = None if c.top_k is None else np.asarray(c.top_k)
  out = []
  for r in rows:
    rec = dict(row=int(r), bound=float(bound[r]), last=float(last[r]),
               complete=bool(complete[r]), listed_above_last=int((vals[r] > last[r]).sum()),
               lse_finite=bool(np.isfinite(lse_max[r])))
    if top_k is not None and 0 < int(top_k[r]) <= vals.shape[1]:
      thr = float(vals[r, int(top_k[r]) - 1])
      rec.update(top_k_t=thr, top_k_inside=bool(thr > last[r]))
    out.append(rec)
  return out
