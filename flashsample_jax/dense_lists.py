"""Candidate lists of a materialized block of tempered logits without a
top-k over the whole row.

A truncation call keeps each row's top-M tempered logits for stage 2
(:func:`flashsample_jax.stage2.candidate_count`). Over a block as wide as a
vocabulary, ``lax.top_k(t, M)`` sorts every row on a GPU (docs/performance.md,
"Candidate lists of the dense route"). Here the list is read off slots of
consecutive ids instead:

1. the maximum of each slot (one reduction over the block), and the M slots
   of the largest maxima (a top-k over ``W / slot`` values);
2. in each of those M slots, its ``DEPTH`` largest values (``DEPTH`` rounds
   of an argmax and a mask over ``M x slot`` values);
3. the M largest of those ``DEPTH x M`` candidates (one two-key sort).

The result keeps the lists' contract (:class:`pallas_kernels.state.ControlsState`):
``bound`` is an upper bound on every value of the row that is not listed
(the largest maximum of the other slots, the largest value a top slot holds
past its depth, the (M+1)-th candidate), and no listed value is at or below
it. Where the bound lies inside what a row needs (many equal values, or
more than ``DEPTH`` of its top values in one slot), stage 2's exact path
resolves the row; so the lists are exact whatever the logits, and only
their cost depends on them.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import rules

# Slots per list entry: the lists come from the M slots of the largest
# maxima, so the row's top values must spread over more slots than that. A
# row's top K fall DEPTH + 1 into one of S slots with a chance of about
# C(K, DEPTH + 1) / S^DEPTH: with S >= 8 M = 1024 slots and K = 50, 2e-6 at
# depth 4 (2% at depth 2); such a row's bound then lies inside its top K,
# and stage 2's exact path takes it. The (M+1)-th candidate is read, so
# DEPTH >= 2.
SLOTS_PER_ENTRY = 8
MIN_SLOT = 8
DEPTH = 4


def slot_size(width: int, m: int) -> int | None:
  """Ids per slot for a block of ``width`` ids and lists of ``m``: the
  largest power of two that leaves :data:`SLOTS_PER_ENTRY` slots per entry,
  or None where that is below :data:`MIN_SLOT` (a narrow block: take its
  top-k)."""
  per = width // (SLOTS_PER_ENTRY * m)
  if per < MIN_SLOT:
    return None
  return 1 << (per.bit_length() - 1)


def top_slots(t, m: int, slot: int):
  """``t [B, W]`` cut into slots of ``slot`` ids (``-inf`` past ``W``):
  ``(slots [B, S, slot], top [B, m], below [B])``, ``top`` the ``m`` slots
  of the largest maxima and ``below`` the largest maximum of the others, so
  every value outside the ``top`` slots is at most ``below``. Needs ``S >
  m`` (:func:`slot_size`)."""
  b, w = t.shape
  s = -(-w // slot)
  slots = jnp.pad(t, ((0, 0), (0, s * slot - w)), constant_values=-jnp.inf).reshape(b, s, slot)
  maxima, top = lax.top_k(jnp.max(slots, axis=2), m + 1)
  return slots, top[:, :m], maxima[:, m]


def slot_tops(block, depth: int):
  """The ``depth`` largest values of each slot of ``block [..., slot]`` and
  their places in it (first places first among equals), and the largest
  value left (so the slot's unlisted values are at most it):
  ``(vals [..., depth], places [..., depth], rest [...])``. ``depth``
  rounds of an argmax and a mask over the slot."""
  place = lax.broadcasted_iota(jnp.int32, block.shape, block.ndim - 1)
  vals, places = [], []
  for _ in range(depth):
    j = jnp.argmax(block, axis=-1)
    vals.append(jnp.take_along_axis(block, j[..., None], axis=-1)[..., 0])
    places.append(j)
    block = jnp.where(place == j[..., None], -jnp.inf, block)
  return jnp.stack(vals, -1), jnp.stack(places, -1), jnp.max(block, axis=-1)


def slot_lists(t, gid, m: int, *, slot: int, depth: int = DEPTH):
  """The top-``m`` list of each row of ``t [B, W]`` (ids ``gid [W]``):
  ``(vals [B, m] descending, ids [B, m], bound [B])``, from the ``depth``
  largest values of each of the ``m`` slots of ``slot`` ids with the
  largest maxima (:func:`slot_size`)."""
  b = t.shape[0]
  slots, top, below = top_slots(t, m, slot)
  block = jnp.take_along_axis(slots, top[:, :, None], axis=1)          # [B, m, slot]
  vals, places, rest = slot_tops(block, depth)                         # [B, m, depth]
  ids = jnp.take(gid, top[:, :, None] * slot + places, mode="clip").astype(jnp.int32)
  neg, ids = lax.sort((-vals.reshape(b, -1), ids.reshape(b, -1)), dimension=1, num_keys=2)
  vals = -neg
  # Not listed: values outside the top slots (at most `below`), a top
  # slot's values past its depth (at most its `rest`), and listed ones
  # past the m-th (at most the (m+1)-th).
  bound = jnp.maximum(jnp.maximum(below, jnp.max(rest, axis=1)), vals[:, m])
  vals, ids = vals[:, :m], ids[:, :m]
  listed = vals > bound[:, None]
  return jnp.where(listed, vals, -jnp.inf), jnp.where(listed, ids, rules.INT_MAX), bound
