"""Sampling controls in the fused Mosaic GPU kernel (sm90).

The kernel is the batch-major ping-pong of :mod:`pallas_kernels.sm90_sampler`
(:func:`~pallas_kernels.sm90_common.pingpong_frame`
``acc[N, Vt] = H @ W_tile.T``, blocks of N = 64 batch rows, or 128 for B > 64
without truncation and with one sample (:data:`BATCH_WIDE`), two compute
warpgroups alternating tiles; a launch's blocks split its CTAs and share
each weight tile through L2) with a longer epilogue. A batch-invariant
call (``controls_state(..., batch_invariant=True)``) runs each block split
over the vocabulary as one block alone is (:func:`_fixed_split`), with one
epilogue for every B and every call (with the default ``invariant_rows``),
the 128-row blocks' chunks of 8 columns: without lists and with one sample
in 128-row blocks past B = 64 and 64-row ones up to it, else in 64-row
blocks (:func:`_block_rows`).
Per element, in the
order of the package's controls (``flashsample_jax.controls``)::

    x = l                                   f32 accumulator
    x = c * tanh(x / c)                     softcap
    x = x + bias[gid]                       logit_bias (per-tile SMEM copy)
    x = penalized x                         penalties (history bit-planes)
    x = -inf unless allowed[row, gid]       allowed_mask (a bit-plane)
    t = x / T                               (greedy rows: T = 1)
    score_s = t + gumbel(key, ctr_s + gid)  per sample s (greedy: x)

and per (batch row, column slot) of each warpgroup's registers it carries:

* the best ``(score, id, t)`` of every sample (the combine rule);
* an online log-sum-exp ``(max, sum exp(t - max))`` of ``t``, one ``exp``
  per element (for log-probabilities and the top-p normalizer);
* with candidate lists (for top-k / top-p / min-p or the top-N
  log-probabilities), the ``_SLOT_DEPTH`` largest ``t`` with their ids, a
  sorted list updated by compare-and-select.

After its last tile each warpgroup reduces its slots inside each warp: the
best of every sample, the row's log-sum-exp, and its ``K`` (:func:`_wg_candidates`)
largest ``t`` (popped from the slot lists), plus a bound: no value of the
row that the warpgroup saw and did not list is larger than it (the largest
value that fell off a full slot list, or the next one after the popped).
:func:`controls_state` merges the warpgroups' outputs into one
:class:`~pallas_kernels.state.ControlsState` per row, the form that the
package's stage 2 finishes for every backend (it decides truncated rows on
the top candidates; a row whose kept set is not certified, because a list
overflowed above the threshold or a nucleus is wider than the candidates,
takes the exact materialized path).

Bias and bit-plane tiles are copied to SMEM by TMA, issued by the compute
warpgroup before its tile's wgmma (so their latency hides under the weight
stream). The bit-planes hold one bit per (row, id): the allowed mask, and
for penalties each row's history (:class:`~pallas_kernels.rowdata.Penalties`:
whether the id is in the prompt or the output, and the bits of its count
in the output). They are passed transposed, ``[rows / 32, planes, N]``: a
chunk of 16 columns lies in one 32-id word of each plane, one word per
batch row. A penalty's division is XLA's (:func:`~pallas_kernels.sm90_common.divided`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import rules, sm90_common as common, sm90_top, threefry
from pallas_kernels.rowdata import Penalties, RowLayout
from pallas_kernels.state import ControlsState, lse_parts, pair_lists, parts_sum, top_m
from pallas_kernels.sm90_config import (
    ROWDATA_ROWS, Schedule, TuningConfig, WeightPath, most_steps, weight_path)

__all__ = ["controls_state", "config", "BATCH", "BATCH_WIDE",
           "MAX_KERNEL_SAMPLES"]

# Batch rows per launch (the wgmma M side of one warpgroup).
BATCH = 64
# Rows per launch for B > BATCH when no candidate lists and one sample ask
# for little per-element state: [128, 8] epilogue chunks keep the state's
# registers those of [64, 16] ones next to an accumulator twice as large
# (the candidate lists or more samples would not fit beside it), and each
# pass over W serves twice the rows (docs/performance.md, "The controls
# kernel").
BATCH_WIDE = 128
# Largest tempered logits kept per (row, column slot) of a warpgroup's
# registers; a slot covers about V / (2 * SMs * 16) ids (~36 for V = 152k).
_SLOT_DEPTH = 4
# Candidates per row that each warpgroup writes out (popped from its slots);
# stage 2 pairs each CTA's two lists into one of 7 (state.pair_lists): 132 CTAs x
# 7 = 924 >> the 128 candidates it keeps, and <= 1024, so XLA's bitonic sort
# of them runs 55 compare-exchange steps, not the 66 of 1056 (8 per list,
# padded to 2048). A CTA holds ~V / 132 ids (~1150 at V = 152k): more than 7
# of a row's top 50 in one has P ~ 1e-6 per row, of its top 128 P ~ 1e-3;
# such a row takes the exact path only if its kept set reaches that deep.
_WG_CANDIDATES = 7
# Samples per launch; more take further launches (each re-reads W).
MAX_KERNEL_SAMPLES = 4
# Batch blocks of one launch (TuningConfig.batch_blocks): rows beyond
# MAX_BLOCKS x N take further launches. With candidate lists at most
# MAX_LIST_BLOCKS: nb blocks leave each CTA nb times the ids, so a row's
# kept set crowds into one CTA's list (and one slot's) more often; the lists
# grow with nb (_wg_candidates), and past 4 blocks they would miss one of a
# row's top 50 on 1e-5 to 1e-3 of the rows (each such row takes the exact
# path; docs/design.md, "Performance: how it is measured").
MAX_BLOCKS = 16
MAX_LIST_BLOCKS = 4


def _wg_candidates(blocks: int) -> int:
  """Candidates per warpgroup (K) for a launch of ``blocks`` batch blocks:
  the smallest K for which a CTA pair's list (K after :func:`~pallas_kernels.state.pair_lists`)
  misses one of a row's top 50 with P < 2e-6 per row, for 132 / nb CTAs per
  block (binomial tail: K = 7, 9, 11, 11 for nb = 1 .. 4). Measured: with
  K = 7 at nb = 4, 1 row in 256 took the exact path (docs/performance.md,
  "The controls kernel")."""
  return _WG_CANDIDATES + 2 * min(2, blocks - 1)
# Tile starts are multiples of 32 (the rows are padded to it), so a 16-wide
# column chunk lies in one word of the allowed mask.
_ROW_ALIGN = 32
_EPI = 16


@dataclasses.dataclass(frozen=True)
class Spec:
  """What one launch computes (static)."""

  samples: int
  softcap: bool = False
  bias: bool = False
  mask: bool = False         # bit-plane 0 is the allowed mask
  penalties: Penalties | None = None   # the history planes after it
  lse: bool = False          # online log-sum-exp
  lists: bool = False    # candidate lists (truncation or top-N)
  t_best: bool = False       # t of each sample's best (log-probabilities)
  noise: bool = True         # False: each row's best is the argmax of x
  candidates: int = 7        # listed per warpgroup (_wg_candidates)
  # Write every element's t to GMEM; nothing runs unless the launch's flag
  # is set (exact_top: the rows of the exact top N, rarely needed).
  materialize: bool = False
  # An 8-bit weight's scale (sm90_common.scale_mode): None, "tensor", "row".
  scale: str | None = None
  # The RL fields (ControlsState.ent_sum, raw_max / raw_sum, finite_count):
  # the entropy terms relative to the log-sum-exp's max (needs lse), an
  # online log-sum-exp of the raw logits, the count of finite t.
  entropy: bool = False
  raw: bool = False
  finite: bool = False
  # The t of each row's given id (ControlsState.given_t; the id in the
  # per-row data's given row): for scoring given tokens.
  given: bool = False

  @property
  def f_rows(self) -> int:
    """f32 outputs per warpgroup: scores, t of the best, lse max and sum,
    bound, candidates, then the entropy terms, the raw lse's max and sum
    and the given id's t where asked for (:attr:`f_rl`)."""
    return self.f_given + int(self.given)

  @property
  def f_given(self) -> int:
    """The f32 row of the given id's t."""
    return self.f_rl + int(self.entropy) + 2 * int(self.raw)

  @property
  def f_rl(self) -> int:
    """The first f32 row of the RL fields."""
    return 2 * self.samples + 3 + (self.candidates if self.lists else 0)

  @property
  def i_rows(self) -> int:
    """int32 outputs per warpgroup: ids, list ids, then the finite count."""
    return self.samples + (self.candidates if self.lists else 0) + int(self.finite)

  @property
  def planes(self) -> int:
    """Bit-planes per tile: the mask's, then the penalties'."""
    return int(self.mask) + (self.penalties.planes if self.penalties else 0)

  @property
  def rows(self) -> RowLayout:
    return RowLayout(samples=self.samples, penalties=self.penalties is not None,
                     given=self.given)


def config(dim: int, rows: int, itemsize: int = 2, n: int = BATCH,
           planes: int = 1, row_rows: int = 16,
           w_itemsize: int | None = None, wide_epilogue: bool = False) -> TuningConfig:
  """The launch config for ``n`` rows per launch: batch-major ping-pong,
  tiles of 128 (64 when the weight has fewer rows). N = 64: chunks of
  [64, 16], Dt = 128 when D allows, one wgmma in flight. N = 128: chunks of
  [128, 8], Dt = 64, each slot released at once (the plain kernel's N = 128
  settings). As many slots as fit next to the bias tiles, ``planes``
  bit-plane tiles and a per-row block of ``row_rows`` rows (>= 2).
  ``itemsize``/``w_itemsize``: H's and W's bytes per element; an 8-bit
  weight is staged (``WeightPath.STAGED``: no wgmma in flight).
  ``wide_epilogue``: N = 64 with N = 128's chunks of 8 columns, so that a
  row's column slots are those of a 128-row block (:func:`_block_rows`).
  A bf16 / f16 weight keeps N = 64's Dt and wgmma in flight: the
  accumulator sums the same k16 products in the same order at either Dt
  (docs/performance.md, "RL outputs and batch invariance"); an 8-bit one
  takes N = 128's Dt = 64."""
  tile_v = 128 if rows >= 128 else 64
  staged = w_itemsize == 1
  wide_k = n > BATCH or (wide_epilogue and staged)
  tile_d = 128 if dim % 128 == 0 and not wide_k else 64
  cfg = TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=tile_v,
                     tile_d=tile_d, max_concurrent_steps=2,
                     epi_cols=8 if n > BATCH or wide_epilogue else _EPI,
                     mma_in_flight=0 if n > BATCH or staged else 1)
  aux = (2 * tile_v * 4 + 2 * (tile_v // 32) * planes * n * 4
         + (row_rows - ROWDATA_ROWS) * n * 4)
  steps = most_steps(cfg, n, itemsize, w_itemsize, staged, extra=aux)
  return dataclasses.replace(cfg, max_concurrent_steps=max(2, steps))


def _kernel(off_ref, rowdata_ref, h_ref, w_ref, *refs, cfg, spec: Spec,
            layout: str, n: int, dim: int, rows: int, rows_valid: int,
            vocab_size: int, n_tiles: int, num_ctas: int, interpret: bool):
  """One CTA of the controls kernel (see the module docstring).

  Refs: ``rowdata_ref`` uint32 ``[spec.rows.rows, N]`` (``RowLayout``);
  with ``spec.scale`` ``scale_ref`` f32 (an 8-bit weight's scale, by which
  the accumulator is multiplied first; the weight is ``WeightPath.STAGED``);
  optional ``bias_ref`` f32 ``[rows / C, C]`` (``C = cfg.epi_cols``) and
  ``planes_ref`` uint32 ``[rows / 32, spec.planes, N]``; with ``spec.materialize`` ``active_ref``
  int32 ``[1]`` (0: the CTA does nothing); outputs ``f_ref`` f32 ``[N,
  spec.f_rows, 2 * num_ctas]`` and ``i_ref`` int32 ``[N, spec.i_rows, 2 *
  num_ctas]``, one column per compute warpgroup, and with
  ``spec.materialize`` ``t_ref`` f32 ``[N, >= rows]``: every element's t.
  """
  refs = list(refs)
  scale_ref = refs.pop(0) if spec.scale else None
  bias_ref = refs.pop(0) if spec.bias else None
  planes_ref = refs.pop(0) if spec.planes else None
  active_ref = refs.pop(0) if spec.materialize else None
  t_ref = refs.pop() if spec.materialize else None
  f_ref, i_ref = refs
  # Batch blocks (cfg.batch_blocks > 1): the per-row refs hold nb blocks of
  # N rows; this CTA serves one (sm90_common.batch_block).
  per_block = ((rowdata_ref, f_ref, i_ref) + ((planes_ref,) if spec.planes else ())
               + ((t_ref,) if spec.materialize else ()))
  cta, h_ref, per_block = common.batch_block(cfg.batch_blocks, n, h_ref, *per_block)
  rowdata_ref, f_ref, i_ref = per_block[:3]
  planes_ref = per_block[3] if spec.planes else None
  t_ref = per_block[-1] if spec.materialize else None
  vt, epi = cfg.tile_v, cfg.epi_cols
  n_chunks = vt // epi
  words = vt // 32
  S = spec.samples
  pen = spec.penalties
  wgmma = plgpu.Layout.WGMMA
  row_layout = wgmma.reduce(1)
  col_layout = wgmma.reduce(0)
  n_aux = int(spec.bias) + int(spec.planes > 0)
  aux = {}
  if spec.bias:
    aux["bias_smem"] = plgpu.SMEM((2, n_chunks, epi), jnp.float32)
  if spec.planes:
    aux["planes_smem"] = plgpu.SMEM((2, words, spec.planes, n), jnp.uint32)
  if n_aux:
    aux["aux_bar"] = plgpu.Barrier(num_arrivals=n_aux, num_barriers=2)
  aux.update(common.scale_scratch(spec.scale, vt))

  def compute(*, wg, tile_loop, rowdata_smem, acc_smem, bias_smem=None,
              planes_smem=None, aux_bar=None, **scale_refs):
    rl = spec.rows
    bcast = lambda x: lax.broadcast_in_dim(x, (n, epi), (0,))
    row = lambda i: bcast(plgpu.load(rowdata_smem.at[i], layout=row_layout))
    f32 = lambda x: lax.bitcast_convert_type(x, jnp.float32)
    col = plgpu.broadcasted_iota(jnp.int32, (n, epi), 1, layout=wgmma)
    off = off_ref[0]
    log = common.noise_log(interpret)

    def row_values():
      # Read from SMEM in each tile's epilogue, not once before the tile
      # loop, so that they are not live next to the accumulator during the
      # wgmma (as in sm90_sampler; docs/design.md, "Mosaic GPU facts").
      greedy, t_safe = rules.split_temperature(f32(row(rl.TEMPERATURE)))
      return dict(
          k0=row(rl.K0), k1=row(rl.K1), t_safe=t_safe,
          inv_t=f32(row(rl.INV_TEMPERATURE)), zero=row(rl.zero),
          cap=f32(row(rl.SOFTCAP)) if spec.softcap else None,
          ctr=[tuple(row(i) for i in rl.ctr(s)) for s in range(S)],
          pen=tuple(f32(row(i)) for i in rl.penalty_rows) if pen else None,
          given=(lax.bitcast_convert_type(row(rl.given_row), jnp.int32)
                 if spec.given else None),
          noise_scale=rules.noise_scale(greedy))

    def prologue(tile, start):
      del tile
      if spec.scale == "row":
        common.copy_scale_tile(scale_ref, start, vt, wg, **scale_refs)
      if spec.bias:
        plgpu.copy_gmem_to_smem(bias_ref.at[pl.ds(start // epi, n_chunks)],
                                bias_smem.at[wg], aux_bar.at[wg])
      if spec.planes:
        plgpu.copy_gmem_to_smem(planes_ref.at[pl.ds(start // 32, words)],
                                planes_smem.at[wg], aux_bar.at[wg])

    def chunk(c, ids, rv, state):
      best, lse, lists, rl = state
      base, first_id, span = ids
      k0, k1, t_safe, inv_t, zero, cap = (rv[k] for k in (
          "k0", "k1", "t_safe", "inv_t", "zero", "cap"))
      ctr, noise_scale = rv["ctr"], rv["noise_scale"]
      # A product or sum whose next op XLA rounds separately (not an fma).
      rnd = (lambda v: v) if interpret else (lambda v: common.rounded(v, zero))
      l = plgpu.load(acc_smem.at[c], layout=wgmma)
      gid = col + (base + c * epi)
      valid = common.valid_id(gid, first_id, span)
      x = l
      if spec.softcap:
        x = cap * jnp.tanh(x / cap)
      # The raw logits (vLLM's "raw"): soft-capped, no bias, penalty, mask
      # or temperature; -inf only past the valid ids (controls.raw_logits).
      raw = jnp.where(valid, x, -jnp.inf) if spec.raw else None
      if spec.bias:
        b = plgpu.load(bias_smem.at[wg, c], layout=col_layout)
        x = x + lax.broadcast_in_dim(b, (n, epi), (1,))
      if spec.planes:
        shift = (col + (c * epi) % 32).astype(jnp.uint32)

        def bit(plane):   # uint32 0 / 1: this element's bit of the plane
          word = bcast(plgpu.load(planes_smem.at[wg, (c * epi) // 32, plane],
                                  layout=row_layout))
          return (word >> shift) & jnp.uint32(1)
      if pen:
        x = _penalized(x, bit, int(spec.mask), pen, *rv["pen"],
                       rnd=rnd, divide=lambda a, d, inv: common.divided(
                           a, d, inv, zero, interpret=interpret))
      if spec.mask:
        valid = valid & (bit(0) == 1)
      x = jnp.where(valid, x, -jnp.inf)
      t = common.tempered(x, t_safe, inv_t, zero, interpret=interpret)
      if spec.materialize:   # local columns: the tile's start is base - off
        common.store_tile(t, t_ref.at[:, pl.ds(base - off + c * epi, epi)],
                          interpret=interpret)
      idx = jnp.where(valid, gid, rules.INT_MAX)
      gid_u = gid.astype(jnp.uint32)
      new_best = []
      for (c_hi, c_lo), b in zip(ctr, best):
        if spec.noise:
          hi, lo = threefry.add_u32(c_hi, c_lo, gid_u)
          g = threefry.gumbel(k0, k1, hi, lo, log=log)
          sc = t + g * noise_scale   # greedy rows: x
          sc = jnp.where(valid, sc, -jnp.inf)
        else:  # no noise: x is already -inf where not valid
          sc = x
        take = rules.better(sc, idx, b[0], b[1])
        nb = (jnp.where(take, sc, b[0]), jnp.where(take, idx, b[1]))
        if spec.t_best:
          nb += (jnp.where(take, t, b[2]),)
        new_best.append(nb)
      ent, raw_lse, cnt, given_t = rl
      if spec.lse:
        m, total = lse
        lse, a, e = _online_lse(lse, t, interpret)
        if spec.entropy:
          ent = _online_entropy(ent, t, m, total, a, e)
      if spec.raw:
        raw_lse, _, _ = _online_lse(raw_lse, raw, interpret)
      if spec.finite:
        cnt = cnt + (t > -jnp.inf).astype(jnp.int32)
      if spec.given:   # ids seen by an earlier tile are not valid here
        given_t = jnp.where(valid & (gid == rv["given"]), t, given_t)
      rl = (ent, raw_lse, cnt, given_t)
      if spec.lists:
        # Sorted insertion into each slot's list (strict >: NaN and -inf
        # never enter; an equal value goes after the earlier one).
        vals, ids = lists[:_SLOT_DEPTH], lists[_SLOT_DEPTH:2 * _SLOT_DEPTH]
        gt = [t > v for v in vals]
        nv, ni = [], []
        for j in range(_SLOT_DEPTH):
          if j == 0:
            nv.append(jnp.where(gt[0], t, vals[0]))
            ni.append(jnp.where(gt[0], gid, ids[0]))
          else:
            nv.append(jnp.where(gt[j - 1], vals[j - 1], jnp.where(gt[j], t, vals[j])))
            ni.append(jnp.where(gt[j - 1], ids[j - 1], jnp.where(gt[j], gid, ids[j])))
        # The value that falls off the list (t itself, or the last entry t
        # displaces; -inf while the list has room): the bound is the
        # largest of them, not the last entry of every full list, which
        # would leave a row whose top values fill a slot exactly
        # uncertified (docs/performance.md, "The controls kernel").
        # A NaN t makes the bound NaN: such a row's log-sum-exp is NaN too,
        # and stage 2 sends it to the exact path on that.
        fell = jnp.minimum(t, vals[-1])
        lists = tuple(nv) + tuple(ni) + (jnp.maximum(lists[-1], fell),)
      return tuple(new_best), lse, lists, rl

    def epilogue(acc, tile, start, first_new, state):
      del tile
      s = common.tile_scale(spec.scale, scale_ref, wg, 1, **scale_refs)
      acc = common.scaled(acc, s, 1)
      for c in range(n_chunks):
        acc_smem[c] = acc[:, c * epi:(c + 1) * epi]
      if n_aux:
        plgpu.barrier_wait(aux_bar.at[wg])
      # Materialized rows keep the ids an earlier tile saw too (the same t
      # written twice), not -inf over them.
      ids = common.tile_ids(off, start, 0 if spec.materialize else first_new,
                            rows_valid, vocab_size)
      rv = row_values()
      return lax.fori_loop(0, n_chunks, lambda c, st: chunk(c, ids, rv, st), state)

    full = lambda v, dtype: plgpu.layout_cast(jnp.full((n, epi), v, dtype), wgmma)
    neg = lambda: full(-jnp.inf, jnp.float32)
    big = lambda: full(rules.INT_MAX, jnp.int32)
    best0 = tuple((neg(), big()) + ((neg(),) if spec.t_best else ())
                  for _ in range(S))
    lse0 = (neg(), full(0.0, jnp.float32)) if spec.lse else ()
    lists0 = (tuple(neg() for _ in range(_SLOT_DEPTH))
              + tuple(big() for _ in range(_SLOT_DEPTH)) + (neg(),)) if spec.lists else ()
    rl0 = (full(0.0, jnp.float32) if spec.entropy else (),
           (neg(), full(0.0, jnp.float32)) if spec.raw else (),
           full(0, jnp.int32) if spec.finite else (),
           neg() if spec.given else ())
    best, lse, lists, rl = tile_loop(epilogue, (best0, lse0, lists0, rl0),
                                     prologue if n_aux or spec.scale == "row" else None)

    # Reduce the column slots inside each warp (no shared scratch).
    out = cta * 2 + wg

    def put(x, ref, field):   # x [N] into ref[:, field, out]
      common.store_column(x, ref.at[:, field, pl.ds(out, 1)],
                          interpret=interpret, axis=1)

    for s, b in enumerate(best):
      m, idx = rules.first_best(b[0], b[1], 1)
      put(m, f_ref, s)
      put(idx, i_ref, s)
      if spec.t_best:
        mb = bcast(m)
        hit = (b[0] == mb) | (b[0] != b[0])
        own = hit & (b[1] == bcast(idx))
        put(jnp.max(jnp.where(own, b[2], -jnp.inf), axis=1), f_ref, S + s)
    ent, raw_lse, cnt, given_t = rl
    if spec.lse:
      mx, total, ent = _merged_lse(*lse, ent if spec.entropy else None, axis=1,
                                   expand=bcast)
      put(mx, f_ref, 2 * S)
      put(total, f_ref, 2 * S + 1)
      if spec.entropy:
        put(ent, f_ref, spec.f_rl)
    if spec.raw:
      rmx, rtotal, _ = _merged_lse(*raw_lse, None, axis=1, expand=bcast)
      put(rmx, f_ref, spec.f_rl + int(spec.entropy))
      put(rtotal, f_ref, spec.f_rl + int(spec.entropy) + 1)
    if spec.finite:
      put(jnp.sum(cnt, axis=1), i_ref, spec.i_rows - 1)
    if spec.given:   # one slot of one warpgroup holds it, the rest -inf
      put(jnp.max(given_t, axis=1), f_ref, spec.f_given)
    if spec.lists:
      vals, ids = list(lists[:_SLOT_DEPTH]), list(lists[_SLOT_DEPTH:2 * _SLOT_DEPTH])
      overflow = jnp.max(lists[-1], axis=1)   # what fell off the slot lists
      for r in range(spec.candidates):
        mx = jnp.max(vals[0], axis=1)
        hit = vals[0] == bcast(mx)
        top_id = jnp.min(jnp.where(hit, ids[0], rules.INT_MAX), axis=1)
        pop = hit & (ids[0] == bcast(top_id))
        for j in range(_SLOT_DEPTH):
          nxt_v = vals[j + 1] if j + 1 < _SLOT_DEPTH else neg()
          nxt_i = ids[j + 1] if j + 1 < _SLOT_DEPTH else big()
          vals[j] = jnp.where(pop, nxt_v, vals[j])
          ids[j] = jnp.where(pop, nxt_i, ids[j])
        put(mx, f_ref, 2 * S + 3 + r)
        put(top_id, i_ref, S + r)
      put(jnp.maximum(overflow, jnp.max(vals[0], axis=1)), f_ref, 2 * S + 2)

  common.pingpong_frame(
      compute, cfg=cfg, layout=layout, n=n, dim=dim, rows=rows,
      n_tiles=n_tiles, num_ctas=num_ctas, w_ref=w_ref, h_ref=h_ref,
      rowdata_ref=rowdata_ref, cta=cta, interpret=interpret,
      active=(active_ref[0] != 0) if spec.materialize else None,
      rowdata_smem=plgpu.SMEM((spec.rows.rows, n), jnp.uint32),
      acc_smem=plgpu.SMEM((n_chunks, n, epi), jnp.float32), **aux)


def _online_lse(lse, v, interpret: bool):
  """One element ``v`` into an online log-sum-exp ``(max, sum)``, with one
  exp: ``e = exp(a)``, ``a = -|v - max|``, is the factor for whichever of
  the old sum and the new element is below the new max. ``-inf`` adds
  nothing; NaN is carried into the max (rows with NaN take the exact
  path). Returns ``((max, sum), a, e)``."""
  m, total = lse
  up = v > m
  a = -jnp.abs(v - m)
  e = common.approx_exp(a, interpret=interpret)
  total = jnp.where(v == -jnp.inf, total, jnp.where(up, total * e + 1.0, total + e))
  return (jnp.where(up | (v != v), v, m), total), a, e


def _online_entropy(ent, t, m, total, a, e):
  """The entropy terms ``sum exp(t - max) * (t - max)`` (ControlsState.ent_sum)
  after element ``t``, from the log-sum-exp's state before it ``(m, total)``
  and :func:`_online_lse`'s ``a``, ``e``. A new max rescales the old terms:
  ``e * (ent + (m - t) * total)`` with ``m - t = a`` (the new element adds
  ``0 * 1``); else ``t`` adds ``e * a``. An empty state (``total = 0``, ``m =
  -inf``) has no terms to rescale."""
  up = t > m
  kept = e * (ent + jnp.where(total > 0, a * total, 0.0))
  return jnp.where(t == -jnp.inf, ent, jnp.where(up, kept, ent + e * a))


def _merged_lse(m, total, ent, axis: int, expand=None):
  """Online log-sum-exp parts ``(m, total)`` (and their entropy terms
  ``ent``, or None) merged along ``axis``: ``(max, sum, terms)``, each
  part's sum scaled by ``exp(m - max)`` and its terms by that and shifted
  by ``(m - max) * sum`` (parts whose max is ``-inf`` hold nothing).
  ``expand``: the max broadcast back to ``m``'s shape (in a kernel, into
  its layout); default ``expand_dims``."""
  mx = jnp.max(m, axis=axis)
  d = m - (expand(mx) if expand else jnp.expand_dims(mx, axis))
  empty = m == -jnp.inf
  scale = jnp.where(empty, 0.0, jnp.exp(d))
  terms = None
  if ent is not None:
    terms = jnp.sum(jnp.where(empty, 0.0, scale * (ent + d * total)), axis=axis)
  return mx, jnp.sum(total * scale, axis=axis), terms


def _penalized(x, bit, first: int, pen: Penalties, r, inv_r, pres, freq, *,
               rnd, divide):
  """``flashsample_jax.controls.penalize`` on a chunk, with XLA's roundings:
  ``bit(plane)`` reads the history planes from plane ``first`` on."""
  if pen.repetition:
    seen = bit(first) == 1
    x = jnp.where(seen, jnp.where(x > 0, divide(x, r, inv_r), rnd(x * r)), x)
    first += 1
  if not pen.count_bits:
    return x
  count = bit(first)
  for k in range(1, pen.count_bits):
    count = count | (bit(first + k) << jnp.uint32(k))
  count = count.astype(jnp.int32)
  sub = rnd(freq * count.astype(jnp.float32)) if pen.frequency else None
  if pen.presence:   # presence x (count > 0) is presence where it applies
    sub = pres if sub is None else sub + pres
  return x if sub is None else jnp.where(count > 0, x - sub, x)


def _launch(offset, rowdata, h, w, bias, planes, *, cfg, spec: Spec, layout: str,
            rows_valid: int, vocab_size: int, n: int, target: common.Target,
            active=None, t_width: int = 0, scale=None, fixed_split: bool = False):
  """One launch: ``(fo, io)`` ``[nb * n, *, 2 * CTAs]``, and with
  ``spec.materialize`` the rows' t ``[nb * n, t_width]`` (streamed only
  where ``active``, an int32 ``[1]``, is nonzero). ``scale``: an 8-bit
  weight's :func:`~pallas_kernels.sm90_common.scale_operand` (the mode in
  ``spec.scale``). ``fixed_split``: every block's CTAs split the
  vocabulary as one block's do (:func:`_fixed_split`)."""
  dim = h.shape[1]
  nb = cfg.batch_blocks
  rows = w.shape[0] if layout == "vd" else w.shape[1]
  n_tiles = -(-rows // cfg.tile_v)
  w_itemsize = jnp.dtype(w.dtype).itemsize
  cfg.check_problem(n=n, dim=dim, rows=rows, itemsize=h.dtype.itemsize,
                    w_itemsize=w_itemsize, staged=weight_path(
                        cfg.schedule, layout, w_itemsize) is WeightPath.STAGED)
  if fixed_split:
    cfg = _fixed_split(cfg, target, n_tiles)
  # With batch blocks, num_ctas counts the CTAs of one block.
  num_ctas = target.grid_ctas(cfg, n_tiles)
  body = functools.partial(_kernel, cfg=cfg, spec=spec, layout=layout, n=n,
                           dim=dim, rows=rows, rows_valid=rows_valid,
                           vocab_size=vocab_size, n_tiles=n_tiles,
                           num_ctas=num_ctas,
                           interpret=target.interpret is not None)
  # The warpgroups on the minor axis (see _merge_outputs).
  lead = (nb, n) if nb > 1 else (n,)
  out_type = (jax.ShapeDtypeStruct(lead + (spec.f_rows, 2 * num_ctas), jnp.float32),
              jax.ShapeDtypeStruct(lead + (spec.i_rows, 2 * num_ctas), jnp.int32))
  if spec.materialize:
    out_type += (jax.ShapeDtypeStruct(lead + (t_width,), jnp.float32),)
  f = plgpu.kernel(
      body, out_type=out_type, grid=(num_ctas * nb,), grid_names=("sm",),
      num_threads=3, thread_name="wg",
      kernel_name=("flashsample_sm90_tempered_rows" if spec.materialize
                   else "flashsample_sm90_controls"),
      compiler_params=target.compiler_params(),
      interpret=target.interpret)
  extra = [a for a in (scale, bias, planes, active) if a is not None]
  fo, io, *t = f(offset, rowdata, h, w, *extra)
  out = (fo.reshape(nb * n, spec.f_rows, 2 * num_ctas),
         io.reshape(nb * n, spec.i_rows, 2 * num_ctas))
  return out + tuple(x.reshape(nb * n, t_width) for x in t)


def _fixed_split(cfg: TuningConfig, target: common.Target, n_tiles: int) -> TuningConfig:
  """``cfg`` with the grid of :func:`~pallas_kernels.sm90_common.Target.grid_ctas`'s
  one-block split for each of its blocks: ``batch_blocks`` times those CTAs
  (more than the SMs from two blocks on: they run in rounds), so that a
  row's tiles reach the same warpgroups, in the same order, whatever the
  batch (docs/design.md, "Determinism and RL")."""
  one = target.grid_ctas(dataclasses.replace(cfg, batch_blocks=1), n_tiles)
  return dataclasses.replace(cfg, num_ctas=one * cfg.batch_blocks)


def _local_bias(logit_bias, offset, rows_k: int, total_rows: int, epi: int):
  """f32 ``[rows_k / epi, epi]``: the bias of this weight's rows (0 past V),
  one row per epilogue chunk.

  Padded so that ``offset + rows_k`` (offset <= the rows of all shards) is
  in range: ``dynamic_slice`` would clamp the start otherwise."""
  bias = jnp.pad(logit_bias, (0, total_rows + rows_k - logit_bias.shape[0]))
  return lax.dynamic_slice_in_dim(bias, offset, rows_k).reshape(-1, epi)


def _local_mask(allowed_mask, offset, rows_k: int, total_rows: int):
  """uint32 ``[B, rows_k / 32]``: the allowed bits of this weight's rows,
  realigned so that word ``j`` holds local ids ``32 j .. 32 j + 31`` (bits
  past the mask's words are 0: not allowed)."""
  mask = allowed_mask
  n_words = rows_k // 32
  total_words = -(-total_rows // 32) + n_words + 1
  mask = jnp.pad(mask, ((0, 0), (0, total_words - mask.shape[1])))
  q, r = offset // 32, (offset % 32).astype(jnp.uint32)
  a = lax.dynamic_slice_in_dim(mask, q, n_words + 1, axis=1)
  hi = jnp.where(r == 0, jnp.uint32(0),
                 a[:, 1:] << jnp.where(r == 0, jnp.uint32(0), jnp.uint32(32) - r))
  return (a[:, :-1] >> r) | hi


def _planes(allowed_mask, history, offset, rows_k: int, total_rows: int, n: int):
  """The bit-planes of every row in the kernel's layout, uint32 ``[ceil(B /
  n), rows_k / 32, P, n]`` (block, word, plane, row), or None: the allowed
  mask realigned to this weight's rows (:func:`_local_mask`), then the
  history's planes, scattered straight into this layout from the local
  ids (ids outside this weight's rows set no bit). One scatter-add of a
  [P] window per id: each id is once per row, so adding is OR-ing."""
  if allowed_mask is None and history is None:
    return None
  batch = (allowed_mask if history is None else history[0]).shape[0]
  blocks, words = -(-batch // n), rows_k // 32
  pad = lambda x: jnp.pad(x, [(0, blocks * n - batch)] + [(0, 0)] * (x.ndim - 1))
  parts = []
  if allowed_mask is not None:
    mask = pad(_local_mask(allowed_mask, offset, rows_k, total_rows))   # [B, words]
    parts.append(mask.reshape(blocks, n, words).transpose(0, 2, 1)[:, :, None])
  if history is not None:
    ids, flags = history
    parts.append(jnp.zeros((blocks, words, flags.shape[2], n), jnp.uint32))
  planes = jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
  if history is None:
    return planes
  local = ids - offset
  ok = (ids >= 0) & (local >= 0) & (local < rows_k)
  local = jnp.where(ok, local, 0)
  bit = jnp.uint32(1) << (local % 32).astype(jnp.uint32)
  add = jnp.where(flags & ok[:, :, None], bit[:, :, None], jnp.uint32(0))   # [B, H, P]
  row = jnp.arange(batch)[:, None]
  first = int(allowed_mask is not None)
  return planes.at[row // n, local // 32, first:, row % n].add(add)


def _merge_outputs(fo, io, spec: Spec, m: int, by_id: bool = False,
                   target: common.Target = common.Target()) -> ControlsState:
  """One row's state from the warpgroups' outputs ``[N, *, W]``.

  Row ``s`` of ``fo``/``io`` is sample ``s``'s best score/id, row ``S + s``
  of ``fo`` its t; all samples are reduced over the warpgroups at once.
  The warpgroups are the minor axis, so every reduction over them is a row
  reduction that XLA fuses with what feeds it (over a major axis, XLA's
  reduction kernels took no producers: each select or concatenation before
  one was a kernel of its own).
  """
  S = spec.samples
  n, w = fo.shape[0], fo.shape[-1]
  ids = io[:, :S]                                                  # [N, S, W]
  # Every max over the warpgroups in one reduction (one kernel instead of
  # one per quantity): the samples' best scores, then the log-sum-exp max,
  # and the warpgroups' list bounds with the values the pairing drops.
  maxed = [fo[:, :S]]
  if spec.lse:
    maxed.append(fo[:, 2 * S:2 * S + 1])
  if spec.lists:
    vals, c_ids, lost = pair_lists(fo[:, 2 * S + 3:spec.f_rl],
                                   io[:, S:S + spec.candidates])
    # [N, K, W / 2] relabelled as [N, ceil(K / 2), W] (only their max
    # counts), to stack with the rows above.
    lost = jnp.pad(lost, ((0, 0), (0, lost.shape[1] % 2), (0, 0)),
                   constant_values=-jnp.inf)
    maxed += [fo[:, 2 * S + 2:2 * S + 3], lost.reshape(n, -1, w)]
  maxima = jnp.max(jnp.concatenate(maxed, axis=1), axis=2)         # [N, rows]
  score, tok = rules.first_best(fo[:, :S], ids, 2, best=maxima[:, :S])
  if spec.t_best:
    t = jnp.max(jnp.where(ids == tok[..., None], fo[:, S:2 * S], -jnp.inf), axis=2)
  else:
    t = jnp.zeros_like(score)
  out = ControlsState(best_score=score, best_id=tok, best_t=t,   # [N, S]
                        lse_max=None, lse_sum=None)
  # The sums over the warpgroups add in parts_sum's fixed order (a
  # jnp.sum's follows the shape of the whole batch; docs/design.md,
  # "Determinism and RL").
  if spec.lse:
    mw, sw = fo[:, 2 * S], fo[:, 2 * S + 1]
    mx = maxima[:, S]                    # the lse max follows the samples
    scale = jnp.where(mw == -jnp.inf, 0.0, jnp.exp(mw - mx[:, None]))
    out = out._replace(lse_max=mx, lse_sum=parts_sum(sw * scale))
    if spec.entropy:   # as _merged_lse, on the max computed above
      terms = scale * (fo[:, spec.f_rl] + (mw - mx[:, None]) * sw)
      out = out._replace(ent_sum=parts_sum(jnp.where(mw == -jnp.inf, 0.0, terms)))
  if spec.raw:
    r = spec.f_rl + int(spec.entropy)
    raw_max, raw_sum = lse_parts(fo[:, r], fo[:, r + 1])
    out = out._replace(raw_max=raw_max, raw_sum=raw_sum)
  if spec.finite:
    out = out._replace(finite_count=jnp.sum(io[:, spec.i_rows - 1], axis=1))
  if spec.given:
    out = out._replace(given_t=jnp.max(fo[:, spec.f_given], axis=1))
  if spec.lists:
    bound = jnp.max(maxima[:, S + int(spec.lse):], axis=1)
    # Listed values at or below the bound leave before the sort (the lists'
    # invariant, see ControlsState): the masking joins the pairing's
    # fusion instead of a kernel of its own after the sort.
    # ``by_id``: equal values in id order, so that stage 2 reads the top N
    # of ``top_logprobs`` off the lists (no second sort). On the GPU by a
    # selection kernel: XLA's two-key sort of ~900 candidates ran 55
    # dependent compare-exchange steps and copied both operands first
    # (docs/performance.md, "The exact path's conditional").
    # Interpret mode keeps the sort (the
    # kernel is checked against it on its own): a second kernel in the
    # program could deadlock there (see exact_top).
    if (by_id and target.interpret is None and vals[0].size <= sm90_top.LIST_WIDTH
        and m <= sm90_top.LIST_M):
      vals, ids, bound = sm90_top.top_lists(vals.reshape(n, -1), c_ids.reshape(n, -1),
                                            bound, m, target=target)
    else:
      vals, ids = top_m(vals, c_ids, bound, m, by_id=by_id)
    out = out._replace(cand_vals=vals, cand_ids=ids, cand_bound=bound)
  return out


def _prepare(hidden, weight, offset, *, layout: str, samples: int, lists: bool,
             n: int, total_rows: int, logit_bias, allowed_mask, penalties,
             history, given: bool = False, wide_epilogue: bool = False):
  """What every launch of one call shares: ``(w, rows_k, cfg, bias, planes,
  penalties, step)``: the padded weight and its rows, the config, the bias
  and bit-plane arrays, the penalties if they change something, and the
  rows per launch (up to MAX_BLOCKS blocks of ``n`` rows, MAX_LIST_BLOCKS
  with candidate lists: one pass over W)."""
  batch, dim = hidden.shape
  w, rows_k = common.pad_vocab(
      weight, layout, max(_ROW_ALIGN, common.vocab_align(weight.dtype, layout)))
  if penalties is not None and not penalties.planes:   # they change nothing
    penalties = None
  planes = _planes(allowed_mask, history if penalties else None, offset, rows_k,
                   total_rows, n)                             # [blocks, words, P, n]
  n_planes = 0 if planes is None else planes.shape[2]
  cfg = config(dim, rows_k, jnp.dtype(hidden.dtype).itemsize, n, planes=n_planes,
               row_rows=max(16, RowLayout(min(samples, MAX_KERNEL_SAMPLES),
                                          penalties is not None, given).rows),
               w_itemsize=jnp.dtype(weight.dtype).itemsize, wide_epilogue=wide_epilogue)
  step = n * max(1, min(MAX_LIST_BLOCKS if lists else MAX_BLOCKS, -(-batch // n)))
  bias = (_local_bias(logit_bias, offset, rows_k, total_rows, cfg.epi_cols)
          if logit_bias is not None else None)
  return w, rows_k, cfg, bias, planes, penalties, step


def _launch_operands(hidden, rows, planes, b0: int, b1: int, n: int, g0: int,
                     g1: int, call_rows: RowLayout, spec: Spec):
  """``(rowdata, h_chunk, planes_t)`` of the launch of batch rows ``b0:b1``
  and samples ``g0:g1`` of a call whose per-row data ``rows`` has the
  layout ``call_rows``: the launch's per-row data by block (``[nb, rows,
  n]``, one block alone ``[rows, n]``), H's rows, the blocks' bit-planes."""
  blocks = -(-(b1 - b0) // n)
  pad_rows = lambda x: jnp.pad(x[b0:b1], [(0, n * blocks - (b1 - b0))]
                               + [(0, 0)] * (x.ndim - 1))
  # Per-row arrays by block, the rows last: [nb, ..., n] (one block
  # alone: [..., n]).
  by_block = lambda x: (x.reshape(blocks, n, -1).transpose(0, 2, 1)
                        if blocks > 1 else x.T)
  planes_t = None
  if planes is not None:
    planes_t = planes[b0 // n:b0 // n + blocks]
    planes_t = planes_t if blocks > 1 else planes_t[0]
  if blocks > 1:
    h_chunk = pad_rows(hidden)
  else:
    # H keeps its own rows (padded to 8 for TMA): the kernel's slots take
    # them at the top, and the missing rows up to N cost no copies.
    h_rows = -(-(b1 - b0) // 8) * 8
    h_chunk = jnp.pad(hidden[b0:b1], ((0, h_rows - (b1 - b0)), (0, 0)))
  # This group's counters after the shared fields, then the penalties'
  # rows (RowLayout order).
  ctr0 = RowLayout.FIXED
  fields = [rows[:ctr0], rows[ctr0 + 2 * g0:ctr0 + 2 * g1]]
  if spec.penalties is not None:
    pen0 = call_rows.penalty_rows[0]
    fields.append(rows[pen0:pen0 + 4])
  if spec.given:
    fields.append(rows[call_rows.given_row][None])
  rowdata = jnp.concatenate(fields)
  rowdata = jnp.pad(rowdata, [(0, spec.rows.rows - rowdata.shape[0]), (0, 0)])
  return by_block(pad_rows(rowdata.T)), h_chunk, planes_t


def _block_rows(batch: int, *, samples: int, lists: bool, batch_invariant: bool,
                invariant_rows: int) -> tuple[int, bool]:
  """``(rows per batch block, wide epilogue)``: :data:`BATCH_WIDE` past
  one block of :data:`BATCH` rows where one sample without candidate lists
  leaves the registers for it, else :data:`BATCH`. A batch-invariant split
  with ``invariant_rows`` = BATCH_WIDE does the same, its BATCH-row blocks
  with the wide epilogue (:func:`config`): every row gets the same column
  slots and products at every batch, so the same bits, and with or without
  candidate lists and samples: outputs that are not controls (top-N lists,
  kept sets, several samples) must not move a call's floats, which
  ``score_tokens`` reproduces from the controls alone (docs/design.md,
  "Determinism and RL")."""
  if invariant_rows not in (BATCH, BATCH_WIDE):
    raise ValueError(f"invariant_rows={invariant_rows} must be {BATCH} or {BATCH_WIDE}")
  fits = samples == 1 and not lists
  if batch_invariant and invariant_rows == BATCH:
    return BATCH, False
  wide_epilogue = batch_invariant
  return (BATCH_WIDE if fits and batch > BATCH else BATCH), wide_epilogue


def controls_state(hidden, weight, rows, vocab_offset=0, *, samples: int,
                   layout: str, vocab_size: int, total_rows: int, candidates: int,
                   lists: bool, return_logprobs: bool, softcap: bool,
                   noise: bool = True, logit_bias=None, allowed_mask=None,
                   penalties: Penalties | None = None, history=None,
                   lists_by_id: bool = False,
                   target: common.Target = common.Target(),
                   scale=None, entropy: bool = False, raw: bool = False,
                   finite: bool = False, given: bool = False,
                   batch_invariant: bool = False,
                   invariant_rows: int = BATCH_WIDE) -> ControlsState:
  """The controls state of every row from the fused kernel.

  Rows go in blocks of :data:`BATCH` (of :data:`BATCH_WIDE` for B > BATCH
  with one sample and no candidate lists, unless ``batch_invariant`` with
  ``invariant_rows`` = BATCH), up to
  :data:`MAX_BLOCKS` blocks per launch (``TuningConfig.batch_blocks``: one
  pass over W from HBM for all of them), and samples in groups of
  :data:`MAX_KERNEL_SAMPLES`; each group re-reads W.

  Args:
    hidden: ``[B, D]`` in the weight's dtype (bf16/f16; for an 8-bit
      weight, the MMA's, see ``scale``).
    weight: ``[V, D]`` ("vd") or ``[D, V]`` ("dv"): this shard's rows.
    rows: uint32 ``[RowLayout(S).rows, B]`` from
      :func:`~pallas_kernels.rowdata.pack_rows` (S samples).
    vocab_offset: global id of the weight's first row (int or traced).
    samples: S, the samples per row.
    layout: "vd" or "dv".
    vocab_size: the global logical vocabulary.
    total_rows: the weight rows of all shards (what ``logit_bias`` and
      ``allowed_mask`` index into).
    candidates: M, the candidates per row to keep for truncation.
    lists: keep the candidate lists (a truncation rule or top-N is on).
    return_logprobs: keep each sample's tempered logit.
    softcap: apply the soft-cap of the rows' ``softcap`` field.
    noise: False: draw no noise; each sample's best is the argmax of ``x``
      (for calls whose sampled rows are all decided on the candidates;
      ``Controls.for_pass``).
    logit_bias: f32 ``[vocab_size]`` (global ids) or None.
    allowed_mask: uint32 ``[B, ceil(vocab_size / 32)]`` or None.
    penalties: the penalties to apply, or None; ``rows`` then has their
      rows (``RowLayout(S, penalties=True)``).
    history: with ``penalties``, ``(ids int32 [B, H], flags bool [B, H,
      penalties.planes])``: each row's history ids (global, each once, -1
      for none) and their bits in the planes
      (:class:`~pallas_kernels.rowdata.Penalties`).
    lists_by_id: order equal listed values by id (``state.top_m``'s
      ``by_id``: a sort with two keys, dearer than a ``top_k``'s; what
      ``top_logprobs`` without truncation reads).
    target: where the kernels run.
    scale: with an 8-bit weight (``float8_e4m3fn``, ``float8_e5m2``,
      ``int8``; ``hidden`` then holds the MMA's bf16/f16), None, an f32
      scalar or f32 ``[V]`` per row of this weight: ``l`` is the f32 dot
      product times it (one f32 multiply, before the soft-cap).
    entropy, raw, finite: also the RL fields of the state: the entropy
      terms (``ent_sum``), the raw logits' log-sum-exp (``raw_max``,
      ``raw_sum``), the count of finite ``t`` (``finite_count``).
    given: also the ``t`` of each row's given id (``given_t``, ``-inf``
      where this weight does not hold it); ``rows`` then has its given row
      (``RowLayout(S, given=True)``).
    batch_invariant: a row's state, bit for bit, whatever the batch around
      it: one block shape and epilogue for every ``B``
      (``invariant_rows``), each block split over the vocabulary as one
      block alone is (:func:`_fixed_split`), and the one-block lists
      (docs/design.md, "Determinism and RL").
    invariant_rows: the batch-invariant split's blocks:
      :data:`BATCH_WIDE` (the default: for one sample without candidate
      lists blocks of BATCH_WIDE rows past BATCH, and BATCH rows up to it;
      BATCH rows for every other call; all with BATCH_WIDE's epilogue,
      :func:`_block_rows`) or :data:`BATCH` (BATCH rows and their own
      epilogue at every batch). A row's bits depend on it (the epilogue's
      chunks set the row's column slots), so a caller keeps one value for
      every batch.
  """
  batch = hidden.shape[0]
  offset = jnp.asarray(vocab_offset, jnp.int32)
  n_rows = weight.shape[0 if layout == "vd" else 1]
  n, wide_epilogue = _block_rows(batch, samples=samples, lists=lists,
                                 batch_invariant=batch_invariant,
                                 invariant_rows=invariant_rows)
  w, rows_k, cfg, bias, planes, penalties, step = _prepare(
      hidden, weight, offset, layout=layout, samples=samples, lists=lists, n=n,
      total_rows=total_rows, logit_bias=logit_bias, allowed_mask=allowed_mask,
      penalties=penalties, history=history, given=given, wide_epilogue=wide_epilogue)
  scale, mode = common.scale_operand(scale, rows_k)
  call_rows = RowLayout(samples, penalties is not None, given)
  # The log-sum-exp feeds log-probabilities and the truncation rules; the
  # entropy terms are relative to its max.
  need_lse = return_logprobs or lists or entropy
  states = []
  for b0 in range(0, batch, step):
    b1 = min(batch, b0 + step)
    blocks = -(-(b1 - b0) // n)
    launch_cfg = dataclasses.replace(cfg, batch_blocks=blocks)
    parts = []
    for g0 in range(0, samples, MAX_KERNEL_SAMPLES):
      g1 = min(samples, g0 + MAX_KERNEL_SAMPLES)
      first = g0 == 0
      spec = Spec(samples=g1 - g0, softcap=softcap,
                  bias=bias is not None, mask=allowed_mask is not None,
                  penalties=penalties,
                  lse=first and need_lse, lists=first and lists,
                  t_best=return_logprobs, noise=noise,
                  candidates=_wg_candidates(1 if batch_invariant else blocks),
                  scale=mode,
                  entropy=first and entropy, raw=first and raw,
                  finite=first and finite, given=first and given)
      rowdata, h_chunk, planes_t = _launch_operands(
          hidden, rows, planes, b0, b1, n, g0, g1, call_rows, spec)
      fo, io = _launch(offset.reshape((1,)), rowdata, h_chunk, w, bias,
                       planes_t, cfg=launch_cfg, spec=spec, layout=layout,
                       rows_valid=n_rows, vocab_size=vocab_size, n=n,
                       target=target, scale=scale, fixed_split=batch_invariant)
      # Padding rows leave the merge (and the top-M sort) before it starts.
      parts.append(_merge_outputs(fo[:b1 - b0], io[:b1 - b0], spec, candidates,
                                  by_id=lists_by_id, target=target))
    state = parts[0]
    if len(parts) > 1:   # the sample groups, side by side
      cat = lambda name: jnp.concatenate([getattr(q, name) for q in parts], axis=1)
      state = state._replace(best_score=cat("best_score"), best_id=cat("best_id"),
                             best_t=cat("best_t"))
    if not need_lse:  # unused: stage 2 reads it only for these
      zero = jnp.zeros((b1 - b0,), jnp.float32)
      state = state._replace(lse_max=zero, lse_sum=zero + 1.0)
    states.append(state)
  if len(states) == 1:
    return states[0]
  return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *states)


# Rows of one launch of exact_top: its materialized rows ([rows, V] f32)
# are a buffer of every call that may need them, so at most this many.
EXACT_TOP_MAX_ROWS = MAX_LIST_BLOCKS * BATCH


def exact_top(hidden, weight, rows, flags, vocab_offset=0, *, n_top: int,
              layout: str, vocab_size: int, total_rows: int, softcap: bool,
              logit_bias=None, allowed_mask=None,
              penalties: Penalties | None = None, history=None,
              target: common.Target = common.Target(), scale=None,
              wide_epilogue: bool = False):
  """The exact ``n_top`` largest tempered logits of the flagged rows, in
  ``controls.top_n``'s order, by work that is skipped when no row is
  flagged: no XLA conditional (:mod:`pallas_kernels.sm90_top`).

  One launch of the controls kernel (``Spec.materialize``) writes every
  row's t (the call's transforms, the temperature's division as XLA's)
  to a ``[rows, V]`` f32 buffer if any row is flagged, else streams
  nothing; then :func:`pallas_kernels.sm90_top.exact_top` takes each
  flagged row's top N from it. The buffer is allocated on every call
  (``B x V x 4`` bytes: 39 MB at B = 64, V = 152k).

  Args as :func:`controls_state` (``rows`` with one sample's counters,
  which it does not read; ``scale`` as there), and ``flags`` bool ``[B]``; at most
  :data:`EXACT_TOP_MAX_ROWS` rows, and the weight must hold the whole
  vocabulary (``vocab_offset`` 0). ``wide_epilogue``: the config of the
  pass whose lists these rows replace (:func:`_block_rows`' second value),
  so that each t is the pass's (an 8-bit weight's Dt follows it).

  Returns:
    ``(vals f32 [B, N], ids int32 [B, N])``: global ids; rows not flagged
    hold anything.
  """
  batch = hidden.shape[0]
  if batch > EXACT_TOP_MAX_ROWS:
    raise ValueError(f"exact_top takes at most {EXACT_TOP_MAX_ROWS} rows, got {batch}")
  offset = jnp.asarray(vocab_offset, jnp.int32)
  n_rows = weight.shape[0 if layout == "vd" else 1]
  n = BATCH
  w, rows_k, cfg, bias, planes, penalties, _ = _prepare(
      hidden, weight, offset, layout=layout, samples=1, lists=True, n=n,
      total_rows=total_rows, logit_bias=logit_bias, allowed_mask=allowed_mask,
      penalties=penalties, history=history, wide_epilogue=wide_epilogue)
  blocks = -(-batch // n)
  spec = Spec(samples=1, softcap=softcap, bias=bias is not None,
              mask=allowed_mask is not None, penalties=penalties, noise=False,
              materialize=True, scale=common.scale_mode(scale))
  scale, _ = common.scale_operand(scale, rows_k)
  rowdata, h_chunk, planes_t = _launch_operands(
      hidden, rows, planes, 0, batch, n, 0, 1,
      RowLayout(1, penalties is not None), spec)
  width = -(-rows_k // sm90_top.CHUNK) * sm90_top.CHUNK

  def launches():
    active = jnp.any(flags).astype(jnp.int32).reshape((1,))
    _, _, t = _launch(offset.reshape((1,)), rowdata, h_chunk, w, bias, planes_t,
                      cfg=dataclasses.replace(cfg, batch_blocks=blocks), spec=spec,
                      layout=layout, rows_valid=n_rows, vocab_size=vocab_size,
                      n=n, target=target, active=active, t_width=width,
                      scale=scale)
    # Padding rows are never flagged; the buffer keeps them (no copy of it).
    pad = jnp.zeros((t.shape[0] - batch,), bool)
    vals, ids = sm90_top.exact_top(t, jnp.concatenate([flags, pad]), n_top,
                                   min(n_rows, vocab_size), target=target)
    return vals[:batch], ids[:batch]

  if target.interpret is None:
    return launches()
  # Pallas' GPU interpret mode keeps one global model of the GPU's memory,
  # and XLA:CPU may start a kernel's first callbacks (which read no operand)
  # while an earlier kernel still runs: two kernels then share the model
  # and deadlock. The conditional orders them (interpret mode only).
  empty = (jnp.zeros((batch, n_top), jnp.float32), jnp.zeros((batch, n_top), jnp.int32))
  return lax.cond(jnp.any(flags), launches, lambda: empty)
