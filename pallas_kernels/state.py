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
    ent_sum: f32 ``[B]``: ``sum(exp(t - lse_max) * (t - lse_max))`` over the
      finite ``t`` (for the entropy; else None).
    raw_max, raw_sum: f32 ``[B]``: an online log-sum-exp of the raw logits
      (for raw log-probabilities; else None).
    finite_count: int32 ``[B]``: how many ids have a finite ``t`` (for kept
      sets; else None).
    given_t: f32 ``[B]``: the ``t`` of each row's given id (``-inf`` where
      the part does not hold it; for scoring given tokens; else None).
    raw_vals, raw_ids, raw_bound: the largest raw logits seen, as
      ``cand_vals``/``cand_ids``/``cand_bound`` (for ``top_logprobs`` of the
      raw logits; else None).
  """

  best_score: Any
  best_id: Any
  best_t: Any
  lse_max: Any
  lse_sum: Any
  cand_vals: Any = None
  cand_ids: Any = None
  cand_bound: Any = None
  ent_sum: Any = None
  raw_max: Any = None
  raw_sum: Any = None
  finite_count: Any = None
  given_t: Any = None
  raw_vals: Any = None
  raw_ids: Any = None
  raw_bound: Any = None


def from_row_lists(f: dict) -> ControlsState:
  """The state of a pass without noise from a list kernel's outputs
  (``triton_lists.row_lists`` / ``entry_lists``: lists, log-sum-exp and
  ``best_t``/``best_id`` ``[B]``): the best's score is its ``t``, read only
  for greedy rows, whose ``t`` is ``x``; one best serves every sample."""
  f = dict(f)
  best_t, best_id = f.pop("best_t")[:, None], f.pop("best_id")[:, None]
  return ControlsState(best_score=best_t, best_id=best_id, best_t=best_t, **f)


def parts_sum(x, axis: int = 1):
  """``x`` summed over ``axis`` (``[B, P]``: over the parts) in an order
  fixed by that axis's length alone: a pairwise tree of elementwise
  additions (zeros pad it to a power of two), so a row's sum is the same
  bits whatever the batch around it. A ``jnp.sum`` adds in the order of the
  reduction kernel XLA picks for the whole array's shape (docs/design.md,
  "Determinism and RL")."""
  x = jnp.moveaxis(x, axis, -1)
  n = x.shape[-1]
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << max(n - 1, 0).bit_length()) - n)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x[..., 0]


def lse_parts(mx, total):
  """Online log-sum-exp pieces ``(max, sum)`` ``[B, P]`` merged over the
  parts (parts whose max is ``-inf`` hold nothing), in :func:`parts_sum`'s
  order: ``(max [B], sum [B])``."""
  m = jnp.max(mx, axis=1)
  scale = jnp.where(mx == -jnp.inf, 0.0, jnp.exp(mx - m[:, None]))
  return m, parts_sum(total * scale)


def top_m(vals, ids, bound, m: int, *, by_id: bool = False):
  """The ``m`` largest listed values of each row, with their ids.

  ``vals``/``ids`` ``[B, ...]`` (any number of lists of any length,
  flattened per row), ``bound`` ``[B]``: values at or below it leave first
  (the lists' invariant, see :class:`ControlsState`); rows with fewer than
  ``m`` values are padded with ``-inf``. ``by_id``: equal values in id
  order (``-0.0 == 0.0``; one sort with two keys, ``controls.top_n``'s
  order, which then needs no sort of its own); else in any order (a
  ``top_k``, which XLA:CPU runs much faster than a sort).

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
  if by_id:
    # Not stable: the (value, id) keys are distinct but for identical
    # padding entries, and a stable sort carries an iota operand as well.
    neg, ids = lax.sort((-vals, ids), dimension=1, num_keys=2, is_stable=False)
    return -neg[:, :m], ids[:, :m]
  vals, j = lax.top_k(vals, m)
  return vals, jnp.take_along_axis(ids, j, axis=1)


def _first(a_v, a_i, b_v, b_i):
  """Where ``(a_v, a_i)`` comes first in the lists' order: larger value,
  then lower id."""
  return (a_v > b_v) | ((a_v == b_v) & (a_i < b_i))


def pair_lists(vals, ids):
  """Halves sorted candidate lists by keeping the better half of each pair.

  ``vals``/``ids`` ``[B, K, P]`` (P even): part ``p``'s K largest values of
  each row, descending (ties: lower id first). Parts ``2 c`` and ``2 c + 1``
  become one list of the K best of their union, by one compare-exchange of
  list ``2 c``'s ``i``-th entry with list ``2 c + 1``'s ``(K - 1 - i)``-th (a
  bitonic half-cleaner: the winners are the top K as a set, in bitonic
  order, not sorted; :func:`sort_bitonic` sorts them where that matters).

  Returns:
    ``(vals, ids, lost)``, all ``[B, K, P / 2]``: the kept lists and the
    losers' values, whose largest the caller folds into the pair's bound
    (no value it did not keep is larger).
  """
  if vals.shape[2] % 2:
    raise ValueError(f"pair_lists needs an even number of parts, got {vals.shape[2]}")
  a_v, a_i = vals[..., 0::2], ids[..., 0::2]
  b_v, b_i = vals[:, ::-1, 1::2], ids[:, ::-1, 1::2]
  take_a = _first(a_v, a_i, b_v, b_i)
  return (jnp.where(take_a, a_v, b_v), jnp.where(take_a, a_i, b_i),
          jnp.where(take_a, b_v, a_v))


def sort_bitonic(vals, ids):
  """Sorts bitonic lists ``[B, K, P]`` (K a power of two, e.g. what
  :func:`pair_lists` keeps) into the lists' order along axis 1: log2(K)
  rounds of half-cleaners, elementwise work XLA fuses with its neighbours."""
  k = vals.shape[1]
  if k & (k - 1):
    raise ValueError(f"sort_bitonic needs lists of a power-of-two length, got {k}")
  half = k // 2
  while half:
    shape = (vals.shape[0], k // (2 * half), 2, half, vals.shape[2])
    v, i = vals.reshape(shape), ids.reshape(shape)
    a_v, b_v, a_i, b_i = v[:, :, 0], v[:, :, 1], i[:, :, 0], i[:, :, 1]
    take_a = _first(a_v, a_i, b_v, b_i)
    vals = jnp.stack([jnp.where(take_a, a_v, b_v), jnp.where(take_a, b_v, a_v)],
                     axis=2).reshape(vals.shape)
    ids = jnp.stack([jnp.where(take_a, a_i, b_i), jnp.where(take_a, b_i, a_i)],
                    axis=2).reshape(ids.shape)
    half //= 2
  return vals, ids


def halve_parts(vals, ids, bound, rounds: int):
  """``rounds`` pairings of neighbouring parts' sorted lists, each halving
  what stage 2's top-M sort reads.

  ``vals``/``ids`` ``[B, K, P]`` sorted lists (K a power of two when
  ``rounds > 1``), ``bound`` ``[B, P]`` (no unlisted value of a part is
  larger). Parts are padded with empty lists to a multiple of
  ``2 ** rounds``. Returns ``(vals, ids, bound)`` over ``P / 2 ** rounds``
  parts: each new part's list holds the K best of its ``2 ** rounds`` parts
  and its bound their bounds' and losers' largest. A row that had more
  than K of its kept set in those parts gets a higher bound, and stage 2
  takes its exact path, as it did for more than K in one part.
  """
  if rounds <= 0:
    return vals, ids, bound
  p = vals.shape[2]
  step = 1 << rounds
  pad = -p % step
  if pad:
    vals = jnp.pad(vals, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
    ids = jnp.pad(ids, ((0, 0), (0, 0), (0, pad)), constant_values=INT_MAX)
    bound = jnp.pad(bound, ((0, 0), (0, pad)), constant_values=-jnp.inf)
  for r in range(rounds):
    if r:
      vals, ids = sort_bitonic(vals, ids)
    vals, ids, lost = pair_lists(vals, ids)
    bound = jnp.maximum(jnp.maximum(bound[:, 0::2], bound[:, 1::2]),
                        jnp.max(lost, axis=1))
  return vals, ids, bound
