"""The fused LM-head sampler as a Triton kernel, launched through jax-triton.

For CUDA GPUs from sm80 (A100, L40S, H100/H200, B200). One program owns one
vocabulary tile (``Vt`` weight rows) and one block of ``Bt`` batch rows; it
accumulates the logits of the tile on chip and keeps, per batch row, one
candidate::

    l     = f32(W_tile @ H_block.T) [* scale]      (tl.dot over D in f32)
    s     = l / T + gumbel(key, ctr + gid)         (rows with T > 0)
    s     = l                                      (greedy rows, T == 0)
    s     = -inf                                   (ids >= vocab_size, padding)
    cand  = (max s, lowest gid attaining it; a NaN wins over any number)

so the ``[B, V]`` logits never reach HBM; the caller reduces the
``[B, n_tiles]`` candidates (plain JAX). ``gid`` is the element's global
vocabulary id (``vocab_offset`` + weight row), so the noise never depends on
tile sizes, configs, or how the vocabulary is sharded. ``l / T`` is
``div.full.f32``, the division XLA emits for f32 on NVIDIA GPUs, and the noise
is :mod:`pallas_kernels.triton_noise`'s, so scores are bit-identical to XLA's
``l / T + jax.random.gumbel(...)`` when the logits are.

The module has the four parts of a kernel module: the frozen
:class:`TritonConfig`, the kernel body (:func:`_sampler_kernel` and the
pieces :mod:`pallas_kernels.triton_controls` shares), the launcher
(:func:`candidates`), and the heuristic (:func:`pick_config` over the per-GPU
table :data:`CONFIGS`).

Per-row inputs travel packed in one uint32 array ``rowdata [8, B]`` in the
row order of :class:`pallas_kernels.rowdata.RowLayout` (the Mosaic GPU
kernels' too); :func:`pack_rowdata` builds it.

Quantized heads (docs/design.md, "Quantized heads"): ``W`` may be
float8_e4m3fn, float8_e5m2 or int8 with an f32 ``weight_scale`` per
vocabulary row (``[V]``) or per tensor (``()``). Each W tile is loaded in its
stored dtype (half the bytes of bf16: decode streams W) and converted in
registers to ``H``'s dtype (bf16 or f16; exact for every 8-bit value), so
``tl.dot`` accumulates in f32 exactly as for a bf16 head; the tile's logits
are then ``acc * scale``, one f32 multiply rounded on its own
(``enable_fp_fusion=False``), before anything else reads them.

Some 8-bit floats travel as their bytes (uint8), converted with integer ops
(:func:`e4m3_bits_to`, :func:`e5m2_bits_to`): float8_e5m2 on every GPU,
because Triton 3.6's e5m2 -> bf16 conversion (the bytes into bf16's fields,
then ``mul.rn.bf16x2`` by 2**112) turns infinities and NaN into finite
values (the exhaustive GPU test found it on an H200); float8_e4m3fn below
sm90, because Triton has no e4m3 type below sm89, and once a process has
compiled an 8-bit float conversion for sm90 it emits sm89/sm90 instructions
in later sm80/sm89 compiles of the same conversion, which ptxas rejects
(seen compiling for several targets in one process, as the CPU tests do).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from pallas_kernels import devices
from pallas_kernels import triton_noise as noise
from pallas_kernels.rowdata import RowLayout, pack_rows

__all__ = [
    "TritonConfig",
    "CONFIGS",
    "SMEM_BYTES",
    "ROWDATA_ROWS",
    "RowData",
    "pack_rowdata",
    "gpu_family",
    "config_table",
    "DEVICE_TABLES",
    "device_capability",
    "pick_config",
    "candidates",
    "QUANTIZED_DTYPES",
    "weight_operands",
    "compile_for_inspection",
    "sampler_for_inspection",
]

_INT_MAX = tl.constexpr(np.iinfo(np.int32).max)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# 8-bit weights whose conversion to bf16 / f16 is exact (docs/design.md,
# "Quantized heads"); they need H in bf16 or f16 and take a weight scale.
QUANTIZED_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2),
                    jnp.dtype(jnp.int8))
# The SCALE constexpr: how the f32 accumulator becomes the logits.
SCALE_NONE, SCALE_TENSOR, SCALE_ROW = 0, 1, 2
# The W_CONVERT constexpr: how a loaded W tile becomes the dot's operand
# (weight_operand): Triton's conversion (the identity for a float head, int8,
# e4m3 from sm90), or an 8-bit float's bytes converted with integer ops
# (module docstring).
CONVERT_DIRECT, CONVERT_E4M3_BITS, CONVERT_E5M2_BITS = 0, 1, 2
_LAYOUTS = ("vd", "dv")
# The vocabulary tiles are the grid's axis 1 (CUDA allows 65535 there): the
# batch blocks are axis 0, the fastest in launch order (see _sampler_kernel).
_MAX_GRID_Y = 65535


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Static tiling of one launch; validated on construction.

  Attributes:
    block_v: ``Vt``, weight rows (vocabulary ids) per program.
    block_b: ``Bt``, batch rows per program. ``tl.dot`` needs every side >= 16,
      so a batch of 1 still computes 16 rows (the extra rows repeat the last
      real row and are never written).
    block_d: ``Dt``, hidden elements per pipeline step.
    num_warps: warps per program.
    num_stages: software-pipeline depth of the loads over D.
    vocab_on_m: True: ``acc[Vt, Bt] = W_tile @ H.T``, the vocabulary on the
      MMA's M side ("swap AB"); Hopper's wgmma needs M >= 64 per warpgroup,
      which a decode batch of 1-32 rows cannot fill, while N may be 16. The
      per-row reduction then runs over M, across warps. False: ``acc[Bt, Vt]
      = H @ W_tile.T``; the reduction runs over N, inside each warp (cheaper),
      for batches that fill M.
  """

  block_v: int = 128
  block_b: int = 16
  block_d: int = 64
  num_warps: int = 4
  num_stages: int = 4
  vocab_on_m: bool = True

  def __post_init__(self):
    for name in ("block_v", "block_b", "block_d", "num_warps", "num_stages"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}={v!r} must be an int")
    if not isinstance(self.vocab_on_m, bool):
      raise TypeError(f"vocab_on_m={self.vocab_on_m!r} must be a bool")
    block_v, block_b, block_d = self.block_v, self.block_b, self.block_d
    # tl.dot: every side a power of two >= 16.
    if not _is_pow2(block_v) or block_v < 16:
      raise ValueError(f"{block_v=} must be a power of two >= 16")
    if not _is_pow2(block_b) or block_b < 16:
      raise ValueError(f"{block_b=} must be a power of two >= 16")
    if not _is_pow2(block_d) or block_d < 16:
      raise ValueError(f"{block_d=} must be a power of two >= 16")
    num_warps, num_stages = self.num_warps, self.num_stages
    if not _is_pow2(num_warps) or num_warps > 16:
      raise ValueError(f"{num_warps=} must be a power of two <= 16")
    if num_stages < 1:
      raise ValueError(f"{num_stages=} must be >= 1")
    # The f32 accumulator lives in registers: above 128 per thread the
    # epilogue (threefry needs ~10 live words per element) spills.
    regs = block_v * block_b // (32 * num_warps)
    if regs > 128:
      raise ValueError(
          f"{block_v=} x {block_b=} needs {regs} accumulator registers per "
          f"thread with {num_warps=}; at most 128 leave room for the epilogue")

  def smem_bytes(self, itemsize: int = 2, w_itemsize: int | None = None) -> int:
    """Shared memory of the load pipeline (an upper estimate: one buffer of
    the W tile and one of the H block per stage). ``w_itemsize``: W's bytes
    per element when they differ from H's (a quantized head: 1)."""
    w_itemsize = itemsize if w_itemsize is None else w_itemsize
    return self.num_stages * self.block_d * (self.block_v * w_itemsize
                                             + self.block_b * itemsize)


# ----------------------------------------------------------------------------
# Heuristic: a table per GPU family (no autotuning at call time)
# ----------------------------------------------------------------------------

# Dynamic shared memory one program may use, per family.
SMEM_BYTES: dict[str, int] = {
    "sm80": 163 * 1024,   # A100
    "sm89": 99 * 1024,    # L40S, RTX 4090 (and sm86, sm120: ~100 KB)
    "sm90": 227 * 1024,   # H100, H200
    "sm100": 227 * 1024,  # B200
}

_C = TritonConfig
# (largest batch, config) rows per family, first match wins; the last row
# takes every larger batch (several batch blocks, see candidates()).
# Why these shapes (a cost model checked only by compiling for registers on
# a CPU; to be replaced by H100 measurements):
# * decode is a stream of W (V * D * 2 bytes); a W tile is read from HBM once
#   per batch block, so batches up to 64 use ONE batch block (16 or 32 rows:
#   tl.dot's minimum N) with the vocabulary on the M side.
# * 2-3 programs per SM (shared memory ~74 KB, registers <= 170 per thread
#   at 4 warps), so that one program's epilogue (threefry and two logs per
#   element: ~150 SASS instructions, counted in the sm90 cubin) overlaps the
#   others' loads, and the loads in flight per SM (2-3 programs x (stages -
#   1) x 18-24 KB) cover HBM latency.
# * the epilogue computes all of a thread's elements at once, so its
#   registers grow with Vt * Bt / threads: 16 elements 56 registers, 32
#   elements ~130, 64 elements 168 (vocabulary on M) to 255 and spills
#   (batch on M, or 8 warps). Tiles of 128 x 64 on 4 warps are the largest
#   that keep 2-3 programs per SM.
# * more rows: batch blocks of 64; the grid runs the blocks of one
#   vocabulary tile next to each other, so all but the first read the W
#   tile from L2 (HBM reads W once); each block re-reads H from L2.
CONFIGS: dict[str, tuple[tuple[int, TritonConfig], ...]] = {
    # Measured on an H100 80GB HBM3 (S: D 4096 x V 151936, and L: D 8192 x
    # V 128256 at B = 128; docs/performance.md, "The Triton kernels'
    # configs"): the fastest of the configs tried at B = 1, 16, 64, 128, 256
    # (one config for B <= 16; at B = 128 steps of 128 along D beat steps of
    # 64 on S and L).
    "sm90": (
        (16, _C(block_v=64, block_b=16, block_d=128, num_warps=4, num_stages=4)),
        (32, _C(block_v=128, block_b=32, block_d=64, num_warps=4, num_stages=4)),
        (64, _C(block_v=64, block_b=64, block_d=64, num_warps=4, num_stages=4,
                vocab_on_m=False)),
        (128, _C(block_v=128, block_b=128, block_d=128, num_warps=16, num_stages=3,
                 vocab_on_m=False)),
        (2**31, _C(block_v=128, block_b=128, block_d=64, num_warps=16,
                   num_stages=3, vocab_on_m=False)),
    ),
    # Measured on an H200 (docs/performance.md, "The Triton kernels'
    # configs"): there the B = 1 and B = 128 rows differ from the H100's
    # (6 stages of 128-id tiles at B = 1; one 128-row block at B = 128).
    # Chosen by DEVICE_TABLES.
    "sm90-h200": (
        (1, _C(block_v=128, block_b=16, block_d=64, num_warps=4, num_stages=6)),
        (16, _C(block_v=64, block_b=16, block_d=128, num_warps=4, num_stages=4)),
        (32, _C(block_v=128, block_b=32, block_d=64, num_warps=4, num_stages=4)),
        (64, _C(block_v=64, block_b=64, block_d=64, num_warps=4, num_stages=4,
                vocab_on_m=False)),
        (2**31, _C(block_v=128, block_b=128, block_d=64, num_warps=16,
                   num_stages=3, vocab_on_m=False)),
    ),
    # B200: the H100/H200 shapes until measured (tcgen05 takes M = 128).
    "sm100": (
        (1, _C(block_v=128, block_b=16, block_d=64, num_warps=4, num_stages=6)),
        (16, _C(block_v=64, block_b=16, block_d=128, num_warps=4, num_stages=4)),
        (32, _C(block_v=128, block_b=32, block_d=64, num_warps=4, num_stages=4)),
        (2**31, _C(block_v=64, block_b=64, block_d=64, num_warps=4, num_stages=4,
                   vocab_on_m=False)),
    ),
    # A100: 164 KB of SMEM per SM, mma.sync (any M >= 16), cp.async loads.
    # Not measured: the H100's shapes with fewer stages.
    "sm80": (
        (16, _C(block_v=128, block_b=16, block_d=64, num_warps=4, num_stages=4)),
        (32, _C(block_v=128, block_b=32, block_d=64, num_warps=4, num_stages=3)),
        (2**31, _C(block_v=64, block_b=64, block_d=64, num_warps=4, num_stages=3,
                   vocab_on_m=False)),
    ),
    # L40S / RTX 4090: ~100 KB of SMEM per SM and ~0.9 TB/s: smaller tiles
    # still cover the latency. Not measured.
    "sm89": (
        (16, _C(block_v=64, block_b=16, block_d=64, num_warps=4, num_stages=4)),
        (32, _C(block_v=64, block_b=32, block_d=64, num_warps=4, num_stages=3)),
        (2**31, _C(block_v=64, block_b=64, block_d=64, num_warps=4, num_stages=2,
                   vocab_on_m=False)),
    ),
}

# 8-bit weights (quantized heads), per layout: rows tried before the float
# table's (batches above the last row take the float table). A W tile is
# half the bytes of a bf16 one and is converted in registers before the
# dot, so the best shapes differ from the float ones. Measured on an H200
# (jax 0.11.2; plain sampling through the backend on S, D 4096 x V 151936,
# e4m3 with per-row scales, exact inputs), the fastest of the configs tried
# at B = 1 and 16:
# * "vd": 64-id tiles with steps of 128 along D (vocabulary on M), 1.3x
#   faster than the float table's 128-id tiles of 6 stages at B = 1;
# * "dv": the vocabulary on N (mma.sync, 72 registers): with it on M the
#   converted [D, V] tile is transposed in registers (118-205 registers)
#   and ran 2.2-2.4x slower.
# At B = 64 no config tried beat the float table's, which runs as fast as
# the bf16 head there. The H100 takes these rows too (not measured there).
CONFIGS_8BIT: dict[str, dict[str, tuple[tuple[int, TritonConfig], ...]]] = {
    "sm90": {
        "vd": ((16, _C(block_v=64, block_b=16, block_d=128, num_warps=4,
                       num_stages=4)),),
        "dv": ((16, _C(block_v=128, block_b=16, block_d=64, num_warps=4,
                       num_stages=4, vocab_on_m=False)),),
    },
}
del _C

# Devices whose measured table differs from their family's: a device whose
# kind (jax's ``device_kind``) is a key, or starts with a key and a space
# ("NVIDIA H200 NVL"), uses the CONFIGS table named; others (GH200 and H20
# are not measured) keep their family's.
DEVICE_TABLES: dict[str, str] = {"NVIDIA H200": "sm90-h200"}


def gpu_family(capability: tuple[int, int]) -> str:
  """The :data:`CONFIGS` family of a CUDA compute capability ``(major, minor)``.

  Raises:
    NotImplementedError: before sm80 (Triton's bf16 ``tl.dot`` needs sm80).
  """
  major, minor = capability
  if major == 8 and minor == 0:
    return "sm80"
  if major == 8 or major == 12:  # sm86/sm87/sm89, consumer Blackwell: ~100 KB SMEM
    return "sm89"
  if major == 9:
    return "sm90"
  if major == 10:
    return "sm100"
  raise NotImplementedError(
      f"the triton backend needs a CUDA GPU from sm80 (A100); got sm{major}{minor}")


def device_capability(device=None) -> tuple[int, int]:
  """``(major, minor)`` of a CUDA device (default: the first GPU).

  Raises:
    NotImplementedError: no CUDA device.
  """
  if device is None:
    try:
      device = jax.devices("gpu")[0]
    except RuntimeError as e:
      raise NotImplementedError(f"the triton backend needs a CUDA GPU: {e}") from e
  cc = getattr(device, "compute_capability", None)
  if not cc:
    raise NotImplementedError(f"{device} has no CUDA compute capability")
  major, minor = str(cc).split(".")
  return int(major), int(minor)


def fit_block_v(block_v: int, rows: int) -> int:
  """``block_v`` halved (down to 16) while half of it still covers the
  ``rows`` weight rows of a tiny vocabulary."""
  while block_v > 16 and block_v // 2 >= rows:
    block_v //= 2
  return block_v


def fit_block_d(block_d: int, dim: int) -> int:
  """The largest power of two <= ``block_d`` (and >= 16) dividing ``dim``:
  whole steps need no mask on D. If none divides, ``block_d`` (masked)."""
  b = block_d
  while b > 16 and dim % b:
    b //= 2
  return b if dim % b == 0 else block_d


def config_table(capability: tuple[int, int], kind: str | None = None) -> str:
  """The :data:`CONFIGS` key for a device: its entry in
  :data:`DEVICE_TABLES` if its kind (default: the first GPU's, ``""``
  without one) matches one, else its family (:func:`gpu_family`)."""
  family = gpu_family(capability)
  if kind is None:
    kind = devices.device_kind()
  for name, table in DEVICE_TABLES.items():
    if (devices.is_kind(kind, name) and table in CONFIGS
        and table.split("-")[0] == family):
      return table
  return family


def pick_config(batch: int, dim: int, rows: int,
                capability: tuple[int, int], kind: str | None = None,
                w_itemsize: int | None = None, layout: str = "vd") -> TritonConfig:
  """The heuristic config for ``batch`` rows, hidden ``D = dim``, ``V = rows``.

  The row of :data:`CONFIGS` for the device (:func:`config_table`: the GPU
  family, or a measured device's own table) and batch, with ``block_d``
  fitted to divide ``D`` and ``block_v`` shrunk for tiny vocabularies; an
  8-bit weight (``w_itemsize=1``) first tries the rows of
  :data:`CONFIGS_8BIT` for its table (or family) and ``layout``. No
  autotuning at call time. Extend the table (``CONFIGS["sm90"] = ...``, a
  new family, or a device's table named in :data:`DEVICE_TABLES`) to
  change it.
  """
  table = config_table(capability, kind)
  rows_of = CONFIGS[table]
  if w_itemsize == 1:
    quant = CONFIGS_8BIT.get(table, CONFIGS_8BIT.get(table.split("-")[0], {}))
    own = quant.get(layout, ())
    if own and batch <= own[-1][0]:
      rows_of = own
  cfg = None
  for max_batch, c in rows_of:
    cfg = c
    if batch <= max_batch:
      break
  return dataclasses.replace(cfg, block_v=fit_block_v(cfg.block_v, rows),
                             block_d=fit_block_d(cfg.block_d, dim))


# ----------------------------------------------------------------------------
# Per-row data
# ----------------------------------------------------------------------------

# Rows of the packed per-row array (RowLayout with one sample), as constexprs
# so that the kernel reads rows by name.
_LAYOUT = RowLayout(samples=1)
ROW_K0 = tl.constexpr(RowLayout.K0)
ROW_K1 = tl.constexpr(RowLayout.K1)
ROW_TEMPERATURE = tl.constexpr(RowLayout.TEMPERATURE)
ROW_INV_TEMPERATURE = tl.constexpr(RowLayout.INV_TEMPERATURE)
ROW_CTR_HI = tl.constexpr(_LAYOUT.ctr(0)[0])
ROW_CTR_LO = tl.constexpr(_LAYOUT.ctr(0)[1])
ROWDATA_ROWS = _LAYOUT.rows


class RowData(NamedTuple):
  """Per-row inputs of the sampler, all ``[B]``.

  ``(k0, k1)`` are the row's threefry key words (``jax.random.key_data``);
  ``(ctr_hi, ctr_lo)`` the 64-bit counter of its vocabulary id 0 (one key for
  the batch: ``b * vocab_size``; a key per row: 0); ``temperature`` f32,
  0 means greedy.
  """

  k0: jax.Array
  k1: jax.Array
  ctr_hi: jax.Array
  ctr_lo: jax.Array
  temperature: jax.Array

  def pack(self) -> jax.Array:
    """The kernel's uint32 ``[8, B]`` (see :func:`pack_rowdata`)."""
    return pack_rowdata(*self)


def pack_rowdata(k0, k1, ctr_hi, ctr_lo, temperature) -> jax.Array:
  """uint32 ``[8, B]``: :func:`pallas_kernels.rowdata.pack_rows` with one
  sample (see :class:`RowData`)."""
  as_u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
  return pack_rows(k0=as_u32(k0), k1=as_u32(k1), temperature=temperature,
                   ctr_hi=as_u32(ctr_hi), ctr_lo=as_u32(ctr_lo))


# ----------------------------------------------------------------------------
# Kernel body (shared with triton_controls)
# ----------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc):
  """``acc + a @ b`` in f32. The CPU interpreter multiplies bf16 storage as
  integers, so there the operands go to f32 first (exact for test inputs)."""
  if noise.INTERPRET:
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
  else:
    return tl.dot(a, b, acc)


# e4m3's 7 magnitude bits placed at the top of a bf16's (f16's) exponent and
# mantissa fields give the value times 2**-120 (2**-8), subnormals included:
# both formats' subnormals continue the same binary scale.
_E4M3_BF16_SHIFT = tl.constexpr(4)
_E4M3_F16_SHIFT = tl.constexpr(7)
_E4M3_BF16_UNSCALE = tl.constexpr(2.0**120)
_E4M3_F16_UNSCALE = tl.constexpr(2.0**8)


@triton.jit
def e4m3_bits_to(bits, DTYPE: tl.constexpr):
  """float8_e4m3fn values given as their uint8 bits, converted exactly to
  ``DTYPE`` (bf16 or f16) without Triton's e4m3 conversion.

  The sign and the 7 magnitude bits move into a 16-bit float whose value is
  the e4m3 value times a power of two; an f32 multiply by the inverse power
  is exact (no result is subnormal in f32, and ``mul.rn.f32`` keeps the
  subnormal inputs: no FTZ); e4m3fn's NaN (magnitude bits all set) stays NaN.
  """
  x = bits.to(tl.uint16)
  mag = x & 0x7F
  sign = (x & 0x80) << 8
  if DTYPE == tl.bfloat16:
    v = (sign | (mag << _E4M3_BF16_SHIFT)).to(tl.bfloat16, bitcast=True)
    f = v.to(tl.float32) * _E4M3_BF16_UNSCALE
  else:
    v = (sign | (mag << _E4M3_F16_SHIFT)).to(tl.float16, bitcast=True)
    f = v.to(tl.float32) * _E4M3_F16_UNSCALE
  f = tl.where(mag == 0x7F, float("nan"), f)
  return f.to(DTYPE)


@triton.jit
def e5m2_bits_to(bits, DTYPE: tl.constexpr):
  """float8_e5m2 values given as their uint8 bits, converted exactly to
  ``DTYPE`` (bf16 or f16): e5m2 is the top byte of an f16 (infinities, NaN
  and subnormals alike), and every such f16 is a bf16 value."""
  f16 = (bits.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
  return f16.to(DTYPE)


@triton.jit
def weight_operand(w, DTYPE: tl.constexpr, W_CONVERT: tl.constexpr):
  """A loaded W tile in the dot's operand dtype ``DTYPE`` (H's): a float
  head's as it is, an 8-bit head's converted in registers (exact).
  ``W_CONVERT``: 0 Triton's conversion, 1 :func:`e4m3_bits_to`, 2
  :func:`e5m2_bits_to` (``CONVERT_*``).

  Triton's CPU interpreter converts 8-bit floats (NaN, subnormals), int8 ->
  bf16 and bf16 subnormals wrongly, so there the tile becomes f32 (what
  :func:`_dot` multiplies in the interpreter anyway) through conversions it
  does right: the byte conversions to f16, and int8 -> f32.
  """
  if noise.INTERPRET:
    if w.dtype == tl.float8e4nv:
      w = w.to(tl.uint8, bitcast=True)
      return e4m3_bits_to(w, tl.float16).to(tl.float32)
    elif w.dtype == tl.float8e5:
      w = w.to(tl.uint8, bitcast=True)
      return e5m2_bits_to(w, tl.float16).to(tl.float32)
    elif W_CONVERT == 1:
      return e4m3_bits_to(w, tl.float16).to(tl.float32)
    elif W_CONVERT == 2:
      return e5m2_bits_to(w, tl.float16).to(tl.float32)
    else:
      return w.to(tl.float32)
  elif W_CONVERT == 1:
    return e4m3_bits_to(w, DTYPE)
  elif W_CONVERT == 2:
    return e5m2_bits_to(w, DTYPE)
  else:
    return w.to(DTYPE)


@triton.jit
def tile_logits(h_ptr, w_ptr, scale_ptr, pid_b, pid_v,
                B: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                W_VD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
                BLOCK_D: tl.constexpr, VOCAB_ON_M: tl.constexpr,
                SCALE: tl.constexpr, W_CONVERT: tl.constexpr):
  """f32 logits of batch block ``pid_b`` and vocabulary tile ``pid_v``.

  Returns ``acc`` ``[BLOCK_V, BLOCK_B]`` (``VOCAB_ON_M``) or ``[BLOCK_B,
  BLOCK_V]``, times the weight scale (``SCALE``: ``SCALE_TENSOR`` reads
  ``scale_ptr[0]``, ``SCALE_ROW`` one scale per weight row; ``W_CONVERT``:
  :func:`weight_operand`'s). Rows past ``B``
  repeat row ``B - 1`` and weight rows past ``ROWS`` repeat row ``ROWS - 1``
  ("vd") or read 0 ("dv"); the epilogue masks both.
  """
  rows_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
  rows_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
  ks = tl.arange(0, BLOCK_D)
  # Clamped row indices instead of masks: the contiguous axis (D) keeps its
  # 16-byte vector loads, and the loop has no predicates.
  hb = tl.minimum(rows_b, B - 1).to(tl.int64)
  h_ptrs = h_ptr + hb[:, None] * D + ks[None, :]                   # [Bt, Dt]
  if W_VD:  # W [V, D]: rows contiguous along D
    wv = tl.minimum(rows_v, ROWS - 1).to(tl.int64)
    w_ptrs = w_ptr + wv[:, None] * D + ks[None, :]                 # [Vt, Dt]
  else:  # W [D, V]: the vocabulary is the contiguous axis, so mask it
    w_ptrs = w_ptr + ks[:, None].to(tl.int64) * ROWS + rows_v[None, :]  # [Dt, Vt]
    v_in = rows_v[None, :] < ROWS
  if VOCAB_ON_M:
    acc = tl.zeros((BLOCK_V, BLOCK_B), dtype=tl.float32)
  else:
    acc = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
  EVEN_D: tl.constexpr = D % BLOCK_D == 0
  for k in range(0, D, BLOCK_D):
    if EVEN_D:
      h = tl.load(h_ptrs)
    else:
      h = tl.load(h_ptrs, mask=(k + ks)[None, :] < D, other=0.0)
    # W is loaded in its stored dtype (8-bit heads: half the bytes) and
    # converted in registers; for a float head this is the identity.
    if W_VD:
      if EVEN_D:
        w = tl.load(w_ptrs)
      else:
        w = tl.load(w_ptrs, mask=(k + ks)[None, :] < D, other=0.0)
      w = weight_operand(w, h.dtype, W_CONVERT)
      if VOCAB_ON_M:
        acc = _dot(w, tl.trans(h), acc)
      else:
        acc = _dot(h, tl.trans(w), acc)
    else:
      if EVEN_D:
        w = tl.load(w_ptrs, mask=v_in, other=0.0)
      else:
        w = tl.load(w_ptrs, mask=v_in & ((k + ks)[:, None] < D), other=0.0)
      w = weight_operand(w, h.dtype, W_CONVERT)
      if VOCAB_ON_M:
        acc = _dot(tl.trans(w), tl.trans(h), acc)
      else:
        acc = _dot(h, w, acc)
    h_ptrs += BLOCK_D
    if W_VD:
      w_ptrs += BLOCK_D
    else:
      w_ptrs += BLOCK_D * ROWS
  # The scale multiplies the f32 dot result once, before anything else reads
  # the logits: a mul.rn.f32 of its own (no fp fusion), as XLA rounds
  # f32(dot) * scale. Read after the loop, so nothing extra stays live
  # across it.
  if SCALE == 1:
    acc = acc * tl.load(scale_ptr)
  elif SCALE == 2:
    scale = tl.load(scale_ptr + tl.minimum(rows_v, ROWS - 1))
    acc = acc * along_vocab(scale, VOCAB_ON_M)
  return acc


@triton.jit
def max_nan(a, b):
  """max that returns NaN if either is NaN (``max.NaN``): a NaN score wins."""
  return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def best_along(s, gid, valid, AXIS: tl.constexpr):
  """Per row, the best ``(score, gid)`` along ``AXIS`` (the vocabulary axis).

  The combine rule of every backend: a NaN wins, then the larger score, then
  the lower id. ``max.NaN`` makes the max NaN iff the row holds a NaN; the
  index is then the lowest id holding a NaN, else the lowest id attaining
  the max. Nothing valid: ``(-inf, INT32_MAX)``.
  """
  m = tl.reduce(s, AXIS, max_nan)
  hit = valid & ((s == tl.expand_dims(m, AXIS)) | (s != s))
  idx = tl.min(tl.where(hit, gid, _INT_MAX), AXIS)
  return m, idx


@triton.jit
def tempered(l, inv_temperature):
  """``l / T`` as XLA computes it in the same program: ``l`` times the
  reciprocal XLA computed (``RowLayout``'s ``INV_TEMPERATURE`` row; 1 for
  greedy rows). XLA's own ``l / T`` is ``div.full.f32``, which equals ``l *
  rcp.approx(T)`` bit for bit, and a ``T`` that is a constant of the program
  has its reciprocal folded at compile time in XLA's quotient and in the
  row alike (docs/design.md, "Division"). The kernels compile without fma
  contraction, so the product is rounded before the noise is added, as XLA
  rounds it."""
  return l * inv_temperature


@triton.jit
def load_rows(rowdata_ptr, pid_b, B: tl.constexpr, BLOCK_B: tl.constexpr,
              ROW: tl.constexpr):
  """Row ``ROW`` of the packed per-row data for batch block ``pid_b``
  (``[BLOCK_B]`` uint32; rows past ``B`` repeat row ``B - 1``)."""
  rows_b = tl.minimum(pid_b * BLOCK_B + tl.arange(0, BLOCK_B), B - 1)
  return tl.load(rowdata_ptr + ROW * B + rows_b)


@triton.jit
def along_rows(x, VOCAB_ON_M: tl.constexpr):
  """A per-row vector ``[Bt]`` broadcastable against the accumulator."""
  if VOCAB_ON_M:
    return x[None, :]
  else:
    return x[:, None]


@triton.jit
def along_vocab(x, VOCAB_ON_M: tl.constexpr):
  """A per-id vector ``[Vt]`` broadcastable against the accumulator."""
  if VOCAB_ON_M:
    return x[:, None]
  else:
    return x[None, :]


@triton.jit
def _sampler_kernel(
    off_ptr,      # int32 [1]: global id of the weight's first row
    rowdata_ptr,  # uint32 [8, B]: RowLayout(samples=1)
    h_ptr,        # bf16/f16 [B, D]
    w_ptr,        # H's dtype, fp8 e4m3/e5m2, int8 (or e4m3 bits as uint8)
                  # [V, D] ("vd") or [D, V] ("dv"), V = ROWS
    scale_ptr,    # f32 [1] (SCALE 1) or [ROWS] (SCALE 2); unread with SCALE 0
    score_ptr,    # f32 [B, N_TILES] (output)
    index_ptr,    # int32 [B, N_TILES] (output)
    B: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
    ROWS_VALID: tl.constexpr, VOCAB_SIZE: tl.constexpr, N_TILES: tl.constexpr,
    W_VD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr, VOCAB_ON_M: tl.constexpr, SCALE: tl.constexpr,
    W_CONVERT: tl.constexpr):
  """One (batch block, vocabulary tile): its best candidate per batch row.

  Grid ``(cdiv(B, BLOCK_B), N_TILES)``: axis 0 (the fastest in launch order)
  walks the batch blocks, so the blocks sharing a W tile run together and
  all but the first read it from L2.
  """
  pid_b = tl.program_id(0)
  pid_v = tl.program_id(1)
  l = tile_logits(h_ptr, w_ptr, scale_ptr, pid_b, pid_v, B, D, ROWS, W_VD,
                  BLOCK_B, BLOCK_V, BLOCK_D, VOCAB_ON_M, SCALE, W_CONVERT)
  AXIS: tl.constexpr = 0 if VOCAB_ON_M else 1

  local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)      # weight row
  gid = tl.load(off_ptr) + local                       # global vocabulary id
  valid = along_vocab((local < ROWS_VALID) & (gid < VOCAB_SIZE), VOCAB_ON_M)
  gid_u = along_vocab(gid.to(tl.uint32), VOCAB_ON_M)
  gid = along_vocab(gid, VOCAB_ON_M)

  k0 = along_rows(load_rows(rowdata_ptr, pid_b, B, BLOCK_B, ROW_K0), VOCAB_ON_M)
  k1 = along_rows(load_rows(rowdata_ptr, pid_b, B, BLOCK_B, ROW_K1), VOCAB_ON_M)
  c_hi = along_rows(load_rows(rowdata_ptr, pid_b, B, BLOCK_B, ROW_CTR_HI),
                    VOCAB_ON_M)
  c_lo = along_rows(load_rows(rowdata_ptr, pid_b, B, BLOCK_B, ROW_CTR_LO),
                    VOCAB_ON_M)
  temp = along_rows(load_rows(rowdata_ptr, pid_b, B, BLOCK_B, ROW_TEMPERATURE).to(
      tl.float32, bitcast=True), VOCAB_ON_M)
  inv = along_rows(load_rows(rowdata_ptr, pid_b, B, BLOCK_B, ROW_INV_TEMPERATURE).to(
      tl.float32, bitcast=True), VOCAB_ON_M)

  hi, lo = noise.add_u32(c_hi, c_lo, gid_u)
  g = noise.gumbel(k0, k1, hi, lo)
  s = tl.where(temp == 0.0, l, tempered(l, inv) + g)
  s = tl.where(valid, s, float("-inf"))
  best, idx = best_along(s, gid, valid, AXIS)

  rows_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
  out = rows_b * N_TILES + pid_v
  tl.store(score_ptr + out, best, mask=rows_b < B)
  tl.store(index_ptr + out, idx, mask=rows_b < B)


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def check_arrays(hidden, weight, rowdata, *, layout: str, rowdata_rows: int):
  """Raises TypeError/ValueError for arrays the kernels cannot take.

  Returns:
    ``(B, D, rows)``.
  """
  if layout not in _LAYOUTS:
    raise ValueError(f"{layout=} must be one of {_LAYOUTS}")
  for name, x in (("hidden", hidden), ("weight", weight)):
    if getattr(x, "ndim", None) != 2:
      raise ValueError(f"{name} must be 2-D, got shape {getattr(x, 'shape', None)}")
  w_dtype = jnp.dtype(weight.dtype)
  if w_dtype in QUANTIZED_DTYPES:
    if jnp.dtype(hidden.dtype) not in _SUPPORTED_DTYPES:
      raise TypeError(
          f"hidden.dtype={hidden.dtype} must be bfloat16 or float16 with a "
          f"quantized weight ({w_dtype}): the weight converts to it exactly")
  elif w_dtype not in _SUPPORTED_DTYPES:
    raise TypeError(
        f"weight.dtype={weight.dtype} must be bfloat16, float16, "
        "float8_e4m3fn, float8_e5m2 or int8")
  elif hidden.dtype != weight.dtype:
    raise TypeError(
        f"hidden.dtype={hidden.dtype} must equal weight.dtype={weight.dtype} "
        "(cast hidden first)")
  batch, dim = hidden.shape
  w_dim, rows = weight.shape if layout == "dv" else weight.shape[::-1]
  if w_dim != dim:
    raise ValueError(
        f"weight {tuple(weight.shape)} ({layout}) does not match hidden "
        f"{tuple(hidden.shape)}: D differs")
  if rowdata.dtype != jnp.uint32 or rowdata.shape != (rowdata_rows, batch):
    raise ValueError(
        f"rowdata must be uint32 [{rowdata_rows}, {batch}], got "
        f"{rowdata.dtype} {tuple(rowdata.shape)}")
  return batch, dim, rows


def check_vocab(rows: int, rows_valid, vocab_size) -> int:
  """Validates ``rows_valid`` / ``vocab_size``; returns ``rows_valid``."""
  rows_valid = rows if rows_valid is None else rows_valid
  for name, v in (("rows_valid", rows_valid), ("vocab_size", vocab_size)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"{name}={v!r} must be a static int")
  if not 0 <= rows_valid <= rows:
    raise ValueError(f"{rows_valid=} must be in [0, {rows}] (the weight's rows)")
  if not 0 < vocab_size < 2**31:
    raise ValueError(f"{vocab_size=} must be in [1, 2**31)")
  return int(rows_valid)


def weight_conversion(weight_dtype, hidden_dtype,
                      capability: tuple[int, int]) -> int:
  """The ``W_CONVERT`` constexpr (``CONVERT_*``) for a weight on a GPU:
  Triton's conversion, except for e5m2 and (below sm90) e4m3, whose bytes
  the kernel converts itself (module docstring).
  """
  del hidden_dtype  # every conversion serves bf16 and f16 alike
  wd = jnp.dtype(weight_dtype)
  if wd == jnp.dtype(jnp.float8_e5m2):
    return CONVERT_E5M2_BITS
  if wd == jnp.dtype(jnp.float8_e4m3fn) and tuple(capability) < (9, 0):
    return CONVERT_E4M3_BITS
  return CONVERT_DIRECT


def weight_operands(weight, weight_scale, *, hidden_dtype, rows: int,
                    capability: tuple[int, int]):
  """The weight and scale as the kernels take them.

  Args:
    weight: the checked weight (:func:`check_arrays`).
    weight_scale: None, or f32 of shape ``()`` (per tensor) or ``[rows]``
      (per weight row).
    hidden_dtype: H's (the dot's operand dtype).
    rows: the weight's rows (``V``).
    capability: the target GPU's.

  Returns:
    ``(weight, scale, consts)``: the weight (as bytes, a uint8 bitcast,
    where :func:`weight_conversion` says so), the f32 scale operand (``[1]``, ``[rows]``, or
    a 1-element placeholder the kernel never reads) and the ``SCALE`` and
    ``W_CONVERT`` constexprs (:func:`weight_conversion`). A per-tensor scale
    stays one element (a reshape): no ``[V]`` broadcast is launched for it.

  Raises:
    TypeError, ValueError: a scale of another dtype or shape.
  """
  if weight_scale is None:
    mode, scale = SCALE_NONE, jnp.zeros((1,), jnp.float32)
  else:
    if not hasattr(weight_scale, "dtype") or not hasattr(weight_scale, "shape"):
      raise TypeError(f"weight_scale must be a float32 array, got "
                      f"{type(weight_scale).__name__}")
    if jnp.dtype(weight_scale.dtype) != jnp.dtype(jnp.float32):
      raise TypeError(f"weight_scale.dtype={weight_scale.dtype} must be float32")
    shape = tuple(weight_scale.shape)
    if shape == ():
      mode, scale = SCALE_TENSOR, jnp.reshape(weight_scale, (1,))
    elif shape == (rows,):
      mode, scale = SCALE_ROW, weight_scale
    else:
      raise ValueError(f"weight_scale.shape={shape} must be () (per tensor) or "
                       f"({rows},) (one scale per weight row)")
  convert = weight_conversion(weight.dtype, hidden_dtype, capability)
  if convert in (CONVERT_E4M3_BITS, CONVERT_E5M2_BITS):
    weight = jax.lax.bitcast_convert_type(weight, jnp.uint8)
  return weight, scale, dict(SCALE=mode, W_CONVERT=convert)


def resolve_config(config, *, batch, dim, rows, itemsize, capability,
                   w_itemsize=None, layout="vd"):
  """``config`` or the heuristic's, checked against the family's SMEM."""
  if capability is None:
    capability = device_capability()
  if config is None:
    config = pick_config(batch, dim, rows, capability, w_itemsize=w_itemsize,
                         layout=layout)
  elif not isinstance(config, TritonConfig):
    raise TypeError(f"config={config!r} must be a TritonConfig")
  n_tiles = -(-rows // config.block_v)
  if n_tiles > _MAX_GRID_Y:
    raise ValueError(
        f"block_v={config.block_v} makes {n_tiles} vocabulary tiles, more than "
        f"the grid's {_MAX_GRID_Y}; use a larger block_v")
  budget = SMEM_BYTES[gpu_family(capability)]
  smem = config.smem_bytes(itemsize, w_itemsize)
  if smem > budget:
    raise ValueError(
        f"{config} needs ~{smem} bytes of shared memory, "
        f"more than the {budget} of sm{capability[0]}{capability[1]}")
  return config


def sampler_constexprs(cfg: TritonConfig, *, batch, dim, rows, rows_valid, vocab_size,
                layout, scale=SCALE_NONE, convert=CONVERT_DIRECT):
  return dict(B=batch, D=dim, ROWS=rows, ROWS_VALID=rows_valid,
              VOCAB_SIZE=int(vocab_size), N_TILES=triton.cdiv(rows, cfg.block_v),
              W_VD=layout == "vd", BLOCK_B=cfg.block_b, BLOCK_V=cfg.block_v,
              BLOCK_D=cfg.block_d, VOCAB_ON_M=cfg.vocab_on_m, SCALE=scale,
              W_CONVERT=int(convert))


def candidates(hidden, weight, rowdata, vocab_offset=0, *, layout: str,
               vocab_size: int, rows_valid: int | None = None,
               weight_scale=None,
               config: TritonConfig | None = None,
               capability: tuple[int, int] | None = None):
  """Per (row, vocabulary tile) best ``(score, global id)`` of the fused sampler.

  Args:
    hidden: ``H [B, D]``, bf16 or f16 (the weight's dtype for a float head).
    weight: ``W [V, D]`` (``layout="vd"``) or ``[D, V]`` (``"dv"``); ``V``
      rows of which the first ``rows_valid`` are real (padding after). bf16
      or f16, or a quantized float8_e4m3fn, float8_e5m2 or int8.
    rowdata: uint32 ``[5, B]`` from :func:`pack_rowdata`.
    vocab_offset: global id of the weight's row 0: an int or a traced int32
      scalar (e.g. ``shard_map``'s shard offset); passed as a 1-element array,
      so changing it does not recompile.
    layout: ``"vd"`` or ``"dv"``.
    vocab_size: ids ``>= vocab_size`` are masked to ``-inf``.
    rows_valid: rows of ``weight`` that are real (default all).
    weight_scale: None, or f32 ``()`` (per tensor) or ``[V]`` (per weight
      row): the logits are ``f32(H @ W.T) * weight_scale`` (module doc).
    config: override the heuristic (tests, benchmarks).
    capability: ``(major, minor)`` of the target GPU (default: the first
      GPU's), for the heuristic and the SMEM check.

  Returns:
    ``(score f32 [B, n_tiles], index int32 [B, n_tiles])`` with ``n_tiles =
    cdiv(V, config.block_v)``; a tile without valid ids gives ``(-inf,
    INT32_MAX)``. Reduce over the last axis with the combine rule.

  Raises:
    TypeError, ValueError: bad arrays or arguments.
    NotImplementedError: no supported GPU.
  """
  batch, dim, rows = check_arrays(hidden, weight, rowdata, layout=layout,
                                  rowdata_rows=ROWDATA_ROWS)
  rows_valid = check_vocab(rows, rows_valid, vocab_size)
  if capability is None:
    capability = device_capability()
  cfg = resolve_config(config, batch=batch, dim=dim, rows=rows,
                       itemsize=jnp.dtype(hidden.dtype).itemsize,
                       w_itemsize=jnp.dtype(weight.dtype).itemsize,
                       capability=capability, layout=layout)
  weight, scale, wconsts = weight_operands(weight, weight_scale,
                                           hidden_dtype=hidden.dtype, rows=rows,
                                           capability=capability)
  consts = sampler_constexprs(cfg, batch=batch, dim=dim, rows=rows,
                              rows_valid=rows_valid, vocab_size=vocab_size,
                              layout=layout, scale=wconsts["SCALE"],
                              convert=wconsts["W_CONVERT"])
  n_tiles = consts["N_TILES"]
  offset = jnp.asarray(vocab_offset, jnp.int32).reshape((1,))
  shape = (batch, n_tiles)
  return noise.jax_triton_module().triton_call(
      offset, rowdata, hidden, weight, scale, kernel=_sampler_kernel,
      out_shape=(jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.int32)),
      grid=(triton.cdiv(batch, cfg.block_b), n_tiles),
      num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      # No fma contraction: XLA's reference adds and multiplies round apart.
      enable_fp_fusion=False, name="flashsample_triton", **consts)


# ----------------------------------------------------------------------------
# Compilation without a GPU (tests, the benchmark's register report)
# ----------------------------------------------------------------------------

_TRITON_TYPES = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16",
                 jnp.dtype(jnp.float8_e4m3fn): "fp8e4nv",
                 jnp.dtype(jnp.float8_e5m2): "fp8e5", jnp.dtype(jnp.int8): "i8",
                 jnp.dtype(jnp.uint8): "u8"}


def inspection_weight(dtype, weight_dtype, scale: int,
                      capability: tuple[int, int]):
  """The W pointer type and weight constexprs the launcher would pass for a
  weight of ``weight_dtype`` (default: ``dtype``, a float head)."""
  wd = jnp.dtype(dtype if weight_dtype is None else weight_dtype)
  convert = weight_conversion(wd, dtype, capability)
  w_type = "u8" if convert != CONVERT_DIRECT else _TRITON_TYPES[wd]
  return f"*{w_type}", dict(SCALE=scale, W_CONVERT=convert)


def compile_for_inspection(kernel, pointer_types: dict[str, str],
                           constexprs: dict, *, capability: tuple[int, int],
                           num_warps: int, num_stages: int):
  """Compiles ``kernel`` for ``capability`` as jax-triton would, without a GPU.

  Same options as ``jax_triton.triton_call`` (16-byte aligned pointers, no fp
  fusion). Returns Triton's compiled kernel: ``.asm["ptx"]``,
  ``.asm["cubin"]``, ``.metadata.shared``. Needs Triton's bundled ``ptxas``.
  """
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  from triton.compiler import ASTSource  # pylint: disable=import-outside-toplevel
  signature = dict(pointer_types)
  signature.update({k: "constexpr" for k in constexprs})
  attrs = {(kernel.arg_names.index(k),): [["tt.divisibility", 16]]
           for k in pointer_types}
  src = ASTSource(kernel, signature=signature, constexprs=dict(constexprs),
                  attrs=attrs)
  major, minor = capability
  compile_ = lambda: triton.compile(
      src, target=GPUTarget("cuda", major * 10 + minor, 32),
      options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False))
  saved = os.environ.get("TRITON_CACHE_DIR")
  if saved:
    return compile_()
  # triton.compile needs a file cache, and jax_triton, once imported, sets
  # TRITON_CACHE_DIR to "" (it compiles below that cache): give this call a
  # directory of its own, and leave the variable as it was.
  with tempfile.TemporaryDirectory(prefix="fsj-triton-inspect-") as tmp:
    os.environ["TRITON_CACHE_DIR"] = tmp
    try:
      return compile_()
    finally:
      if saved is None:
        del os.environ["TRITON_CACHE_DIR"]
      else:
        os.environ["TRITON_CACHE_DIR"] = saved


def sampler_for_inspection(cfg: TritonConfig, *, layout: str, dtype, batch: int,
                           dim: int, rows: int, vocab_size: int | None = None,
                           capability: tuple[int, int] = (9, 0),
                           weight_dtype=None, scale: int = SCALE_NONE):
  """:func:`compile_for_inspection` of the sampler kernel for one problem
  (``dtype``: H's; ``weight_dtype``: W's when quantized; ``scale``: a
  ``SCALE_*`` mode)."""
  t = _TRITON_TYPES[jnp.dtype(dtype)]
  w_type, wconsts = inspection_weight(dtype, weight_dtype, scale, capability)
  pointers = {"off_ptr": "*i32", "rowdata_ptr": "*u32", "h_ptr": f"*{t}",
              "w_ptr": w_type, "scale_ptr": "*fp32", "score_ptr": "*fp32",
              "index_ptr": "*i32"}
  consts = sampler_constexprs(cfg, batch=batch, dim=dim, rows=rows, rows_valid=rows,
                              vocab_size=vocab_size or rows, layout=layout,
                              scale=scale, convert=wconsts["W_CONVERT"])
  return compile_for_inspection(_sampler_kernel, pointers, consts,
                                capability=capability, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages)
