"""Top-N selections for ``top_logprobs`` (sm90): the candidate lists' first
M on every call (:func:`top_lists`), and the exact top-N of materialized
rows (:func:`exact_top`), a launch that exits at once for the rows that do
not need it.

:func:`top_lists` replaces XLA's two-key sort of the controls kernel's
~900 listed candidates per row, which ran 55 dependent compare-exchange
steps (whatever B is) and copied both operands first, for the 28 it
keeps. Here one warp holds a row: each lane sorts its candidates in
registers (runs of 8 sorted by a bitonic network over ``[4, 32]`` arrays,
one element per thread each, then merged two at a time keeping 8) and
keeps its first 8; then each of M passes reduces the
lanes' heads inside the warp (``redux``, no shared memory) and the lane
that held the winner pops it. Mosaic GPU's warpgroup reductions go
through shared memory and two barriers: one row per warpgroup with three
such reductions per pass was slower than the sort (docs/performance.md,
"The exact path's conditional").

``top_logprobs=N`` reads its N largest tempered logits from the candidate
lists of the controls kernel; a row whose lists cannot certify them (a list
overflowed above the N-th, or the row has NaN or infinite logits) needs the
exact answer from the whole row. An XLA conditional around that work costs
its CUDA graph node on every call, even when no row needs it: about a third
of what ``top_logprobs`` added to plain sampling (docs/performance.md,
"The exact path's conditional"). So the work is launched on every call and skipped
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
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import sm90_common as common
from pallas_kernels.rules import INT_MAX

__all__ = ["exact_top", "top_lists", "sort_key", "CHUNK", "LIST_WIDTH", "LIST_M"]

# Elements per load of a row (16 per thread of the warpgroup); rows are
# read in whole chunks, so the materialized rows are this wide or wider.
CHUNK = 2048
_INT_MIN = -(2**31)
# Below every number's key (-inf: -2139095041) and above "nothing".
_NAN_KEY = _INT_MIN + 1
_NEG_INF_BITS = -8388608          # 0xFF800000
_NEG_INF_KEY = _NEG_INF_BITS ^ 0x7FFFFFFF
# top_lists: rows per CTA (one per warp), the most candidates per row (32
# per lane in registers), the most it keeps, and how many each lane keeps.
_ROWS = 4
LIST_WIDTH = 1024
LIST_M = 32
_KEEP = 8


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


def _slot_layout():
  """``[_ROWS, 32]`` arrays, row ``r`` in warp ``r``, column ``c`` in lane
  ``c``: one element per thread, and a reduction along the row stays in
  its warp (one ``redux`` instruction for an int32 max)."""
  return plgpu.Layout.TILED(fa.Tiling(((_ROWS, 32), (_ROWS, 1))),
                            warp_dims=(-2,), lane_dims=(-3,), vector_dim=-1)


def _first(a, b):
  """Where entry ``a`` (key, id, bits) comes before ``b``: larger key,
  then lower id."""
  return (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))


def _pick(c, a, b):
  return tuple(jnp.where(c, x, y) for x, y in zip(a, b))


def _exchange(xs, i, j):
  """Orders ``xs[i]`` before ``xs[j]`` (one compare-exchange)."""
  c = _first(xs[i], xs[j])
  xs[i], xs[j] = _pick(c, xs[i], xs[j]), _pick(c, xs[j], xs[i])


def _sort_bitonic(xs, lo: int, n: int):
  """Sorts the bitonic run ``xs[lo:lo + n]`` (n a power of two)."""
  half = n // 2
  while half:
    for start in range(lo, lo + n, 2 * half):
      for i in range(start, start + half):
        _exchange(xs, i, i + half)
    half //= 2


def _sort(xs, lo: int, n: int):
  """Sorts ``xs[lo:lo + n]`` (a bitonic sorting network, n a power of
  two), first entry first."""
  if n == 1:
    return
  _sort(xs, lo, n // 2)
  _sort(xs, lo + n // 2, n // 2)
  # The second half reversed makes the run bitonic.
  xs[lo + n // 2:lo + n] = xs[lo + n // 2:lo + n][::-1]
  _sort_bitonic(xs, lo, n)


def _lists_kernel(v_ref, i_ref, ov_ref, oi_ref, ob_ref, *, n_top: int, width: int):
  r0 = lax.axis_index("rows") * _ROWS
  layout = _slot_layout()
  # Lane c of row r's warp holds columns c, 32 + c, ... ("slots"): it
  # sorts them, keeps its _KEEP first (the largest dropped key joins the
  # row's bound), and each of the m passes takes the first of the lanes'
  # heads and pops it.
  slots = []
  for c0 in range(0, width, 32):
    x = plgpu.load(v_ref.at[pl.ds(r0, _ROWS), pl.ds(c0, 32)], layout=layout,
                   optimized=False)
    gid = plgpu.load(i_ref.at[pl.ds(r0, _ROWS), pl.ds(c0, 32)], layout=layout,
                     optimized=False)
    slots.append((sort_key(x), gid, lax.bitcast_convert_type(x, jnp.int32)))
  key0, gid0, _ = slots[0]
  none = (_filled(key0, _INT_MIN), _filled(gid0, INT_MAX), _filled(key0, _NEG_INF_BITS))
  dropped = _filled(key0, _NEG_INF_KEY)
  keep = min(_KEEP, len(slots))
  for g in range(0, len(slots), keep):
    _sort(slots, g, keep)
  kept = slots[:keep]
  for g in range(keep, len(slots), keep):
    # The first ``keep`` of two sorted runs: a half-cleaner (what it drops
    # bounds the row), then a bitonic merge.
    other = slots[g:g + keep]
    for i in range(keep):
      c = _first(kept[i], other[keep - 1 - i])
      lost = _pick(c, other[keep - 1 - i], kept[i])
      dropped = jnp.maximum(dropped, lost[0])
      kept[i] = _pick(c, kept[i], other[keep - 1 - i])
    _sort_bitonic(kept, 0, keep)
  col = plgpu.broadcasted_iota(jnp.int32, (_ROWS, 32), 1, layout=layout)
  rows = lambda a: plgpu.layout_cast(lax.broadcast_in_dim(a, (_ROWS, 32), (0,)), layout)

  def one(j, st):
    heads, out_v, out_i = st
    hk, hi, hb = heads[0]
    k = jnp.max(hk, axis=1)
    # min as -max(-id): a warp reduces int32 max in one instruction.
    tid = -jnp.max(jnp.where(hk == rows(k), -hi, none[0]), axis=1)
    win = (hk == rows(k)) & (hi == rows(tid))
    b = jnp.max(jnp.where(win, hb, none[0]), axis=1)
    # Nothing left (every key INT_MIN): (-inf, INT_MAX), as the sort pads.
    empty = k == _INT_MIN
    b = jnp.where(empty, _filled(b, _NEG_INF_BITS), b)
    t = jnp.where(empty, _filled(tid, INT_MAX), tid)
    heads = [_pick(win, heads[i + 1], heads[i]) for i in range(keep - 1)] + [
        _pick(win, none, heads[keep - 1])]
    here = col == j
    return (heads, jnp.where(here, rows(b), out_v), jnp.where(here, rows(t), out_i))

  _, out_v, out_i = lax.fori_loop(0, n_top, one, (kept, none[2], none[1]))
  ov_ref[pl.ds(r0, _ROWS)] = lax.bitcast_convert_type(out_v, jnp.float32)
  oi_ref[pl.ds(r0, _ROWS)] = out_i
  bound = rows(jnp.max(dropped, axis=1))
  ob_ref[pl.ds(r0, _ROWS)] = lax.bitcast_convert_type(
      jnp.where(bound < 0, bound ^ 0x7FFFFFFF, bound), jnp.float32)


def top_lists(vals, ids, bound, m: int, *, target: common.Target = common.Target()):
  """:func:`pallas_kernels.state.top_m` with ``by_id=True``, by selection
  instead of a sort (XLA's two-key sort of ~1000 candidates runs 55
  dependent compare-exchange steps): one warp per row, whose lanes sort
  their candidates in registers; each of ``m`` passes takes the first of
  the lanes' heads.

  A lane (columns ``c, c + 32, ...``) keeps its 8 first candidates: the
  row's bound rises to the largest value it drops, and listed values at or
  below the bound are ``-inf`` (:class:`~pallas_kernels.state.ControlsState`'s
  invariant). Such a row's lists hold fewer than ``m`` values; stage 2 finds
  its top N uncertified only if the bound reaches them, i.e. if more than 8
  of its top N share a lane (~1e-7 rows for N = 20 spread at random over 32
  lanes), and then takes the exact path, as when a kernel's list
  overflowed.

  Args:
    vals, ids: f32 / int32 ``[R, L]``: the candidates (ids unique per row,
      but for INT_MAX padding), ``L`` at most :data:`LIST_WIDTH`.
    bound: f32 ``[R]``: no unlisted value is larger; values at or below it
      (and NaN) count as ``-inf``.
    m: candidates kept, at most :data:`LIST_M`.

  Returns:
    ``(vals f32 [R, m], ids int32 [R, m], bound f32 [R])``: descending,
    equal values by id; values at or below ``bound`` are ``-inf`` (with
    their ids, as ``top_m`` keeps them), and a row out of candidates is
    padded with ``(-inf, INT_MAX)``.
  """
  r, l = vals.shape
  if l > LIST_WIDTH or not 0 < m <= LIST_M:
    raise ValueError(f"top_lists takes at most {LIST_WIDTH} candidates per row "
                     f"and 0 < m <= {LIST_M}, got {l} and m={m}")
  width = 1 << max(7, (l - 1).bit_length())     # 32 lanes x a power of two
  rows = -(-r // _ROWS) * _ROWS
  vals = jnp.where(vals > bound[:, None], vals, -jnp.inf)
  pad = ((0, rows - r), (0, width - l))
  vals = jnp.pad(vals, pad, constant_values=-jnp.inf)
  ids = jnp.pad(ids, pad, constant_values=INT_MAX)
  body = functools.partial(_lists_kernel, n_top=m, width=width)
  f = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((rows, 32), jnp.float32),
                jax.ShapeDtypeStruct((rows, 32), jnp.int32),
                jax.ShapeDtypeStruct((rows, 32), jnp.float32)),
      grid=(rows // _ROWS,), grid_names=("rows",),
      kernel_name="flashsample_sm90_top_lists",
      compiler_params=target.compiler_params(reduction_scratch=False),
      interpret=target.interpret)
  out_v, out_i, out_b = f(vals, ids)
  bound = jnp.maximum(bound, out_b[:r, 0])
  out_v = out_v[:r, :m]
  return jnp.where(out_v > bound[:, None], out_v, -jnp.inf), out_i[:r, :m], bound


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
      compiler_params=target.compiler_params(reduction_scratch=False),
      interpret=target.interpret)
  return f(flags.astype(jnp.int32), t)
