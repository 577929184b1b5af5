"""The ``xla`` backend: pure JAX, streams over vocabulary chunks.

Each step of a ``fori_loop`` computes the logits of one chunk of the
vocabulary, adds the noise and keeps a running best ``(score, id)`` per row,
so no ``[B, V]`` array is ever live. Runs on any JAX device and is the
fallback for ``backend="auto"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashsample_jax import _core
from flashsample_jax._validate import Problem

# Elements of the [B, Vc] chunk: 2**20 f32 values (4 MiB of logits plus as
# much of noise temporaries) keeps a chunk in L2 on a GPU and bounds memory.
_CHUNK_ELEMENTS = 2**20
_MIN_CHUNK = 512


def chunk_size(batch: int, rows: int) -> int:
  """Vocabulary rows per chunk: about 2**20 elements, a multiple of 128."""
  c = max(_MIN_CHUNK, _CHUNK_ELEMENTS // max(batch, 1))
  c = (c // 128) * 128
  return min(c, rows)


def candidates(p: Problem, *, vocab_offset=0, chunk: int | None = None):
  """Best ``(score f32 [B], global id int32 [B])`` over ``p.weight``'s rows.

  Args:
    p: the validated problem.
    vocab_offset: global vocabulary id of the weight's first row (non-zero
      when ``weight`` is one shard of a vocabulary-sharded head).
    chunk: vocabulary rows per step; default :func:`chunk_size`.
  """
  rows = p.weight_rows
  vc = min(chunk or chunk_size(p.batch, rows), rows)
  axis = 0 if p.layout == "vd" else 1
  offset = jnp.asarray(vocab_offset, jnp.int32)

  def block(w, start, width):
    gid = offset + start + lax.iota(jnp.int32, width)
    l = _core.logits(p.hidden, w, p.layout)
    s = _core.scores(l, gid, p.k0, p.k1, p.ctr_hi, p.ctr_lo, p.temperature,
                     p.vocab_size)
    return _core.row_best(s, gid)

  def body(i, best):
    start = i * vc
    w = lax.dynamic_slice_in_dim(p.weight, start, vc, axis=axis)
    return _core.combine(best, block(w, start, vc))

  n_full = rows // vc
  # The first chunk seeds the loop carry (rather than constants): the carry
  # then varies over the same shard_map axes as the data, which
  # shard_map(check_vma=True) requires of a loop.
  best = block(lax.slice_in_dim(p.weight, 0, vc, axis=axis), 0, vc)
  if n_full > 1:
    best = lax.fori_loop(1, n_full, body, best)
  tail = rows - n_full * vc
  if tail:
    w = lax.slice_in_dim(p.weight, n_full * vc, rows, axis=axis)
    best = _core.combine(best, block(w, n_full * vc, tail))
  return best
