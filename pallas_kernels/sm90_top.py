"""The exact top-N of materialized rows (sm90): a launch that exits at once
for the rows that do not need it.

``top_logprobs=N`` reads its N largest tempered logits from the candidate
lists of the controls kernel; a row whose lists cannot certify them (a list
overflowed above the N-th, or the row has NaN or infinite logits) needs the
exact answer from the whole row. An XLA conditional around that work costs
its CUDA graph node on every call, even when no row needs it: about a third
of what ``top_logprobs`` added to plain sampling (PERF_LOG c5 and the
seventeenth session). So the work is launched on every call and skipped
inside the kernels instead: the controls kernel materializes the rows'
tempered logits only when some row of its launch is flagged
(``sm90_controls.exact_top``), and this kernel, one CTA per row, reads
its row's flag and returns unless it is set.

A flagged row's top N comes from N passes over its row, each the best
element after the previous one in :func:`~flashsample_jax.controls.top_n`'s
order: larger value first, ``-0.0 == 0.0``, NaN after every number, ties by
lower id. Each element's value becomes an int32 key with that order
(:func:`sort_key`), so every comparison is an integer one. It reads the row
N times: slow, and only ever run for the rare rows the lists cannot
certify.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import sm90_common as common
from pallas_kernels.rules import INT_MAX

__all__ = ["exact_top", "sort_key", "CHUNK"]

# Elements per load of a row (16 per thread of the warpgroup); rows are
# read in whole chunks, so the materialized rows are this wide or wider.
CHUNK = 2048
_INT_MIN = -(2**31)
# Below every number's key (-inf: -2139095041) and above "nothing".
_NAN_KEY = _INT_MIN + 1


def _filled(like, value: int):
  """int32 ``value`` in ``like``'s shape, made from ``like``: Mosaic GPU
  marks the result of a select between an array and a broadcast constant
  unsigned, and an unsigned compare or max would misorder negative keys."""
  return like - like + value


def sort_key(x):
  """int32 keys whose order is ``controls.top_n``'s order of ``x`` (f32):
  ``-0.0`` and ``0.0`` equal, NaN below ``-inf``, larger values larger."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  bits = jnp.where(x == 0, _filled(bits, 0), bits)
  # Negative values in reversed order: bits ^ 0x7FFFFFFF.
  key = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
  return jnp.where(x != x, _filled(bits, _NAN_KEY), key)


def _kernel(flags_ref, t_ref, v_ref, i_ref, *, n_top: int, n_chunks: int,
            valid: int):
  row = lax.axis_index("row")
  layout = plgpu.Layout.WG_STRIDED((CHUNK,), vec_size=4)
  col = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=layout)
  full = lambda v: plgpu.layout_cast(jnp.full((CHUNK,), v, jnp.int32), layout)

  @pl.when(flags_ref[row] != 0)
  def _():
    def one(j, prev):
      pk, pid = prev

      def chunk(c, st):
        bk, bid, bbits = st
        x = plgpu.load(t_ref.at[row, pl.ds(c * CHUNK, CHUNK)], layout=layout)
        key = sort_key(x)
        gid = col + c * CHUNK
        after = (key < pk) | ((key == pk) & (gid > pid))
        take = (gid < valid) & after & ((key > bk) | ((key == bk) & (gid < bid)))
        return (jnp.where(take, key, bk), jnp.where(take, gid, bid),
                jnp.where(take, lax.bitcast_convert_type(x, jnp.int32), bbits))

      bk, bid, bbits = lax.fori_loop(
          0, n_chunks, chunk, (full(_INT_MIN), full(INT_MAX), full(0)))
      k = jnp.max(bk)
      at = bk == k
      tid = jnp.min(jnp.where(at, bid, _filled(bid, INT_MAX)))
      # One slot holds tid: its bits are the max (even -0.0's, INT_MIN).
      bits = jnp.max(jnp.where(at & (bid == tid), bbits, _filled(bbits, _INT_MIN)))
      v_ref[row, j] = lax.bitcast_convert_type(bits, jnp.float32)
      i_ref[row, j] = tid
      return k, tid

    lax.fori_loop(0, n_top, one, (jnp.int32(INT_MAX), jnp.int32(-1)))


def exact_top(t, flags, n_top: int, valid: int, *,
              target: common.Target = common.Target()):
  """The ``n_top`` largest values of each flagged row of ``t`` and their
  columns, in ``controls.top_n``'s order.

  Args:
    t: f32 ``[R, W]``, ``W`` a multiple of :data:`CHUNK`; only columns
      below ``valid`` are read as elements (the rest may hold anything).
    flags: bool ``[R]``: the rows to compute.
    n_top: N, at most ``valid``.
    valid: the row's real columns.

  Returns:
    ``(vals f32 [R, N], ids int32 [R, N])``; rows not flagged hold
    anything.
  """
  r, w = t.shape
  if w % CHUNK:
    raise ValueError(f"exact_top needs rows a multiple of {CHUNK} wide, got {w}")
  if not 0 < n_top <= valid <= w:
    raise ValueError(f"exact_top needs 0 < n_top={n_top} <= valid={valid} <= {w}")
  body = functools.partial(_kernel, n_top=n_top, n_chunks=w // CHUNK, valid=valid)
  f = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((r, n_top), jnp.float32),
                jax.ShapeDtypeStruct((r, n_top), jnp.int32)),
      grid=(r,), grid_names=("row",),
      kernel_name="flashsample_sm90_exact_top",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane),
      interpret=target.interpret)
  return f(flags.astype(jnp.int32), t)
