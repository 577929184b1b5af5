"""The per-row state of one pass over the vocabulary with sampling controls.

Every fused kernel and the ``xla`` backend's streaming loop produce a
:class:`ControlsState` for their rows; the package's stage 2 merges states
(chunks, warpgroups, shards) and finishes them into tokens and
log-probabilities. It lives here, below both, so that kernels return it
without knowing the package above them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from pallas_kernels.rules import INT_MAX


class ControlsState(NamedTuple):
  """Per row, what a pass saw of its vocabulary rows (``[B, ...]`` arrays).

  Attributes:
    best_score, best_id: f32 / int32 ``[B, S]``: each sample's best
      perturbed score (greedy rows: the transformed logit) and its id, by
      the tie rule.
    best_t: f32 ``[B, S]``: the tempered logit of each sample's best (zeros
      unless log-probabilities were asked for).
    lse_max, lse_sum: f32 ``[B]``: an online log-sum-exp of the tempered
      logits, ``(max, sum exp(t - max))`` (``(0, 1)`` when neither
      log-probabilities nor truncation asked for it).
    cand_vals, cand_ids: ``[B, M]``: the M largest tempered logits seen,
      descending, and their ids (only with truncation; else None).
    cand_bound: f32 ``[B]``: no tempered logit that is not listed is larger
      (``-inf`` when the lists are exact). Listed values at or below it are
      ``-inf``: they may have unlisted equals or neighbours.
  """

  best_score: Any
  best_id: Any
  best_t: Any
  lse_max: Any
  lse_sum: Any
  cand_vals: Any = None
  cand_ids: Any = None
  cand_bound: Any = None


def top_m(vals, ids, bound, m: int):
  """The ``m`` largest listed values of each row, with their ids.

  ``vals``/``ids`` ``[B, ...]`` (any number of lists of any length,
  flattened per row), ``bound`` ``[B]``: values at or below it leave first
  (the lists' invariant, see :class:`ControlsState`); rows with fewer than
  ``m`` values are padded with ``-inf``.

  Returns:
    ``(vals [B, m] descending, ids [B, m])``.
  """
  b = vals.shape[0]
  vals = jnp.where(vals > bound.reshape((b,) + (1,) * (vals.ndim - 1)), vals,
                   -jnp.inf).reshape(b, -1)
  ids = ids.reshape(b, -1)
  if vals.shape[1] < m:
    pad = ((0, 0), (0, m - vals.shape[1]))
    vals = jnp.pad(vals, pad, constant_values=-jnp.inf)
    ids = jnp.pad(ids, pad, constant_values=INT_MAX)
  vals, j = lax.top_k(vals, m)
  return vals, jnp.take_along_axis(ids, j, axis=1)
