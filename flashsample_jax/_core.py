"""Pieces every backend shares: logits of a vocabulary slice, the per-element
score, and the (score, index) combine rule.

The combine rule reproduces ``jnp.argmax``: NaN beats every number (the first
NaN wins, as in ``jnp.argmax``), otherwise the larger score wins, and ties go
to the lower vocabulary id. It is associative and commutative, so candidates
can be reduced in any order: chunk by chunk, tile by tile, shard by shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashsample_jax import noise


def logits(hidden, weight, layout: str) -> jax.Array:
  """f32 logits ``[B, Vc]`` of ``hidden [B, D]`` against a weight slice.

  Args:
    hidden: ``[B, D]``.
    weight: ``[Vc, D]`` for layout "vd", ``[D, Vc]`` for "dv".
    layout: "vd" or "dv".
  """
  contract = 1 if layout == "vd" else 0
  return lax.dot_general(
      hidden, weight, (((1,), (contract,)), ((), ())),
      preferred_element_type=jnp.float32)


def scores(l, gid, k0, k1, ctr_hi, ctr_lo, temperature, vocab_size):
  """Per-element scores whose row argmax is the sampled token.

  Sampled rows: ``l / T + gumbel``; greedy rows (``T == 0``): ``l``. Ids at or
  above ``vocab_size`` get ``-inf``.

  Args:
    l: f32 logits ``[B, Vc]``.
    gid: int32 global vocabulary ids ``[Vc]`` (or broadcastable to ``l``).
    k0, k1, ctr_hi, ctr_lo, temperature: ``[B]`` per-row noise and
      temperature (see ``Problem``).
    vocab_size: logical vocabulary (static int or scalar array).
  """
  col = lambda x: x[:, None]
  hi, lo = noise.add_u32(col(ctr_hi), col(ctr_lo), gid.astype(jnp.uint32))
  g = noise.gumbel(col(k0), col(k1), hi, lo)
  t = col(temperature)
  greedy = t == 0
  # Division, not multiplication by 1/T: the reference divides, and the two
  # round differently unless T is a power of two.
  s = jnp.where(greedy, l, l / jnp.where(greedy, 1.0, t) + g)
  return jnp.where(gid < vocab_size, s, -jnp.inf)


def better(s_new, i_new, s_old, i_old):
  """True where candidate ``(s_new, i_new)`` beats ``(s_old, i_old)``."""
  nan_new, nan_old = jnp.isnan(s_new), jnp.isnan(s_old)
  same = (s_new == s_old) | (nan_new & nan_old)
  return (s_new > s_old) | (nan_new & ~nan_old) | (same & (i_new < i_old))


def combine(a, b):
  """Best of two ``(score, index)`` candidate pairs, elementwise."""
  take_b = better(b[0], b[1], a[0], a[1])
  return jnp.where(take_b, b[0], a[0]), jnp.where(take_b, b[1], a[1])


def reduce_candidates(score, index, axis: int = 0, best=None):
  """Reduces stacked candidates along ``axis`` with :func:`combine`.

  Two plain reductions instead of one variadic ``lax.reduce``: the best
  score (``max`` propagates NaN, as the rule wants), then the lowest index
  among the candidates that attain it (NaN attains NaN). Same result as
  folding :func:`combine`; on GPUs XLA emits the variadic reduce over
  ``[1187, 64]`` kernel candidates as one 1024-thread block (20 us on the
  H200, PERF_LOG.md v4), these as two parallel column reductions.
  ``best``: the max of ``score`` along ``axis`` if the caller has it (one
  reduction of several stacked maxima is one kernel, not several).
  """
  if best is None:
    best = jnp.max(score, axis=axis, keepdims=True)
  else:
    best = jnp.expand_dims(best, axis)
  hit = (score == best) | (jnp.isnan(score) & jnp.isnan(best))
  big = jnp.array(jnp.iinfo(index.dtype).max, index.dtype)
  idx = jnp.min(jnp.where(hit, index, big), axis=axis)
  return jnp.squeeze(best, axis), idx


def argbest(score, index, axis: int, carry=None):
  """:func:`combine` folded along ``axis`` in one variadic reduction.

  Returns ``(best score, its index[, carry at it])``, the same as
  :func:`reduce_candidates`. One kernel where the two plain reductions of
  that function are two (use it along the minor axis: XLA's variadic
  column reductions run in one block, see there). ``carry`` (same shape as
  ``score``) rides along with its candidate, e.g. the winner's tempered
  logit; where a score and index repeat, the larger carry is kept.
  """
  big = jnp.array(jnp.iinfo(index.dtype).max, index.dtype)
  ops = (score, jnp.broadcast_to(index, score.shape))
  init = (jnp.array(-jnp.inf, score.dtype), big)
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


def row_best(s, gid):
  """Best ``(score, global id)`` of each row of a score block ``[B, Vc]``."""
  j = jnp.argmax(s, axis=1)  # first max, first NaN: the combine rule
  best = jnp.take_along_axis(s, j[:, None], axis=1)[:, 0]
  return best, jnp.broadcast_to(gid, s.shape[-1:])[j].astype(jnp.int32)


def _varying_axes(x) -> frozenset:
  """Mesh axes ``x`` is typed as varying over (empty without check_vma)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)   # jax >= 0.10
  if mat is not None and hasattr(mat, "varying"):
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def all_gather_invariant(x, axes: tuple[str, ...]):
  """``all_gather`` of ``x`` over mesh ``axes`` into a new leading axis.

  Inside ``shard_map``; the result is typed as replicated over ``axes``
  (``to="invarying"``), so ``out_specs`` may leave them out. With
  ``check_vma=True`` a value not yet varying over an axis is first cast to
  varying (all_gather needs that); ``check_vma=False`` tracks no variance.
  """
  vma = _varying_axes(x)
  missing = tuple(a for a in axes if a not in vma)
  if vma and missing:
    x = lax.pcast(x, missing, to="varying")
  return lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=0, to="invarying")
