"""The plain sampling kernels for Hopper (sm90), in Pallas Mosaic GPU.

One launch streams the LM head ``W`` through shared memory once and keeps,
per batch row, the best ``(score, global id)`` of each vocabulary tile (or of
each warpgroup's tiles); plain JAX then reduces the few candidates::

    logits = W_tile @ H.T                          (f32, wgmma, K loop over Dt)
    score  = logits / T + gumbel(key, ctr + gid)   (sampled rows; greedy: logits)
    cand   = (max score, lowest gid attaining it; NaN wins)

One kernel body per :class:`~pallas_kernels.sm90_config.Schedule` (the
heuristic :func:`~pallas_kernels.sm90_config.pick_config` picks one by batch
size; why: ``docs/performance.md``, "Schedules by batch size"):

* :func:`_kernel_pingpong` (``PINGPONG_VOCAB_M``): vocabulary on the wgmma M
  side ("swap AB"); the two compute warpgroups alternate whole tiles over the
  ring of :func:`~pallas_kernels.sm90_common.pingpong_frame`, so one's
  epilogue overlaps the other's share of the weight stream. Column
  reductions across warps use per-warpgroup SMEM scratch
  (:func:`~pallas_kernels.sm90_common.col_reduce`).
* :func:`_kernel_batch_major` (``PINGPONG_BATCH_M``): the same ping-pong with
  the batch on the M side (``acc[N, Vt]``): the per-row argmax reduces inside
  each warp (no barriers, no scratch) with a running best carried over chunks
  and tiles.
* :func:`_kernel` (``COOPERATIVE``, where V < 128 leaves one compute
  warpgroup): every step of ``emit_pipeline_warp_specialized`` shared, the
  accumulator to SMEM in column passes; every step waits for its wgmma.

The public entry point is :func:`candidates`, with array-level arguments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import rules, sm90_common as common, threefry
from pallas_kernels.rowdata import RowLayout
from pallas_kernels.sm90_config import (
    BLOCK_ROWS, BLOCKED_MIN_ROWS, MAX_BLOCKS, ROWDATA_ROWS, Schedule,
    TuningConfig, WeightPath, batch_chunks, batch_side, pick_blocked_config,
    pick_config, weight_path, wg_scratch_elems)

__all__ = ["candidates"]

# The plain kernels draw one sample per row.
_ROWS = RowLayout(samples=1)
assert _ROWS.rows == ROWDATA_ROWS  # the SMEM budget counts this block


def _epilogue(acc, *, cfg: TuningConfig, passes, row0, start, first_new,
              off_ref, rowdata_smem, acc_smem, scratch_f, scratch_i,
              out_refs, out_row, rows_valid: int, vocab_size: int,
              interpret: bool, best=None):
  """Noise, transform and per-column (max, first argmax) of one accumulator.

  ``acc`` [vw, N] f32 holds rows ``start + row0 + [0, vw)`` of the weight;
  rows below ``first_new`` (tile-local) were done by an earlier tile.
  Writes one candidate column ``out_row`` of ``out_refs = (score_ref,
  index_ref)``, ``[nc, C, n_out]`` each. With ``best`` (one ``(score, id)``
  pair per chunk of columns, :func:`per_warpgroup`): writes nothing and
  returns ``best``, a warpgroup's running best per column over its tiles,
  updated by this tile's (:func:`_chunk_update`).

  The accumulator goes to SMEM (``acc_smem`` [pass_chunks, vw, C]) so that
  the noise runs in a (not unrolled) loop over column chunks: unrolled, the
  epilogue was ~10k straight-line instructions per tile and ran at ~0.07
  IPC per warp (docs/performance.md, "The epilogue loop"). ``passes`` lists the (first, end) chunks
  of each pass: the copy of a pass, then its loop.
  """
  vw = acc.shape[0]
  epi = cfg.epi_cols
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  local = plgpu.broadcasted_iota(jnp.int32, (vw, epi), 0,
                                 layout=plgpu.Layout.WGMMA) + row0
  gid = local + (off_ref[0] + start)
  valid = ((local >= first_new) & (local + start < rows_valid)
           & (gid < vocab_size))
  gid_u = gid.astype(jnp.uint32)
  bcast = lambda x: lax.broadcast_in_dim(x, (vw, epi), (1,))

  rl = _ROWS
  reduce = lambda op, scratch: lambda x, axis: common.col_reduce(
      x, op, scratch, interpret=interpret)

  def chunk(c, slot, carry):
    load = lambda i: bcast(plgpu.load(rowdata_smem.at[c, i],
                                      layout=col_layout))
    l = plgpu.load(acc_smem.at[slot], layout=plgpu.Layout.WGMMA)
    hi, lo = threefry.add_u32(*(load(i) for i in rl.ctr(0)), gid_u)
    g = threefry.gumbel(load(rl.K0), load(rl.K1), hi, lo,
                        log=common.noise_log(interpret))
    f32 = lambda i: lax.bitcast_convert_type(load(i), jnp.float32)
    greedy, t_safe = rules.split_temperature(f32(rl.TEMPERATURE))
    t = common.tempered(l, t_safe, f32(rl.INV_TEMPERATURE), load(rl.zero),
                        interpret=interpret)
    s = rules.perturb(l, t, g, greedy)
    s = jnp.where(valid, s, -jnp.inf)
    # max.NaN: the max is NaN iff the column holds a NaN; NaN rows then win.
    m, idx = rules.first_best(s, gid, 0, mask=valid,
                              max_fn=reduce("max", scratch_f),
                              min_fn=reduce("min", scratch_i))
    if best is not None:
      return _chunk_update(carry, c, m, idx)
    for x, ref in zip((m, idx), out_refs):
      common.store_column(x, ref.at[c, :, pl.ds(out_row, 1)], interpret=interpret)
    return carry

  return common.epilogue_passes(
      acc, chunk, passes=passes, acc_smem=acc_smem, epi=epi,
      unroll=cfg.epi_unroll, carry=() if best is None else best)


def _chunk_update(bests, c, sc, gid):
  """``bests`` (one running ``(score, id)`` per chunk of columns) with
  chunk ``c``'s updated by ``(sc, gid)`` (:func:`_slot_update`: a
  warpgroup's tiles come in increasing ids). ``c`` is traced (the epilogue
  loops over the chunks), so every chunk's pair is updated and the others
  keep theirs by a select: a few ops on 4 values a thread per chunk."""
  if len(bests) == 1:
    return (_slot_update(bests[0], sc, gid),)
  out = []
  for k, best in enumerate(bests):
    new, hit = _slot_update(best, sc, gid), c == k
    out.append(tuple(jnp.where(hit, x, y) for x, y in zip(new, best)))
  return tuple(out)


def _slot_update(best, sc, gid):
  """The tie rule's update of a column slot's running best by the next
  element, for slots that see their ids in increasing order (each compute
  warpgroup's tiles come in order; a tile's ids already seen have score
  -inf). The new element wins if its score is larger, or it is NaN where
  the best is not; on equal scores the earlier, lower id stays. The first
  element always enters (the best's id is still INT_MAX), so a row whose
  scores are all -inf keeps its lowest id, as the rule wants. Three
  compares, where :func:`rules.better` needs five."""
  b_s, b_i = best
  take = (~(sc <= b_s) & (b_s == b_s)) | (b_i == rules.INT_MAX)
  return jnp.where(take, sc, b_s), jnp.where(take, gid, b_i)


def _kernel(off_ref, rowdata_ref, h_ref, w_ref, score_ref, index_ref, *,
            cfg: TuningConfig, layout: str, n: int, dim: int, rows: int,
            rows_valid: int, vocab_size: int, n_tiles: int, num_ctas: int,
            interpret: bool):
  """One CTA: a persistent loop over vocabulary tiles (cooperative schedule).

  Refs (GMEM), with ``C = cfg.epi_cols`` and ``nc = N / C`` epilogue
  chunks: ``off_ref`` int32 [1] vocabulary offset; ``rowdata_ref`` uint32
  [nc, 8, C]: the rows of ``RowLayout(samples=1)`` for each chunk's
  columns; ``h_ref`` [N, D]; ``w_ref`` [V, D] ("vd")
  or [D, V] ("dv"), ``V = rows`` of which the first ``rows_valid`` are real
  (the rest is alignment padding, see :func:`candidates`); outputs
  ``score_ref`` f32 and ``index_ref`` int32, both
  [nc, C, n_tiles * compute_wgs] (one column per warpgroup's part of a
  tile).
  """
  del num_ctas  # nd_loop partitions the tiles over the "sm" axis.
  vt, dt = cfg.tile_v, cfg.tile_d
  n_wg = cfg.num_compute_wgs
  vw = cfg.wg_rows
  k_steps = dim // dt
  transforms = common.tma_transforms(w_ref.dtype)
  if layout == "vd":
    w_spec = plgpu.BlockSpec((vt, dt), lambda k: (0, k), transforms=transforms)
  else:
    w_spec = plgpu.BlockSpec((dt, vt), lambda k: (k, 0), transforms=transforms)
  h_spec = plgpu.BlockSpec((n, dt), lambda k: (0, k), transforms=transforms)

  def make_pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[w_spec, h_spec], wg_axis="wg", num_compute_wgs=n_wg,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context)

  epi = cfg.epi_cols
  n_chunks = n // epi
  pass_chunks = max(b - a for a, b in cfg.passes(n))

  ignore = lambda *_, **__: None
  w_view = (w_ref.at[pl.ds(0, vt), :] if layout == "vd"
            else w_ref.at[:, pl.ds(0, vt)])
  scratch_elems = wg_scratch_elems(epi)

  @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(ignore, ignore).get_allocations(w_view, h_ref),
      rowdata_smem=plgpu.SMEM((n_chunks, _ROWS.rows, epi), jnp.uint32),
      acc_smem=plgpu.SMEM((n_wg, pass_chunks, vw, epi), jnp.float32),
      red_f=plgpu.SMEM((n_wg, scratch_elems), jnp.float32),
      red_i=plgpu.SMEM((n_wg, scratch_elems), jnp.int32),
      rowdata_barrier=plgpu.Barrier(num_arrivals=1),
      collective_axes="wg")
  def _scope(allocs, rowdata_smem, acc_smem, red_f, red_i, rowdata_barrier):
    wg = lax.axis_index("wg")
    # Per-row key words, counters and temperatures, read by every epilogue:
    # GMEM loads into the column layout do not lower, SMEM ones do. The
    # first warpgroup copies; every compute warpgroup waits for the copy.
    @pl.when(wg == 0)
    def _():
      plgpu.copy_gmem_to_smem(rowdata_ref, rowdata_smem, rowdata_barrier)

    @pl.when(wg < n_wg)
    def _():
      plgpu.barrier_wait(rowdata_barrier)

    def mma_body(_, w_smem, h_smem, acc_ref):
      if n_wg == 1:
        a = w_smem if layout == "vd" else w_smem.T
      elif layout == "vd":
        a = w_smem.at[pl.ds(wg * vw, vw)]
      else:
        a = w_smem.at[:, pl.ds(wg * vw, vw)].T
      plgpu.wgmma(acc_ref, a, h_smem.T)
      # Wait for this step's wgmma before its slot is released. Keeping one
      # in flight (wgmma_wait(1) + delay_release=1, docs/design.md) is not
      # safe across our per-tile pipelines: the memory warpgroup never waits
      # for the last step's release, so the next tile's prologue could
      # overwrite the slot the last wgmma still reads.
      plgpu.wgmma_wait(0)
      return acc_ref

    @plgpu.nd_loop((n_tiles,), collective_axes="sm")
    def _tile_loop(info):
      (tile,) = info.index
      start = common.tile_start(tile, vt, rows)
      first_new = tile * vt - start  # local rows < first_new were done before
      w_tile = (w_ref.at[pl.ds(start, vt), :] if layout == "vd"
                else w_ref.at[:, pl.ds(start, vt)])

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped,
                           acc_ref=plgpu.ACC((vw, n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          _epilogue(acc_ref[...], cfg=cfg, passes=cfg.passes(n),
                    row0=wg * vw,
                    start=start, first_new=first_new, off_ref=off_ref,
                    rowdata_smem=rowdata_smem, acc_smem=acc_smem.at[wg],
                    scratch_f=red_f.at[wg], scratch_i=red_i.at[wg],
                    out_refs=(score_ref, index_ref),
                    out_row=tile * n_wg + wg, rows_valid=rows_valid,
                    vocab_size=vocab_size, interpret=interpret)

      make_pipeline(mma_body, compute_context)(w_tile, h_ref,
                                               allocations=allocs)


def _kernel_pingpong(off_ref, rowdata_ref, h_ref, w_ref, *refs,
                     cfg: TuningConfig, layout: str, n: int, dim: int,
                     rows: int, rows_valid: int, vocab_size: int, n_tiles: int,
                     num_ctas: int, interpret: bool, scale: str | None = None,
                     tile_epilogue=None, outputs: int = 2,
                     per_warpgroup: bool = False):
  """One CTA, ping-pong schedule: the compute warpgroups alternate tiles.

  Same refs as :func:`_kernel`, but one candidate column per tile
  (``[nc, C, n_tiles]``). ``tile_epilogue`` (default :func:`_epilogue`)
  reads each tile's accumulator and writes the last ``outputs`` refs
  (``out_refs``; the slot kernel, :mod:`pallas_kernels.sm90_slots`, passes
  its own). With ``scale`` (an 8-bit weight's
  :func:`~pallas_kernels.sm90_common.scale_mode`) ``scale_ref`` f32 after
  ``w_ref``, by which the accumulator is multiplied first (8-bit weights:
  ``WeightPath.REGISTERS`` for "vd", ``STAGED`` for "dv").

  The CTA owns tiles ``cta + i * num_ctas``; its memory warpgroup streams
  their ``(tile, k)`` steps in order through one ring of ``S`` SMEM slots,
  and local tile ``i`` belongs to compute warpgroup ``i % 2``. While one warpgroup runs its epilogue, the other
  consumes the stream, so neither the weight stream nor the tensor cores
  wait for the noise (docs/performance.md, "Schedules by batch size").

  Barriers: ``full[w * S + slot]`` completes when a step for warpgroup
  ``w`` has landed in ``slot`` (each warpgroup waits only on its own, so
  the implicit phase of every barrier it waits on advances exactly once
  per wait); ``empty[slot]`` is arrived by the warpgroup that consumed the
  slot, after its wgmma finished reading it, and waited on by the memory
  warpgroup before reuse. ``cfg.mma_in_flight`` wgmmas stay in flight
  across steps.

  ``per_warpgroup`` (up to ``RUNNING_CHUNKS`` chunks of columns, the
  default epilogue): each compute warpgroup keeps its best per row over its
  tiles and writes one column at the end, ``[N, 2 * num_ctas]``: no store
  per tile, and stage 2 reduces 2 candidates per CTA instead of one per
  tile (docs/performance.md, "Small batches").

  With ``epi_passes == 1`` the two warpgroups share one SMEM copy of the
  accumulator ``[N / C, Vt, C]`` (the whole of it: the epilogue then holds
  no accumulator registers and has room for ILP); ``acc_free[w]`` hands it
  to warpgroup ``w``, so the epilogues take turns. With more passes each
  warpgroup has its own buffer of one pass's columns (the later passes'
  columns wait in registers) and the epilogues of both may run at once
  (N > 128, where that measured faster than taking turns:
  docs/performance.md, "Schedules by batch size").
  """
  scale_ref = refs[0] if scale else None
  out_refs = refs[-outputs:]
  tile_epilogue = tile_epilogue or _epilogue
  epi = cfg.epi_cols
  n_chunks = n // epi
  scratch_elems = wg_scratch_elems(epi)
  shared = cfg.epi_passes == 1
  passes = [(0, n_chunks)] if shared else cfg.passes(n)
  pass_chunks = max(b - a for a, b in passes)

  def compute(*, wg, tile_loop, rowdata_smem, acc_smem, red_f, red_i,
              **scale_refs):
    def prologue(tile, start):
      del tile
      common.copy_scale_tile(scale_ref, start, cfg.tile_v, wg, **scale_refs)

    def epilogue(acc, tile, start, first_new, carry):
      s = common.tile_scale(scale, scale_ref, wg, 0, **scale_refs)
      acc = common.scaled(acc, s, 0)
      out = tile_epilogue(acc, cfg=cfg, passes=passes, row0=0, start=start,
                          first_new=first_new, off_ref=off_ref,
                          rowdata_smem=rowdata_smem,
                          acc_smem=acc_smem if shared else acc_smem.at[wg],
                          scratch_f=red_f.at[wg], scratch_i=red_i.at[wg],
                          out_refs=out_refs, out_row=tile,
                          rows_valid=rows_valid, vocab_size=vocab_size,
                          interpret=interpret,
                          **({"best": carry} if per_warpgroup else {}))
      return out if per_warpgroup else carry

    init = tuple(_no_candidate(epi) for _ in range(n_chunks)) if per_warpgroup else ()
    best = tile_loop(epilogue, init, prologue if scale == "row" else None)
    if per_warpgroup:
      column = lax.axis_index("sm") * 2 + wg
      for k, chunk_best in enumerate(best):
        for x, ref in zip(chunk_best, out_refs):
          common.store_column(x, ref.at[pl.ds(k * epi, epi), pl.ds(column, 1)],
                              interpret=interpret)

  common.pingpong_frame(
      compute, cfg=cfg, layout=layout, n=n, dim=dim, rows=rows,
      n_tiles=n_tiles, num_ctas=num_ctas, w_ref=w_ref, h_ref=h_ref,
      rowdata_ref=rowdata_ref, shared_acc=shared, interpret=interpret,
      **common.scale_scratch(scale, cfg.tile_v),
      rowdata_smem=plgpu.SMEM((n_chunks, _ROWS.rows, epi), jnp.uint32),
      acc_smem=plgpu.SMEM(((pass_chunks,) if shared else (2, pass_chunks))
                          + (cfg.tile_v, epi), jnp.float32),
      red_f=plgpu.SMEM((2, scratch_elems), jnp.float32),
      red_i=plgpu.SMEM((2, scratch_elems), jnp.int32))


def _no_candidate(cols: int):
  """``(-inf, INT_MAX)`` for each of ``cols`` columns, the start of a
  running best (layout ``WGMMA.reduce(0)``)."""
  layout = plgpu.Layout.WGMMA.reduce(0)
  return (plgpu.layout_cast(jnp.full((cols,), -jnp.inf, jnp.float32), layout),
          plgpu.layout_cast(jnp.full((cols,), rules.INT_MAX, jnp.int32), layout))


def _kernel_batch_major(off_ref, rowdata_ref, h_ref, w_ref, *refs,
                        cfg: TuningConfig, layout: str, n: int,
                        dim: int, rows: int, rows_valid: int, vocab_size: int,
                        n_tiles: int, num_ctas: int, interpret: bool,
                        scale: str | None = None):
  """One CTA, ping-pong, batch on the wgmma M side (docs/performance.md,
  "Schedules by batch size").

  ``acc[N, Vt] = H[N, :] @ W[tile].T``: rows are batch rows (16 per warp),
  columns vocabulary ids (spread over the lanes of a quad and registers),
  so the per-row argmax needs no cross-warp reduction. Each compute
  warpgroup keeps a running best ``(score, id)`` per (row, column slot)
  over the column chunks of all its tiles, and reduces the slots (inside
  each warp) once at the end: outputs ``score_ref``/``index_ref``
  [N, 2 * num_ctas], one column per compute warpgroup. ``rowdata_ref`` is
  uint32 [8, N], the rows of ``RowLayout(samples=1)``.

  Streaming, slots, barriers and the shared accumulator buffer as in
  :func:`_kernel_pingpong`; with ``cfg.epi_passes > 1`` the buffer holds
  one pass's columns (``1 / epi_passes`` of the accumulator), which leaves
  SMEM for more pipeline slots.

  With ``cfg.batch_blocks = nb > 1`` the launch holds ``nb`` blocks of N
  rows (:func:`~pallas_kernels.sm90_common.batch_block`): ``h_ref`` [nb *
  N, D], ``rowdata_ref`` [nb, 8, N], outputs [nb, N, 2 * num_ctas], and
  ``num_ctas`` is the CTAs of one block.

  With ``scale``, ``scale_ref`` follows ``w_ref`` (as in
  :func:`_kernel_pingpong`; an 8-bit weight is ``WeightPath.STAGED``).
  """
  scale_ref = refs[0] if scale else None
  score_ref, index_ref = refs[-2:]
  vt = cfg.tile_v
  epi = cfg.epi_cols
  n_chunks = vt // epi
  per_pass = n_chunks // cfg.epi_passes
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  cta, h_ref, (rowdata_ref, score_ref, index_ref) = common.batch_block(
      cfg.batch_blocks, n, h_ref, rowdata_ref, score_ref, index_ref)

  def compute(*, wg, tile_loop, rowdata_smem, acc_smem, **scale_refs):
    rl = _ROWS
    bcast = lambda x: lax.broadcast_in_dim(x, (n, epi), (0,))
    row = lambda i: bcast(plgpu.load(rowdata_smem.at[i], layout=row_layout))
    log = common.noise_log(interpret)
    col = plgpu.broadcasted_iota(jnp.int32, (n, epi), 1, layout=wgmma_layout)
    off = off_ref[0]

    def row_data():
      # Read from SMEM in each tile's epilogue, not once before the tile
      # loop: held across the loop, these rows stay live next to the
      # accumulator during the wgmma (128 registers a thread at N = 128),
      # which spilled on jax 0.12 (docs/design.md, "Mosaic GPU facts").
      k0, k1 = row(rl.K0), row(rl.K1)
      c_hi, c_lo = (row(i) for i in rl.ctr(0))
      f32 = lambda i: lax.bitcast_convert_type(row(i), jnp.float32)
      greedy, t_safe = rules.split_temperature(f32(rl.TEMPERATURE))
      inv_t, zero = f32(rl.INV_TEMPERATURE), row(rl.zero)
      return k0, k1, c_hi, c_lo, t_safe, inv_t, zero, rules.noise_scale(greedy)

    def chunk(slot, c, base, first_id, span, rd, best):
      k0, k1, c_hi, c_lo, t_safe, inv_t, zero, noise_scale = rd
      l = plgpu.load(acc_smem.at[slot], layout=wgmma_layout)
      gid = col + (base + c * epi)
      valid = common.valid_id(gid, first_id, span)
      hi, lo = threefry.add_u32(c_hi, c_lo, gid.astype(jnp.uint32))
      g = threefry.gumbel(k0, k1, hi, lo, log=log)
      t = common.tempered(l, t_safe, inv_t, zero, interpret=interpret)
      sc = jnp.where(valid, t + g * noise_scale, -jnp.inf)
      return _slot_update(best, sc, gid)

    def prologue(tile, start):
      del tile
      common.copy_scale_tile(scale_ref, start, vt, wg, **scale_refs)

    def epilogue(acc, tile, start, first_new, best):
      del tile
      s = common.tile_scale(scale, scale_ref, wg, 1, **scale_refs)
      acc = common.scaled(acc, s, 1)
      ids = common.tile_ids(off, start, first_new, rows_valid, vocab_size)
      rd = row_data()
      # In passes, the columns of later passes wait in registers. Each
      # thread reads back only what it stored (the same layout both ways),
      # so a pass may overwrite the buffer without a barrier.
      for first in range(0, n_chunks, per_pass):
        for c in range(per_pass):
          acc_smem[c] = acc[:, (first + c) * epi:(first + c + 1) * epi]

        def body(it, best, first=first):
          for u in range(cfg.epi_unroll):
            slot = it * cfg.epi_unroll + u
            best = chunk(slot, first + slot, *ids, rd, best)
          return best

        best = lax.fori_loop(0, per_pass // cfg.epi_unroll, body, best)
      return best

    init = (plgpu.layout_cast(jnp.full((n, epi), -jnp.inf, jnp.float32),
                              wgmma_layout),
            plgpu.layout_cast(jnp.full((n, epi), rules.INT_MAX, jnp.int32),
                              wgmma_layout))
    best_s, best_i = tile_loop(epilogue, init,
                               prologue if scale == "row" else None)
    # Reduce the column slots inside each warp (axis 1: lanes of a quad
    # and registers, no shared scratch, so trap 1 does not apply).
    m, idx = rules.first_best(best_s, best_i, 1)
    out = cta * 2 + wg
    put = functools.partial(common.store_column, interpret=interpret, axis=1)
    put(m, score_ref.at[:, pl.ds(out, 1)])
    put(idx, index_ref.at[:, pl.ds(out, 1)])

  common.pingpong_frame(
      compute, cfg=cfg, layout=layout, n=n, dim=dim, rows=rows,
      n_tiles=n_tiles, num_ctas=num_ctas, w_ref=w_ref, h_ref=h_ref,
      rowdata_ref=rowdata_ref, cta=cta, interpret=interpret,
      rowdata_smem=plgpu.SMEM((_ROWS.rows, n), jnp.uint32),
      acc_smem=plgpu.SMEM((per_pass, n, epi), jnp.float32),
      **common.scale_scratch(scale, vt))


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def _launch(offset, rowdata, h, w, scale=None, *, cfg: TuningConfig, layout: str,
            rows_valid: int, vocab_size: int, target: common.Target,
            scale_mode: str | None = None, tile_epilogue=None,
            out_dtypes=(jnp.float32, jnp.int32), kernel_name: str = "flashsample_sm90"):
  """Runs the kernel on one batch chunk (``h`` [N * batch_blocks, D], N <=
  256 padded; ``rowdata`` [batch_blocks, 8, N] when batch_blocks > 1;
  ``scale``, ``scale_mode``: an 8-bit weight's :func:`~pallas_kernels.
  sm90_common.scale_operand`, or None). ``tile_epilogue`` and
  ``out_dtypes``: another epilogue of the vocabulary-major ping-pong
  schedule and its outputs (:func:`_kernel_pingpong`).

  Returns one array per ``out_dtypes`` (default ``(score, index)``), each
  ``[N * batch_blocks, n_out]``: each row's candidates (one per tile or per
  compute warpgroup) along the minor axis.
  """
  nb = cfg.batch_blocks
  n, dim = h.shape[0] // nb, h.shape[1]
  rows = w.shape[0] if layout == "vd" else w.shape[1]
  n_tiles = -(-rows // cfg.tile_v)
  w_itemsize = jnp.dtype(w.dtype).itemsize
  path = weight_path(cfg.schedule, layout, w_itemsize)
  cfg.check_problem(n=n, dim=dim, rows=rows, itemsize=h.dtype.itemsize,
                    w_itemsize=w_itemsize, staged=path is WeightPath.STAGED)
  if path is WeightPath.REGISTERS:
    # The converted tile's columns come in permute_k's order: H's too.
    h = common.permute_k(h, 1)
  mode = scale_mode
  # With batch blocks, num_ctas counts the CTAs of one block.
  num_ctas = target.grid_ctas(cfg, n_tiles)
  kernel = _KERNELS[cfg.schedule]
  body = functools.partial(kernel, cfg=cfg, layout=layout, n=n, dim=dim,
                           rows=rows, rows_valid=rows_valid,
                           vocab_size=vocab_size, n_tiles=n_tiles,
                           num_ctas=num_ctas,
                           interpret=target.interpret is not None,
                           **({"scale": mode} if mode else {}))
  if tile_epilogue is not None:
    if cfg.schedule is not Schedule.PINGPONG_VOCAB_M:
      raise ValueError(f"a tile epilogue needs the vocabulary-major ping-pong schedule, "
                       f"got {cfg.schedule}")
    body = functools.partial(body, tile_epilogue=tile_epilogue, outputs=len(out_dtypes))
  per_wg = tile_epilogue is None and per_warpgroup(cfg, n)
  if per_wg:
    body = functools.partial(body, per_warpgroup=True)
  # Candidates on the minor axis (each store is a strided column): stage 2
  # is then one row reduction, which XLA runs as one kernel; over the major
  # axis it took three (max, select, min; docs/performance.md, "The exact
  # path's conditional").
  if cfg.schedule.batch_major or per_wg:  # one candidate per compute warpgroup
    n_out = 2 * num_ctas
    shape = (nb, n, n_out) if nb > 1 else (n, n_out)
  else:  # one per tile (or per warpgroup's part of a tile)
    n_out = n_tiles * cfg.wg_share
    shape = (n // cfg.epi_cols, cfg.epi_cols, n_out)
  out_type = tuple(jax.ShapeDtypeStruct(shape, d) for d in out_dtypes)
  f = plgpu.kernel(
      body, out_type=out_type, grid=(num_ctas * nb,), grid_names=("sm",),
      num_threads=cfg.num_compute_wgs + 1, thread_name="wg",
      kernel_name=kernel_name,  # the name profilers show
      compiler_params=target.compiler_params(),
      interpret=target.interpret)
  outs = f(offset, rowdata, h, w, *(() if scale is None else (scale,)))
  return tuple(o.reshape(nb * n, n_out) for o in outs)


# Chunks of epilogue columns a launch keeps a running best for: each holds
# 8 registers a thread through the tile loop, so only the small batch sides
# (the heuristic's launches of up to 48 rows: 3 chunks of 16).
RUNNING_CHUNKS = 3


def per_warpgroup(cfg: TuningConfig, n: int) -> bool:
  """Whether a plain launch of batch side ``n`` keeps one candidate per
  compute warpgroup (a running best over its tiles) instead of one per
  tile: the vocabulary-major ping-pong schedule with at most
  ``RUNNING_CHUNKS`` chunks of columns (the heuristic's launches of up to
  48 rows)."""
  return (cfg.schedule is Schedule.PINGPONG_VOCAB_M
          and n // cfg.epi_cols <= RUNNING_CHUNKS)


_KERNELS = {
    Schedule.COOPERATIVE: _kernel,
    Schedule.PINGPONG_VOCAB_M: _kernel_pingpong,
    Schedule.PINGPONG_BATCH_M: _kernel_batch_major,
}


def launches(batch: int, dim: int, rows: int, itemsize: int,
             config: TuningConfig | None = None, w_itemsize: int | None = None,
             layout: str = "vd"):
  """``[(b0, b1, cfg, n), ...]``: the launches for ``batch`` rows, each
  with its config and its (per-block) batch side ``n``.

  The heuristic's launches: up to ``BLOCKED_MIN_ROWS - 1`` rows, one
  launch (:func:`pick_config`); more, launches of up to ``MAX_BLOCKS``
  blocks of 128 rows (:func:`pick_blocked_config`), one pass over W each.
  A given ``config`` runs every launch; with ``batch_blocks = nb > 1`` one
  launch takes up to ``nb x 128`` rows in nb equal blocks (each a multiple
  of 64 rows), else launches cover :func:`batch_chunks` of up to 256 rows.
  ``itemsize``/``w_itemsize``: H's and W's bytes per element (see
  :func:`pick_config`).
  """
  cfg_args = dict(w_itemsize=w_itemsize, layout=layout)
  if config is None and batch >= BLOCKED_MIN_ROWS and rows >= 128:
    out = []
    step = BLOCK_ROWS * MAX_BLOCKS
    for b0 in range(0, batch, step):
      b1 = min(batch, b0 + step)
      if b1 - b0 < BLOCKED_MIN_ROWS:  # a short tail: one launch of its own
        out += [(b0 + a, b0 + b, c, k) for a, b, c, k in
                launches(b1 - b0, dim, rows, itemsize, None, **cfg_args)]
      else:
        out.append((b0, b1, pick_blocked_config(b1 - b0, dim, rows, itemsize,
                                                **cfg_args), BLOCK_ROWS))
    return out
  if config is not None and config.batch_blocks > 1:
    nb = config.batch_blocks
    per = -(-batch // nb)
    n = config.batch_pad(batch_side(min(per, BLOCK_ROWS)))
    step = min(batch, n * nb)
    return [(b0, min(batch, b0 + step), config, n) for b0 in range(0, batch, step)]
  out = []
  for b0, b1 in batch_chunks(batch):
    n = batch_side(b1 - b0)
    cfg = config or pick_config(n, dim, rows, itemsize, **cfg_args)
    out.append((b0, b1, cfg, cfg.batch_pad(n)))
  return out


def candidates(hidden, weight, rows, vocab_offset=0, *, layout: str,
               vocab_size: int, config: TuningConfig | None = None,
               target: common.Target = common.Target(), scale=None):
  """Best ``(score, global id)`` of each row over the weight's rows.

  Args:
    hidden: ``[B, D]`` bf16/f16: the weight's dtype, or for an 8-bit
      weight the dtype of the MMA (the 8-bit values convert to it exactly).
    weight: ``[V, D]`` (``layout="vd"``) or ``[D, V]`` (``"dv"``); any V
      (padded here for TMA where needed, see
      :func:`~pallas_kernels.sm90_common.pad_vocab`), D a multiple of 64.
      bf16/f16, or 8-bit (``float8_e4m3fn``, ``float8_e5m2``, ``int8``:
      streamed as they are, converted on chip; the ping-pong schedules,
      i.e. at least 128 rows).
    rows: uint32 ``[8, B]``, the per-row block of
      :func:`~pallas_kernels.rowdata.pack_rows` with one sample.
    vocab_offset: global id of the weight's first row (an int or a traced
      int32 scalar, e.g. a shard's offset inside ``shard_map``).
    layout: ``"vd"`` or ``"dv"``.
    vocab_size: ids at or above it get ``-inf`` (global ids).
    config: a config for every launch instead of the heuristic's (tests,
      benchmarks).
    target: where the kernels run (the GPU or interpret mode).
    scale: with an 8-bit weight, None, an f32 scalar (per tensor) or f32
      ``[V]`` (per row of this weight): the logits are the f32 dot product
      times it (one f32 multiply, before everything else).

  Returns:
    ``(score f32 [B], id int32 [B])``: sampled rows ``l / T + gumbel``,
    greedy rows ``l``, maximal by the tie rule; ``(-inf, INT_MAX)`` for a
    row with no valid id.
  """
  offset = jnp.asarray(vocab_offset, jnp.int32).reshape((1,))
  n_rows = weight.shape[0 if layout == "vd" else 1]
  w_itemsize = jnp.dtype(weight.dtype).itemsize
  w, rows_k = common.pad_vocab(weight, layout, common.vocab_align(weight.dtype, layout))
  scale, mode = common.scale_operand(scale, rows_k)
  batch, dim = hidden.shape
  itemsize = jnp.dtype(hidden.dtype).itemsize
  scores, tokens = [], []
  for b0, b1, cfg, n in launches(batch, dim, rows_k, itemsize, config,
                                 w_itemsize=w_itemsize, layout=layout):
    nb = b1 - b0
    blocks = cfg.batch_blocks
    rowdata = jnp.pad(rows[:, b0:b1], [(0, 0), (0, n * blocks - nb)])
    if blocks > 1:  # [8, nb * N] -> [nb, 8, N]: one block per CTA group
      rowdata = rowdata.reshape(_ROWS.rows, blocks, n).transpose(1, 0, 2)
    elif not cfg.schedule.batch_major:
      # [8, N] -> [nc, 8, C]: one contiguous block per epilogue chunk.
      rowdata = rowdata.reshape(_ROWS.rows, n // cfg.epi_cols, cfg.epi_cols)
      rowdata = rowdata.transpose(1, 0, 2)
    h = jnp.pad(hidden[b0:b1], [(0, n * blocks - nb), (0, 0)])
    s, i = _launch(offset, rowdata, h, w, scale, scale_mode=mode, cfg=cfg,
                   layout=layout, rows_valid=n_rows, vocab_size=vocab_size,
                   target=target)
    s, i = rules.argbest(s[:nb], i[:nb], axis=1)
    scores.append(s)
    tokens.append(i)
  if len(scores) == 1:
    return scores[0], tokens[0]
  return jnp.concatenate(scores), jnp.concatenate(tokens)
