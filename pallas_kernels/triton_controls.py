"""Sampling controls in the fused Triton kernel.

The same (batch block, vocabulary tile) programs and logits as
:mod:`pallas_kernels.triton_sampler`, with a longer epilogue. Per element, in
this order (each step optional, chosen by constexpr flags)::

    x  = l                                     f32 logits (quantized heads:
                                               f32(H @ W.T) * scale, as in
                                               triton_sampler)
    x  = c * tanh(x / c)                       soft-cap (per-row c > 0)
    x  = x + bias[gid]                         additive bias, per global id
    x  = -inf unless allowed[row, gid]         bit gid % 32 of word gid // 32
    x  = -inf for ids >= vocab_size or padding rows
    t  = x / T                                 (greedy rows: T = 1)
    score_s = t + gumbel(key, ctr_s + gid)     sample s (greedy rows: x)

and per (row, tile) it writes:

* for every sample ``s`` the best ``(score, id)`` (NaN wins, then the larger
  score, then the lower id) and, optionally, the ``t`` of that best (for
  log-probabilities);
* optionally ``(max t, sum exp(t - max t))`` over the tile, an online
  log-sum-exp piece (``exp`` is Triton's ``ex2.approx``-based one, ~2 ulp: it
  only feeds log-probabilities and the top-p normalizer);
* optionally the ``K`` largest ``t`` with their ids (descending, equal values
  lower id first; NaN never listed; past the tile's valid ids: ``(-inf,
  INT32_MAX)``) and ``bound``: the ``(K+1)``-th largest ``t``, an upper bound
  on every value of the tile that is not listed (``-inf`` when the tile has
  at most ``K`` valid values);
* optionally what the RL outputs need (docs/design.md, "Determinism and
  RL"; ``pallas_kernels.state.ControlsState`` names the fields): the entropy
  terms ``sum(exp(t - m) (t - m))`` over the finite ``t``, ``m`` the tile's
  log-sum-exp max; ``(max, sum exp(r - max))`` of the raw logits ``r`` (the
  soft-capped ``x``, ``-inf`` only past the valid ids: no bias, mask or
  temperature); the count of finite ``t``; and the ``t`` of each row's given
  id (``-inf`` where the tile does not hold it).

Outputs keep the tile axis last (``[B, ..., n_tiles]``), so that stage 2
reduces along the minor axis.

Arithmetic follows XLA's on the GPU where known: ``x / c`` and ``x / T`` are
``div.full.f32``, no fma contraction (``enable_fp_fusion=False``: ``c * tanh``
and ``+ bias`` round separately), and ``tanh`` is XLA's own rational
approximation (``TANH_RATIONAL``, the default): on an H200 it matched
``jnp.tanh``, ``c * tanh(x / c)`` and ``+ bias`` on all of 9.4M inputs, where
libdevice's ``__nv_tanhf`` (``TANH_LIBDEVICE``, kept for comparison) differed
on 38% of them (``benchmarks/experiments/triton_check.py``; docs/performance.md,
"The Triton kernels' configs").
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pallas_kernels import triton_noise as noise
from pallas_kernels import triton_sampler as base
from pallas_kernels.rowdata import RowLayout, pack_rows

__all__ = [
    "Controls",
    "ControlsCandidates",
    "pack_control_rows",
    "control_candidates",
    "TANH_LIBDEVICE",
    "TANH_RATIONAL",
    "controls_for_inspection",
    "pick_controls_config",
]

_INT_MAX = tl.constexpr(np.iinfo(np.int32).max)
TANH_LIBDEVICE = 0
TANH_RATIONAL = 1
# Rows of the packed per-row data (pallas_kernels.rowdata.RowLayout); sample
# s's counter words follow at _ROWS_FIXED + 2 s (high) and + 1 (low).
_ROW_K0 = tl.constexpr(RowLayout.K0)
_ROW_K1 = tl.constexpr(RowLayout.K1)
_ROW_TEMPERATURE = tl.constexpr(RowLayout.TEMPERATURE)
_ROW_SOFTCAP = tl.constexpr(RowLayout.SOFTCAP)
_ROW_INV_TEMPERATURE = tl.constexpr(RowLayout.INV_TEMPERATURE)
_ROWS_FIXED = tl.constexpr(RowLayout(1).ctr(0)[0])


class Controls(NamedTuple):
  """What one launch computes (all static).

  Attributes:
    samples: ``S``, samples per row in this launch (each its own counters).
    softcap: apply ``c * tanh(x / c)`` (c per row, in the packed rows).
    bias: add an f32 bias per global id.
    mask: apply an allowed-id bitmask per row.
    t_best: also write the tempered logit of each sample's best.
    lse: also write the tile's ``(max t, sum exp(t - max t))``.
    top_k: ``K``, the largest tempered logits listed per tile (0: none).
    tanh: ``TANH_LIBDEVICE`` or ``TANH_RATIONAL`` (see the module docstring).
    noise: False: no noise; each sample's best is that of ``x`` (for calls
      whose sampled rows are all decided on the candidate lists).
    entropy: also write the tile's entropy terms (needs ``lse``: they are
      relative to the tile's max ``t``).
    raw: also write the tile's ``(max r, sum exp(r - max r))`` of the raw
      logits.
    finite: also write the tile's count of finite ``t``.
    given: also write the ``t`` of each row's given id (a ``[B]`` int32
      input).
  """

  samples: int = 1
  softcap: bool = False
  bias: bool = False
  mask: bool = False
  t_best: bool = False
  lse: bool = False
  top_k: int = 0
  tanh: int = TANH_RATIONAL
  noise: bool = True
  entropy: bool = False
  raw: bool = False
  finite: bool = False
  given: bool = False

  @property
  def f_rows(self) -> int:
    """f32 output rows per (row, tile): scores, t of the best, lse, list,
    bound, entropy terms, raw lse, given t."""
    return (self.samples * (2 if self.t_best else 1) + (2 if self.lse else 0)
            + (self.top_k + 1 if self.top_k else 0) + int(self.entropy)
            + (2 if self.raw else 0) + int(self.given))

  @property
  def i_rows(self) -> int:
    """int32 output rows per (row, tile): ids of the bests, list ids, count."""
    return self.samples + self.top_k + int(self.finite)


class ControlsCandidates(NamedTuple):
  """Per (row, tile) outputs of the controls kernel; tile axis last.

  ``None`` where the :class:`Controls` did not ask for it.
  """

  best_score: jax.Array         # f32 [B, S, T]
  best_index: jax.Array         # int32 [B, S, T]
  best_t: jax.Array | None      # f32 [B, S, T]
  lse_max: jax.Array | None     # f32 [B, T]
  lse_sum: jax.Array | None     # f32 [B, T]
  cand_vals: jax.Array | None   # f32 [B, K, T]
  cand_ids: jax.Array | None    # int32 [B, K, T]
  bound: jax.Array | None       # f32 [B, T]
  ent_sum: jax.Array | None = None       # f32 [B, T], relative to lse_max
  raw_max: jax.Array | None = None       # f32 [B, T]
  raw_sum: jax.Array | None = None       # f32 [B, T]
  finite_count: jax.Array | None = None  # int32 [B, T]
  given_t: jax.Array | None = None       # f32 [B, T]


def pack_control_rows(k0, k1, ctr_hi, ctr_lo, temperature, softcap=None):
  """uint32 ``[RowLayout(S).rows, B]``: k0, k1, bits of T, bits of the
  soft-cap, then ``(ctr_hi[s], ctr_lo[s])`` for each sample
  (:func:`pallas_kernels.rowdata.pack_rows`).

  Args:
    k0, k1: uint32 ``[B]`` key words of each row.
    ctr_hi, ctr_lo: uint32 ``[S, B]`` (or ``[B]`` for one sample): the 64-bit
      counter of each sample's vocabulary id 0 (``jax.random.categorical(k,
      lt, shape=(S, B))`` with one key: ``(s * B + b) * vocab_size``).
    temperature: f32 ``[B]``, 0 for greedy rows.
    softcap: f32 scalar or ``[B]`` (> 0), or None.
  """
  as_u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
  return pack_rows(k0=as_u32(k0), k1=as_u32(k1), temperature=temperature,
                   ctr_hi=as_u32(ctr_hi), ctr_lo=as_u32(ctr_lo), softcap=softcap)


# ----------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------

# XLA's f32 tanh approximation (the rational function XLA's LLVM emitter
# uses on CPUs and, historically, GPUs; Eigen's): clamp, then p(x) / q(x)
# in x^2 by Horner steps, and x itself where |x| < 0.0004. The clamp keeps
# a NaN (tanh(NaN) is NaN, as jnp.tanh's): Triton's default min and max
# return the other operand, which soft-capped a NaN logit to a number
# (docs/design.md, "The exactness contract").
_TANH_CLAMP = tl.constexpr(7.90531110763549805)
_TANH_SMALL = tl.constexpr(0.0004)
_NAN = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def _tanh_rational(x):
  xc = tl.minimum(tl.maximum(x, -_TANH_CLAMP, propagate_nan=_NAN), _TANH_CLAMP,
                  propagate_nan=_NAN)
  x2 = xc * xc
  p = tl.fma(x2, -2.76076847742355e-16, 2.00018790482477e-13)
  p = tl.fma(x2, p, -8.60467152213735e-11)
  p = tl.fma(x2, p, 5.12229709037114e-08)
  p = tl.fma(x2, p, 1.48572235717979e-05)
  p = tl.fma(x2, p, 6.37261928875436e-04)
  p = tl.fma(x2, p, 4.89352455891786e-03)
  p = xc * p
  q = tl.fma(x2, 1.19825839466702e-06, 1.18534705686654e-04)
  q = tl.fma(x2, q, 2.26843463243900e-03)
  q = tl.fma(x2, q, 4.89352518554385e-03)
  return tl.where(tl.abs(x) < _TANH_SMALL, x, tl.fdiv(p, q))


@triton.jit
def softcap_tanh(x, TANH: tl.constexpr):
  """f32 tanh: libdevice ``__nv_tanhf`` or the rational approximation."""
  if noise.INTERPRET:  # no libdevice in the CPU interpreter
    e = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -r, r)
  elif TANH == 1:
    return _tanh_rational(x)
  else:
    return libdevice.tanh(x)


@triton.jit
def _row_u32(rows_ptr, pid_b, B: tl.constexpr, BLOCK_B: tl.constexpr,
             ROW: tl.constexpr, VOCAB_ON_M: tl.constexpr):
  return base.along_rows(base.load_rows(rows_ptr, pid_b, B, BLOCK_B, ROW),
                         VOCAB_ON_M)


@triton.jit
def _store_rows(ptr, val, rows_b, pid_v, R: tl.constexpr, NR: tl.constexpr,
                B: tl.constexpr, N_TILES: tl.constexpr):
  """Writes ``val [Bt]`` to ``ptr[rows_b, R, pid_v]`` of ``[B, NR, N_TILES]``."""
  tl.store(ptr + (rows_b * NR + R) * N_TILES + pid_v, val, mask=rows_b < B)


@triton.jit
def _store_given_t(t, gid, given_ptr, f_ptr, rows_b, pid_v, B: tl.constexpr,
                   R: tl.constexpr, NR: tl.constexpr, N_TILES: tl.constexpr,
                   AXIS: tl.constexpr, VOCAB_ON_M: tl.constexpr):
  """Writes the ``t`` of each row's given id (``given_ptr [B]``) in the tile
  to row ``R`` (``-inf`` where the tile does not hold it)."""
  given_id = tl.load(given_ptr + tl.minimum(rows_b, B - 1))
  is_given = gid == base.along_rows(given_id, VOCAB_ON_M)
  t_given = tl.reduce(tl.where(is_given, t, float("-inf")), AXIS, base.max_nan)
  _store_rows(f_ptr, t_given, rows_b, pid_v, R, NR, B, N_TILES)


@triton.jit
def _controls_kernel(
    off_ptr,      # int32 [1]: global id of the weight's first row
    rows_ptr,     # uint32 [RowLayout(S).rows, B]: see pack_control_rows
    h_ptr,        # bf16/f16 [B, D]
    w_ptr,        # H's dtype, fp8 e4m3/e5m2, int8 (or e4m3 bits as uint8)
                  # [V, D] ("vd") or [D, V] ("dv"), V = ROWS
    scale_ptr,    # f32 [1] (SCALE 1) or [ROWS] (SCALE 2); unread with SCALE 0
    bias_ptr,     # f32 [VOCAB_SIZE] (read only with HAS_BIAS)
    mask_ptr,     # uint32 [B, N_WORDS] (read only with HAS_MASK)
    given_ptr,    # int32 [B]: each row's given id (read only with GIVEN)
    f_ptr,        # f32 [B, F_ROWS, N_TILES] (output)
    i_ptr,        # int32 [B, I_ROWS, N_TILES] (output)
    B: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
    ROWS_VALID: tl.constexpr, VOCAB_SIZE: tl.constexpr, N_TILES: tl.constexpr,
    W_VD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr, VOCAB_ON_M: tl.constexpr, SCALE: tl.constexpr,
    W_CONVERT: tl.constexpr, S: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, N_WORDS: tl.constexpr, T_BEST: tl.constexpr,
    LSE: tl.constexpr, K: tl.constexpr, TANH: tl.constexpr,
    NOISE: tl.constexpr, ENT: tl.constexpr, RAW: tl.constexpr,
    FINITE: tl.constexpr, GIVEN: tl.constexpr, F_ROWS: tl.constexpr,
    I_ROWS: tl.constexpr):
  """One (batch block, vocabulary tile) of the controls kernel (module doc)."""
  # Output rows: f = scores [S], t of the bests [S], lse [2], list [K] and
  # bound, entropy terms, raw lse [2], given t; i = ids [S], list ids [K],
  # finite count (each present only with its flag; Controls.f_rows/i_rows).
  R_LSE: tl.constexpr = S * 2 if T_BEST else S
  R_TOP: tl.constexpr = R_LSE + 2 if LSE else R_LSE
  R_ENT: tl.constexpr = R_TOP + K + 1 if K > 0 else R_TOP
  R_RAW: tl.constexpr = R_ENT + 1 if ENT else R_ENT
  R_GIVEN: tl.constexpr = R_RAW + 2 if RAW else R_RAW
  R_FINITE: tl.constexpr = S + K
  pid_b = tl.program_id(0)
  pid_v = tl.program_id(1)
  x = base.tile_logits(h_ptr, w_ptr, scale_ptr, pid_b, pid_v, B, D, ROWS, W_VD,
                       BLOCK_B, BLOCK_V, BLOCK_D, VOCAB_ON_M, SCALE, W_CONVERT)
  AXIS: tl.constexpr = 0 if VOCAB_ON_M else 1

  local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
  gid_v = tl.load(off_ptr) + local
  in_vocab = (local < ROWS_VALID) & (gid_v < VOCAB_SIZE)
  rows_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
  gid = base.along_vocab(gid_v, VOCAB_ON_M)
  gid_u = base.along_vocab(gid_v.to(tl.uint32), VOCAB_ON_M)
  valid = base.along_vocab(in_vocab, VOCAB_ON_M)

  k0 = _row_u32(rows_ptr, pid_b, B, BLOCK_B, _ROW_K0, VOCAB_ON_M)
  k1 = _row_u32(rows_ptr, pid_b, B, BLOCK_B, _ROW_K1, VOCAB_ON_M)
  temp = _row_u32(rows_ptr, pid_b, B, BLOCK_B, _ROW_TEMPERATURE,
                  VOCAB_ON_M).to(
      tl.float32, bitcast=True)
  greedy = temp == 0.0

  if HAS_SOFTCAP:
    cap = _row_u32(rows_ptr, pid_b, B, BLOCK_B, _ROW_SOFTCAP,
                   VOCAB_ON_M).to(
        tl.float32, bitcast=True)
    x = cap * softcap_tanh(tl.fdiv(x, cap), TANH)
  if RAW:
    # The raw logits' log-sum-exp piece, here where x is still raw: only
    # ids past the valid ones are -inf (valid holds no mask bit yet).
    r = tl.where(valid, x, float("-inf"))
    rm = tl.reduce(r, AXIS, base.max_nan)
    re = tl.where(r == float("-inf"), 0.0, tl.exp(r - tl.expand_dims(rm, AXIS)))
    _store_rows(f_ptr, rm, rows_b, pid_v, R_RAW, F_ROWS, B, N_TILES)
    _store_rows(f_ptr, tl.sum(re, AXIS), rows_b, pid_v, R_RAW + 1, F_ROWS, B,
                N_TILES)
  if HAS_BIAS:
    bias = tl.load(bias_ptr + gid_v, mask=in_vocab, other=0.0)
    x = x + base.along_vocab(bias, VOCAB_ON_M)
  if HAS_MASK:
    rb = base.along_rows(tl.minimum(rows_b, B - 1), VOCAB_ON_M)
    word = tl.load(mask_ptr + rb * N_WORDS + gid // 32, mask=valid, other=0)
    valid = valid & (((word >> (gid_u % 32)) & 1) == 1)
  x = tl.where(valid, x, float("-inf"))
  inv = _row_u32(rows_ptr, pid_b, B, BLOCK_B, _ROW_INV_TEMPERATURE,
                 VOCAB_ON_M).to(tl.float32, bitcast=True)
  t = base.tempered(x, inv)

  # The given id's t: before the noise where it runs, else last. Either
  # place alone spilled on sm80's 8-warp configs with every control and the
  # RL fields (compiled on the CPU): 8 bytes after the noise, 16 before a
  # noise-free list.
  if GIVEN and NOISE:
    _store_given_t(t, gid, given_ptr, f_ptr, rows_b, pid_v, B, R_GIVEN, F_ROWS,
                   N_TILES, AXIS, VOCAB_ON_M)

  for s in tl.static_range(S):
    if NOISE:
      c_hi = _row_u32(rows_ptr, pid_b, B, BLOCK_B, _ROWS_FIXED + 2 * s,
                      VOCAB_ON_M)
      c_lo = _row_u32(rows_ptr, pid_b, B, BLOCK_B, _ROWS_FIXED + 2 * s + 1,
                      VOCAB_ON_M)
      hi, lo = noise.add_u32(c_hi, c_lo, gid_u)
      g = noise.gumbel(k0, k1, hi, lo)
      sc = tl.where(valid, tl.where(greedy, x, t + g), float("-inf"))
    else:  # x is already -inf where not valid
      sc = x
    best, idx = base.best_along(sc, gid, valid, AXIS)
    _store_rows(f_ptr, best, rows_b, pid_v, s, F_ROWS, B, N_TILES)
    _store_rows(i_ptr, idx, rows_b, pid_v, s, I_ROWS, B, N_TILES)
    if T_BEST:
      own = gid == tl.expand_dims(idx, AXIS)
      t_own = tl.reduce(tl.where(own, t, float("-inf")), AXIS, base.max_nan)
      _store_rows(f_ptr, t_own, rows_b, pid_v, S + s, F_ROWS, B, N_TILES)

  if LSE:
    m = tl.reduce(t, AXIS, base.max_nan)
    d = t - tl.expand_dims(m, AXIS)
    e = tl.where(t == float("-inf"), 0.0, tl.exp(d))
    _store_rows(f_ptr, m, rows_b, pid_v, R_LSE, F_ROWS, B, N_TILES)
    _store_rows(f_ptr, tl.sum(e, AXIS), rows_b, pid_v, R_LSE + 1, F_ROWS, B,
                N_TILES)
    if ENT:
      # controls.entropy_terms: finite t only (NaN and -inf add nothing).
      ent = tl.sum(tl.where(t > float("-inf"), e * d, 0.0), AXIS)
      _store_rows(f_ptr, ent, rows_b, pid_v, R_ENT, F_ROWS, B, N_TILES)
  if FINITE:
    count = tl.sum((t > float("-inf")).to(tl.int32), AXIS)
    _store_rows(i_ptr, count, rows_b, pid_v, R_FINITE, I_ROWS, B, N_TILES)
  if K > 0:
    # K + 1 passes of (max, lowest id attaining it, remove it): the last max
    # is the bound. NaN is never listed; -inf is "nothing left".
    work = tl.where(t == t, t, float("-inf"))
    for j in tl.static_range(K + 1):
      v = tl.max(work, AXIS)
      if j < K:
        hit = (work == tl.expand_dims(v, AXIS)) & (work > float("-inf"))
        top = tl.min(tl.where(hit, gid, _INT_MAX), AXIS)
        _store_rows(f_ptr, v, rows_b, pid_v, R_TOP + j, F_ROWS, B, N_TILES)
        _store_rows(i_ptr, top, rows_b, pid_v, S + j, I_ROWS, B, N_TILES)
        work = tl.where(gid == tl.expand_dims(top, AXIS), float("-inf"), work)
      else:
        _store_rows(f_ptr, v, rows_b, pid_v, R_TOP + K, F_ROWS, B, N_TILES)
  if GIVEN and not NOISE:
    _store_given_t(t, gid, given_ptr, f_ptr, rows_b, pid_v, B, R_GIVEN, F_ROWS,
                   N_TILES, AXIS, VOCAB_ON_M)


# ----------------------------------------------------------------------------
# Heuristic
# ----------------------------------------------------------------------------


# Batch-invariant launches (docs/design.md, "Determinism and RL"): one
# vocabulary tile (64 ids) on the MMA's M side for every batch size, so
# that each (row, tile) reduces its log-sum-exp in one order, whatever the
# batch block (the N side) and the number of warps along it. Measured
# bit for bit against B = 512, and timed against the float table's
# configs (slower at B = 33-64, faster from 128): docs/performance.md,
# "RL outputs and batch invariance".
INVARIANT_BLOCK_V = 64
INVARIANT_MAX_BLOCK_B = 128


def invariant_config(batch: int, dim: int, rows: int, max_elements: int = 32, *,
                     capability: tuple[int, int] = (9, 0), itemsize: int = 2,
                     w_itemsize: int | None = None) -> base.TritonConfig:
  """The batch-invariant launch's config for ``batch`` rows: the vocabulary
  on M in tiles of :data:`INVARIANT_BLOCK_V` ids (fewer for a vocabulary
  that small: that depends on ``rows`` alone), batch blocks of 16 to 128
  rows, at most ``max_elements`` per thread (:func:`_fit_elements`: the
  warps and the batch block are on the N side, which the vocabulary's
  reduction order does not see), and fewer stages, then shorter steps
  along D, where the family's shared memory (``capability``; ``itemsize``
  and ``w_itemsize`` the hidden states' and weight's bytes) does not hold
  four: neither changes any sum's order (each logit accumulates along D
  in one order whatever the step)."""
  block_b = min(max(16, 1 << max(batch - 1, 0).bit_length()), INVARIANT_MAX_BLOCK_B)
  block_v = base.fit_block_v(INVARIANT_BLOCK_V, rows)
  block_b, num_warps = _fit_elements(block_v, block_b, 4, max_elements)
  cfg = base.TritonConfig(block_v=block_v, block_b=block_b,
                          block_d=base.fit_block_d(128, dim),
                          num_warps=num_warps, num_stages=4, vocab_on_m=True)
  budget = base.SMEM_BYTES[base.gpu_family(capability)]
  while cfg.smem_bytes(itemsize, w_itemsize) > budget:
    if cfg.num_stages > 2:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    elif cfg.block_d > 32:
      cfg = dataclasses.replace(cfg, block_d=cfg.block_d // 2)
    else:
      break
  return cfg


def _fit_elements(block_v: int, block_b: int, num_warps: int,
                  limit: int) -> tuple[int, int]:
  """``(block_b, num_warps)`` with at most ``limit`` tile elements per
  thread: more warps first (up to 8), then smaller batch blocks (W's extra
  reads then come from L2)."""
  while block_v * block_b // (32 * num_warps) > limit:
    if num_warps < 8:
      num_warps *= 2
    elif block_b > 16:
      block_b //= 2
    else:
      break
  return block_b, num_warps


def has_invariant_config(w_itemsize: int | None, layout: str) -> bool:
  """Whether :func:`invariant_config` serves a weight of ``w_itemsize``
  bytes (None: 2) stored in ``layout``: not an 8-bit ``[D, V]`` weight,
  whose tiles on the M side would be transposed in registers."""
  return not (w_itemsize == 1 and layout == "dv")


def pick_controls_config(batch: int, dim: int, rows: int,
                         capability: tuple[int, int],
                         controls: Controls,
                         w_itemsize: int | None = None,
                         layout: str = "vd",
                         batch_invariant: bool = False,
                         itemsize: int = 2) -> base.TritonConfig:
  """The plain sampler's config with fewer elements per thread, or with
  ``batch_invariant`` :func:`invariant_config` where
  :func:`has_invariant_config` (else the table's configs, not
  batch-invariant; ``itemsize``: the hidden states' bytes, for its shared
  memory).

  The epilogue keeps every element of a thread live at once; each sample,
  the list passes and the log-sum-exp add to it. Compiled for sm90
  (registers per thread, no GPU needed): plain 16 elements 56, 64 elements
  233; all controls (2 samples, K = 8) at 16 elements 188, at 64 elements
  255 with 1.2 KB of spills. So: at most 32 elements per thread, 16 with a
  list drawn next to the noise, several samples, the best's t or the RL
  fields (8 for several samples with the RL fields at 16 warps); more warps
  first (up to 8), then smaller batch blocks (W's extra reads then come
  from L2). A list without the noise is light (B = 128, 32 elements: 99
  registers).
  """
  # The RL fields that feed floats (entropy terms, raw log-sum-exp, given t)
  # count as heavy: they add per-element work. The finite count alone is not.
  rl = controls.entropy or controls.raw or controls.given
  if batch_invariant and has_invariant_config(w_itemsize, layout):
    # Its tiles keep 128 registers at 32 elements with the log-sum-exp, the
    # best's t and the lists (sm90); several samples or the RL fields
    # spilled there and keep none at 16 (8 warps).
    return invariant_config(batch, dim, rows, 16 if rl or controls.samples > 1 else 32,
                            capability=capability, itemsize=itemsize,
                            w_itemsize=w_itemsize)
  cfg = base.pick_config(batch, dim, rows, capability, w_itemsize=w_itemsize,
                         layout=layout)
  heavy = ((controls.top_k > 0 and controls.noise) or controls.samples > 1
           or controls.t_best or rl)
  limit = 16 if heavy else 32
  if rl and controls.samples > 1 and cfg.num_warps >= 16:
    # 16 warps leave 128 registers a thread: several samples with the RL
    # fields spilled 8-24 bytes at 16 elements (sm90, B = 128).
    limit = 8
  block_b, num_warps = _fit_elements(cfg.block_v, cfg.block_b, cfg.num_warps, limit)
  return base.TritonConfig(block_v=cfg.block_v, block_b=block_b,
                           block_d=cfg.block_d, num_warps=num_warps,
                           num_stages=cfg.num_stages, vocab_on_m=cfg.vocab_on_m)


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def controls_constexprs(cfg: base.TritonConfig, ctl: Controls, *, batch, dim,
                        rows, rows_valid, vocab_size, layout, n_words=1,
                        scale=base.SCALE_NONE, convert=base.CONVERT_DIRECT):
  """The controls kernel's constexprs for one problem."""
  consts = base.sampler_constexprs(cfg, batch=batch, dim=dim, rows=rows,
                                   rows_valid=rows_valid, vocab_size=vocab_size,
                                   layout=layout, scale=scale,
                                   convert=convert)
  consts.update(S=ctl.samples, HAS_SOFTCAP=ctl.softcap, HAS_BIAS=ctl.bias,
                HAS_MASK=ctl.mask, N_WORDS=n_words, T_BEST=ctl.t_best,
                LSE=ctl.lse, K=ctl.top_k, TANH=ctl.tanh, NOISE=ctl.noise,
                ENT=ctl.entropy, RAW=ctl.raw, FINITE=ctl.finite,
                GIVEN=ctl.given, F_ROWS=ctl.f_rows, I_ROWS=ctl.i_rows)
  return consts


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def check_controls(ctl: Controls):
  """Raises TypeError/ValueError for a :class:`Controls` the kernel cannot
  take (samples and the list are unrolled at compile time: kept small)."""
  if not isinstance(ctl, Controls):
    raise TypeError(f"controls={ctl!r} must be a Controls")
  if not _is_int(ctl.samples) or not 1 <= ctl.samples <= 16:
    raise ValueError(f"samples={ctl.samples!r} must be an int in [1, 16]")
  if not _is_int(ctl.top_k) or not 0 <= ctl.top_k <= 64:
    raise ValueError(f"top_k={ctl.top_k!r} must be an int in [0, 64]")
  if ctl.tanh not in (TANH_LIBDEVICE, TANH_RATIONAL):
    raise ValueError(
        f"tanh={ctl.tanh!r} must be TANH_LIBDEVICE or TANH_RATIONAL")
  for name in ("softcap", "bias", "mask", "t_best", "lse", "noise", "entropy",
               "raw", "finite", "given"):
    if not isinstance(getattr(ctl, name), bool):
      raise TypeError(f"{name}={getattr(ctl, name)!r} must be a bool")
  if ctl.entropy and not ctl.lse:
    raise ValueError("entropy=True needs lse=True (the terms are relative to "
                     "the tile's log-sum-exp max)")


def split_outputs(fo, io, ctl: Controls) -> ControlsCandidates:
  """Named views of the packed outputs ``fo [B, F, T]``, ``io [B, I, T]``."""
  S, K = ctl.samples, ctl.top_k
  r = S
  best_t = lse_max = lse_sum = vals = ids = bound = None
  ent = raw_max = raw_sum = finite = given = None
  if ctl.t_best:
    best_t, r = fo[:, S:2 * S], 2 * S
  if ctl.lse:
    lse_max, lse_sum, r = fo[:, r], fo[:, r + 1], r + 2
  if K:
    vals, bound, ids, r = fo[:, r:r + K], fo[:, r + K], io[:, S:S + K], r + K + 1
  if ctl.entropy:
    ent, r = fo[:, r], r + 1
  if ctl.raw:
    raw_max, raw_sum, r = fo[:, r], fo[:, r + 1], r + 2
  if ctl.given:
    given = fo[:, r]
  if ctl.finite:
    finite = io[:, S + K]
  return ControlsCandidates(fo[:, :S], io[:, :S], best_t, lse_max, lse_sum,
                            vals, ids, bound, ent, raw_max, raw_sum, finite, given)


def control_candidates(hidden, weight, rows, vocab_offset=0, *, layout: str,
                       vocab_size: int, controls: Controls,
                       bias=None, allowed_mask=None, given_ids=None,
                       rows_valid: int | None = None,
                       weight_scale=None,
                       config: base.TritonConfig | None = None,
                       capability: tuple[int, int] | None = None,
                       batch_invariant: bool = False
                       ) -> ControlsCandidates:
  """Per (row, tile) outputs of the controls kernel.

  Args:
    hidden, weight, vocab_offset, layout, vocab_size, rows_valid,
      weight_scale, config, capability: as
      :func:`pallas_kernels.triton_sampler.candidates` (a quantized weight's
      scaled logits are the ``l`` every control acts on).
    batch_invariant: without ``config``, the batch-invariant config
      (:func:`pick_controls_config`): each row's outputs the same bits
      whatever the batch size.
    rows: uint32 ``[RowLayout(S).rows, B]`` from :func:`pack_control_rows`.
    controls: the static :class:`Controls` (flags must match ``bias``,
      ``allowed_mask`` and the soft-cap row).
    bias: f32 ``[vocab_size]`` (global ids) when ``controls.bias``.
    allowed_mask: uint32 ``[B, ceil(vocab_size / 32)]`` when ``controls.mask``.
    given_ids: int32 ``[B]`` (global ids) when ``controls.given``.

  Returns:
    :class:`ControlsCandidates`.

  Raises:
    TypeError, ValueError: bad arrays or arguments.
    NotImplementedError: no supported GPU.
  """
  check_controls(controls)
  n_rows = RowLayout(controls.samples).rows
  batch, dim, w_rows = base.check_arrays(hidden, weight, rows, layout=layout,
                                         rowdata_rows=n_rows)
  rows_valid = base.check_vocab(w_rows, rows_valid, vocab_size)
  if controls.bias != (bias is not None):
    raise ValueError(f"controls.bias={controls.bias} but bias is "
                     f"{'given' if bias is not None else 'None'}")
  if controls.mask != (allowed_mask is not None):
    raise ValueError(f"controls.mask={controls.mask} but allowed_mask is "
                     f"{'given' if allowed_mask is not None else 'None'}")
  if controls.given != (given_ids is not None):
    raise ValueError(f"controls.given={controls.given} but given_ids is "
                     f"{'given' if given_ids is not None else 'None'}")
  n_words = -(-vocab_size // 32)
  if given_ids is not None and (given_ids.dtype != jnp.int32
                                or given_ids.shape != (batch,)):
    raise ValueError(f"given_ids must be int32 [{batch}], got {given_ids.dtype} "
                     f"{tuple(given_ids.shape)}")
  if bias is not None and (bias.dtype != jnp.float32 or bias.shape != (vocab_size,)):
    raise ValueError(f"bias must be f32 [{vocab_size}], got {bias.dtype} "
                     f"{tuple(bias.shape)}")
  if allowed_mask is not None and (allowed_mask.dtype != jnp.uint32
                                   or allowed_mask.shape != (batch, n_words)):
    raise ValueError(f"allowed_mask must be uint32 [{batch}, {n_words}], got "
                     f"{allowed_mask.dtype} {tuple(allowed_mask.shape)}")
  if capability is None:
    capability = base.device_capability()
  w_itemsize = jnp.dtype(weight.dtype).itemsize
  if config is None:
    config = pick_controls_config(batch, dim, w_rows, capability, controls,
                                  w_itemsize=w_itemsize, layout=layout,
                                  batch_invariant=batch_invariant,
                                  itemsize=jnp.dtype(hidden.dtype).itemsize)
  cfg = base.resolve_config(config, batch=batch, dim=dim, rows=w_rows,
                            itemsize=jnp.dtype(hidden.dtype).itemsize,
                            w_itemsize=w_itemsize, capability=capability)
  weight, scale, wconsts = base.weight_operands(weight, weight_scale,
                                                hidden_dtype=hidden.dtype,
                                                rows=w_rows, capability=capability)
  consts = controls_constexprs(cfg, controls, batch=batch, dim=dim, rows=w_rows,
                               rows_valid=rows_valid, vocab_size=vocab_size,
                               layout=layout, n_words=n_words,
                               scale=wconsts["SCALE"],
                               convert=wconsts["W_CONVERT"])
  n_tiles = consts["N_TILES"]
  offset = jnp.asarray(vocab_offset, jnp.int32).reshape((1,))
  # Absent optional inputs: a 1-element placeholder the kernel never reads.
  bias = jnp.zeros((1,), jnp.float32) if bias is None else bias
  allowed_mask = (jnp.zeros((1,), jnp.uint32) if allowed_mask is None
                  else allowed_mask)
  given_ids = jnp.zeros((1,), jnp.int32) if given_ids is None else given_ids
  fo, io = noise.jax_triton_module().triton_call(
      offset, rows, hidden, weight, scale, bias, allowed_mask, given_ids,
      kernel=_controls_kernel,
      out_shape=(jax.ShapeDtypeStruct((batch, controls.f_rows, n_tiles), jnp.float32),
                 jax.ShapeDtypeStruct((batch, controls.i_rows, n_tiles), jnp.int32)),
      grid=(triton.cdiv(batch, cfg.block_b), n_tiles),
      num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      enable_fp_fusion=False, name="flashsample_triton_controls", **consts)
  return split_outputs(fo, io, controls)


def controls_for_inspection(cfg: base.TritonConfig, ctl: Controls, *, layout: str,
                            dtype, batch: int, dim: int, rows: int,
                            capability: tuple[int, int] = (9, 0),
                            weight_dtype=None, scale: int = base.SCALE_NONE):
  """Compiles the controls kernel without a GPU (tests, register report);
  ``weight_dtype`` and ``scale`` as for
  :func:`pallas_kernels.triton_sampler.sampler_for_inspection`."""
  t = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16"}[jnp.dtype(dtype)]
  w_type, wconsts = base.inspection_weight(dtype, weight_dtype, scale,
                                              capability)
  pointers = {"off_ptr": "*i32", "rows_ptr": "*u32", "h_ptr": f"*{t}",
              "w_ptr": w_type, "scale_ptr": "*fp32", "bias_ptr": "*fp32",
              "mask_ptr": "*u32", "given_ptr": "*i32", "f_ptr": "*fp32",
              "i_ptr": "*i32"}
  consts = controls_constexprs(cfg, ctl, batch=batch, dim=dim, rows=rows,
                               rows_valid=rows, vocab_size=rows, layout=layout,
                               n_words=-(-rows // 32), scale=scale,
                               convert=wconsts["W_CONVERT"])
  return base.compile_for_inspection(_controls_kernel, pointers, consts,
                                     capability=capability,
                                     num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages)
