"""Each vocabulary tile's largest tempered logits per batch row, without
noise: the plain ping-pong kernel's pass with another epilogue.

Where every row of a call truncates, the pass draws no noise
(``Controls.for_pass``): stage 2 needs only each row's top-M tempered
logits ``t``, its log-sum-exp and its best. The plain vocabulary-major
kernel (:mod:`pallas_kernels.sm90_sampler`, the register path of 8-bit
heads included) already computes every tile's ``t``; here its epilogue keeps,
per (batch row, tile of ``tile_v`` consecutive ids), the tile's
:data:`ENTRIES` largest ``t`` in the lists' order (value descending, id
ascending) with their ids, the next value (an upper bound on the tile's
unlisted values) and the sum of ``exp(t - max)``. The Triton row kernel
:func:`pallas_kernels.triton_lists.entry_lists` turns those into the
row's list (docs/performance.md, "Lists from the plain kernel").

Outputs, each ``[N, n_tiles]`` (:data:`FIELDS`; ``N >= B`` the launch's
padded batch): ``v1..v4`` f32 and ``i1..i4`` int32 (global ids; ``-inf``
and ``INT_MAX`` past a tile's valid ids), ``v5`` f32, ``sum`` f32. A tile
holding a NaN has ``v1`` NaN (the row is then handed to stage 2's exact
path).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import rules, sm90_common as common, sm90_sampler
from pallas_kernels.rowdata import RowLayout
from pallas_kernels.sm90_config import TuningConfig, slot_entries_config

__all__ = ["ENTRIES", "FIELDS", "slot_entries"]

# Entries kept per tile and row: a row's list is exact above the largest
# fifth value of a tile, so a row is certified unless five of its top-k
# share one of the ~1000 tiles (C(50, 5) / 1187^4 ~ 1e-6 for k = 50 on a
# 151936-id head; four entries would leave C(50, 4) / 1187^3 ~ 1.4e-4).
ENTRIES = 4
FIELDS = tuple(f"v{e}" for e in range(1, ENTRIES + 1)) + tuple(
    f"i{e}" for e in range(1, ENTRIES + 1)) + ("v5", "sum")
_DTYPES = tuple(jnp.float32 for _ in range(ENTRIES)) + tuple(
    jnp.int32 for _ in range(ENTRIES)) + (jnp.float32, jnp.float32)
_ROWS = RowLayout(samples=1)


def _slot_epilogue(acc, *, cfg: TuningConfig, passes, row0, start, first_new, off_ref,
                   rowdata_smem, acc_smem, scratch_f, scratch_i, out_refs, out_row,
                   rows_valid: int, vocab_size: int, interpret: bool):
  """One tile's entries of each column (batch row) of ``acc [vw, N]``
  (rows ``start + row0 + [0, vw)`` of the weight, those below
  ``first_new`` done by an earlier tile), written to column ``out_row`` of
  each of ``out_refs`` (:data:`FIELDS`' order). The accumulator goes
  through SMEM in passes as in :func:`sm90_sampler._epilogue`."""
  vw = acc.shape[0]
  epi = cfg.epi_cols
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  local = plgpu.broadcasted_iota(jnp.int32, (vw, epi), 0, layout=plgpu.Layout.WGMMA) + row0
  gid = local + (off_ref[0] + start)
  valid = (local >= first_new) & (local + start < rows_valid) & (gid < vocab_size)
  bcast = lambda x: lax.broadcast_in_dim(x, (vw, epi), (1,))
  red = lambda op, scratch: lambda x, axis: common.col_reduce(
      x, op, scratch, interpret=interpret)
  col_max, col_min = red("max", scratch_f), red("min", scratch_i)
  rl = _ROWS

  def chunk(c, slot, carry):
    load = lambda i: bcast(plgpu.load(rowdata_smem.at[c, i], layout=col_layout))
    f32 = lambda i: lax.bitcast_convert_type(load(i), jnp.float32)
    l = plgpu.load(acc_smem.at[slot], layout=plgpu.Layout.WGMMA)
    _, t_safe = rules.split_temperature(f32(rl.TEMPERATURE))
    t = common.tempered(l, t_safe, f32(rl.INV_TEMPERATURE), load(rl.zero),
                        interpret=interpret)
    v = jnp.where(valid, t, -jnp.inf)
    vals, ids = [], []
    left = valid
    for _ in range(ENTRIES):
      m, i = rules.first_best(jnp.where(left, v, -jnp.inf), gid, 0, mask=left,
                              max_fn=col_max, min_fn=col_min)
      vals.append(m)
      ids.append(i)
      left = left & (gid != bcast(i))
    rest = col_max(jnp.where(left, v, -jnp.inf), 0)
    # A tile of -inf sums 0 (exp(-inf - -inf) would be NaN); with a NaN or
    # +inf maximum the row's log-sum-exp is NaN or its max whatever this is.
    top = bcast(vals[0])
    e = jnp.where(top == -jnp.inf, 0.0, common.approx_exp(v - top, interpret=interpret))
    total = common.col_reduce(e, "add", scratch_f, interpret=interpret)
    for x, ref in zip(vals + ids + [rest, total], out_refs):
      common.store_column(x, ref.at[c, :, pl.ds(out_row, 1)], interpret=interpret)
    return carry

  common.epilogue_passes(acc, chunk, passes=passes, acc_smem=acc_smem, epi=epi,
                         unroll=cfg.epi_unroll)


def slot_entries(hidden, weight, rows, vocab_offset=0, *, layout: str, vocab_size: int,
                 target: common.Target = common.Target(), scale=None) -> dict:
  """Each tile's entries (:data:`FIELDS`, each ``[N, n_tiles]``) of the
  tempered logits ``(hidden @ W.T) * scale / T`` (``rows``: the per-row
  block of :func:`~pallas_kernels.rowdata.pack_rows` with one sample; the
  other arguments as :func:`sm90_sampler.candidates`'). Tiles are
  ``tile_v`` ids of the launch's config
  (:func:`~pallas_kernels.sm90_config.slot_entries_config`, which must not
  be None for these shapes). ``N >= B`` is the launch's padded batch: rows
  past ``B`` are padding, left in place (slicing them off copied each of
  the ten arrays; the entry kernel reads the first ``B`` rows)."""
  offset = jnp.asarray(vocab_offset, jnp.int32).reshape((1,))
  n_rows = weight.shape[0 if layout == "vd" else 1]
  w, rows_k = common.pad_vocab(weight, layout, common.vocab_align(weight.dtype, layout))
  scale, mode = common.scale_operand(scale, rows_k)
  batch, dim = hidden.shape
  picked = slot_entries_config(batch, dim, rows_k, jnp.dtype(hidden.dtype).itemsize,
                  jnp.dtype(weight.dtype).itemsize, layout)
  if picked is None:
    raise ValueError(f"no single vocabulary-major launch for B={batch}, D={dim}, "
                     f"{rows_k} rows of {weight.dtype}")
  cfg, n = picked
  rowdata = jnp.pad(rows, [(0, 0), (0, n - batch)])
  rowdata = rowdata.reshape(_ROWS.rows, n // cfg.epi_cols, cfg.epi_cols).transpose(1, 0, 2)
  h = jnp.pad(hidden, [(0, n - batch), (0, 0)])
  outs = sm90_sampler._launch(  # pylint: disable=protected-access
      offset, rowdata, h, w, scale, scale_mode=mode, cfg=cfg, layout=layout,
      rows_valid=n_rows, vocab_size=vocab_size, target=target,
      tile_epilogue=_slot_epilogue, out_dtypes=_DTYPES,
      kernel_name="flashsample_sm90_slots")
  return dict(zip(FIELDS, outs))
