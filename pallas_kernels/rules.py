"""The element-wise rules that every kernel and every XLA path share.

**The tie rule** (``jnp.argmax``'s): NaN beats every number (of several NaNs,
the lowest id wins), otherwise the larger score wins, and equal scores go to
the lower vocabulary id. It is associative and commutative, so candidates can
be reduced in any order: chunk by chunk, tile by tile, warpgroup by
warpgroup, shard by shard.

**The greedy rule**: a row whose temperature is 0 is greedy. Its score is the
untempered (transformed) logit, no noise, and its tempered value uses T = 1
(for log-probabilities).

Written with plain ``jnp``/``lax`` ops that Mosaic GPU lowers, so the kernels
and the XLA code use these very functions. Reductions are passed in where a
kernel needs its own (a cross-warp reduction with per-warpgroup scratch).
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jax import lax

# The index of "no candidate": larger than every vocabulary id.
INT_MAX = int(np.iinfo(np.int32).max)


def better(s_new, i_new, s_old, i_old):
  """True where candidate ``(s_new, i_new)`` beats ``(s_old, i_old)``."""
  nan_new, nan_old = s_new != s_new, s_old != s_old
  same = (s_new == s_old) | (nan_new & nan_old)
  return (s_new > s_old) | (nan_new & ~nan_old) | (same & (i_new < i_old))


def combine(a, b):
  """The better of two ``(score, index)`` candidate pairs, elementwise."""
  take_b = better(b[0], b[1], a[0], a[1])
  return jnp.where(take_b, b[0], a[0]), jnp.where(take_b, b[1], a[1])


def first_best(score, index, axis: int, *, mask=None, best=None,
               max_fn=jnp.max, min_fn=jnp.min):
  """The best ``(score, index)`` along ``axis`` by the tie rule.

  Two plain reductions: the max (which propagates NaN, as the rule wants),
  then the lowest index among the entries that attain it (any NaN attains a
  NaN max). ``mask`` (bool, like ``score``) leaves entries out of the index
  reduction; the caller gives them a ``-inf`` score. ``best``: the max if the
  caller already has it. ``max_fn``/``min_fn(x, axis=)`` replace ``jnp.max``
  / ``jnp.min`` (a kernel's own cross-warp reduction).

  Returns:
    ``(best score, its lowest index)``, ``axis`` removed; the index is
    :data:`INT_MAX` where every entry is masked.
  """
  if best is None:
    best = max_fn(score, axis=axis)
  keep = tuple(d for d in range(score.ndim) if d != axis % score.ndim)
  wide = lax.broadcast_in_dim(best, score.shape, keep)
  hit = (score == wide) | (score != score)
  if mask is not None:
    hit = hit & mask
  idx = min_fn(jnp.where(hit, index, INT_MAX), axis=axis)
  return best, idx


def split_temperature(temperature):
  """``(greedy, t_safe)``: which rows are greedy, and T with 1 in their place
  (the divisor of their tempered values)."""
  greedy = temperature == 0
  return greedy, jnp.where(greedy, 1.0, temperature)


def perturb(x, t, g, greedy):
  """The score whose row argmax is the token: ``t + g`` for sampled rows,
  the untempered ``x`` for greedy ones."""
  return jnp.where(greedy, x, t + g)


def noise_scale(greedy):
  """Per row, 0 for greedy rows and 1 for sampled ones: ``t + g * scale``
  is :func:`perturb`'s score in one fma where a kernel's ``t`` of a greedy
  row is its ``x`` (T = 1; the noise ``g`` is always finite), and one fma
  is cheaper than an add and a select."""
  return jnp.where(greedy, 0.0, 1.0)


def argbest(score, index, axis: int, carry=None):
  """The tie rule folded along ``axis`` in one variadic reduction.

  Returns ``(best score, its index[, carry at it])``, as :func:`first_best`
  does, but as one XLA reduction where :func:`first_best` is two: the form
  to use along a minor axis, where XLA runs a variadic row reduction as one
  kernel. ``carry`` (same shape as ``score``) rides along with its
  candidate, e.g. the winner's tempered logit; where a score and index
  repeat, the larger carry is kept.
  """
  ops = (score, jnp.broadcast_to(index, score.shape))
  init = (jnp.array(-jnp.inf, score.dtype), jnp.array(INT_MAX, index.dtype))
  if carry is not None:
    ops += (jnp.broadcast_to(carry, score.shape),)
    init += (jnp.array(-jnp.inf, ops[2].dtype),)

  def fold(a, b):
    take_b = better(b[0], b[1], a[0], a[1])
    out = (jnp.where(take_b, b[0], a[0]), jnp.where(take_b, b[1], a[1]))
    if carry is not None:
      twin = ~take_b & ~better(a[0], a[1], b[0], b[1])    # same candidate
      out += (jnp.where(take_b, b[2], jnp.where(twin, jnp.maximum(a[2], b[2]), a[2])),)
    return out

  return lax.reduce(ops, init, fold, (axis,))
