"""What the sm90 kernels share: device facts, per-row data, the ping-pong frame.

The public pieces here are the building blocks of both Mosaic GPU kernels
(:mod:`pallas_kernels.sm90_sampler` and :mod:`pallas_kernels.sm90_controls`):

* :class:`Target`: where a launch runs (the GPU, or Pallas' GPU interpret
  mode on the CPU), passed to every launcher; nothing here reads global
  state.
* :func:`pingpong_frame`: the SMEM ring of ``W``/``H`` slots and its
  barriers, the memory warpgroup that streams a CTA's tiles through it
  (:func:`stream_steps`), and each compute warpgroup's loop over its tiles
  (:func:`pingpong_tile`, :func:`consume_tile`). A kernel supplies only its
  epilogue.
* :func:`dequantized`, :func:`stage_weight`, :func:`permute_k`: 8-bit
  weight tiles (FP8 e4m3/e5m2, int8) converted to bf16/f16 on chip, and
  :func:`scaled`, the weight scale applied to the accumulator.
* :func:`col_reduce`, :func:`store_column`, :func:`store_tile`,
  :func:`approx_exp`: epilogue ops
  that need inline Mosaic GPU code on the GPU and plain ``jnp`` in interpret
  mode (which cannot run inline code).

Traps these pieces avoid (docs/design.md, "Mosaic GPU facts"): two compute
warpgroups must not share a reduction scratch (``jnp.max``'s sits at one
fixed offset; :func:`col_reduce` gives each its own), and a slot is released
only once the wgmma that reads it has finished.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, memref

from pallas_kernels import threefry
from pallas_kernels.sm90_config import (
    TuningConfig, WeightPath, balanced_ctas, quantized_dtype, round_up,
    weight_path)

# 128-byte swizzle: 64 bf16/f16 elements per swizzled row.
SWIZZLE = 128
# CompilerParams' suggested reduction scratch (jnp.max/min inside a warpgroup).
REDUCTION_SCRATCH_BYTES = 2 * 128 * 6 * 4
# Profiler regions per warpgroup and launch (Target.profile_dir; three per
# tile of a compute warpgroup). Their buffers take 16 bytes per region per
# warpgroup of shared memory, which the fullest configs have left over;
# later regions are dropped (bounds-checked), never written past the end.
PROFILE_REGIONS = 128
# Alignment of the vocabulary axis that TMA needs (see pad_vocab).
_VD_ROW_ALIGN = 8
_DV_COL_ALIGN = SWIZZLE // 2
# An H100 SXM has 132 SMs; used only when no device or abstract mesh says.
DEFAULT_NUM_SMS = 132
# The device kind interpret mode and CUDA lowering on a CPU pretend to be
# (JAX's own tests/pallas/gpu_pallas_interpret_test.py does the same).
H100_KIND = "NVIDIA H100 80GB HBM3"


# ----------------------------------------------------------------------------
# Where a launch runs
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
  """Where the kernels run, passed explicitly to every launcher.

  Attributes:
    interpret: ``None`` on a GPU; else the ``plgpu.InterpretGPUParams`` of
      Pallas' GPU interpret mode, which runs the kernel on the CPU (it misses
      races and accepts some ops that do not lower; test lowering too).
    num_sms: CTAs of the persistent grids; None: the device's SM count (or
      that of the enclosing abstract mesh's device).
    profile_dir: on a GPU, a directory for Mosaic GPU's profiler: each
      launch writes a trace of every warpgroup's named regions (the
      ping-pong kernels name ``stream``, ``mma``, ``acc_wait`` and
      ``epilogue``) with their start and end times. For experiments; the
      instrumentation costs a few instructions per region.
  """

  interpret: plgpu.InterpretGPUParams | None = None
  num_sms: int | None = None
  profile_dir: str | None = None

  def sms(self) -> int:
    return self.num_sms or device_num_sms()

  def grid_ctas(self, cfg, n_tiles: int) -> int:
    """CTAs of one batch block of a ping-pong launch over ``n_tiles``
    tiles: the config's own count, or the SMs spread over balanced rounds
    where one block takes them all (``sm90_config.balanced_ctas``)."""
    nb = cfg.batch_blocks
    ctas = max(1, min((cfg.num_ctas or self.sms()) // nb, n_tiles))
    if cfg.num_ctas is None and nb == 1:
      ctas = balanced_ctas(n_tiles, ctas)
    return ctas

  def compiler_params(self, *, reduction_scratch: bool = True):
    """The launches' ``plgpu.CompilerParams``: Lane semantics, the
    reduction scratch of in-warpgroup ``jnp.max``/``min`` (where a kernel
    uses them) and, with ``profile_dir``, the profiler."""
    kw = dict(lowering_semantics=plgpu.LoweringSemantics.Lane)
    if reduction_scratch:
      kw["reduction_scratch_bytes"] = REDUCTION_SCRATCH_BYTES
    if self.profile_dir and self.interpret is None:
      kw.update(profile_space=PROFILE_REGIONS, profile_dir=self.profile_dir,
                profile_bounds_check=True)
    return plgpu.CompilerParams(**kw)


def device_num_sms() -> int:
  """SMs of the abstract mesh's device if one is set, else of the default
  GPU, else :data:`DEFAULT_NUM_SMS`."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "num_cores", None):
    return int(device.num_cores)
  try:
    dev = jax.devices()[0]
    if dev.platform == "gpu":
      return int(dev.core_count)
  except (RuntimeError, AttributeError):
    pass
  return DEFAULT_NUM_SMS


def h100_abstract_mesh(num_cores: int = DEFAULT_NUM_SMS):
  """An abstract mesh whose device is an H100 with ``num_cores`` SMs: trace
  under it (``jax.sharding.use_abstract_mesh``) to lower the kernels for
  CUDA on a machine without a GPU."""
  device = jax.sharding.AbstractDevice(
      device_kind=H100_KIND, platform="gpu", num_cores=num_cores)
  return jax.sharding.AbstractMesh((), (), abstract_device=device)


# ----------------------------------------------------------------------------
# Shapes the TMA needs
# ----------------------------------------------------------------------------


def pad_vocab(weight, layout: str, align: int = 1):
  """``(W, rows_k)``: the weight with its vocabulary axis padded for TMA.

  TMA with a tiled SMEM destination tiles the whole GMEM array, so the
  vocabulary axis must be a multiple of the tile there: 8 rows for "vd",
  one 64-wide swizzle row for "dv" (and of ``align``), at least one 64-row
  tile. Real LM heads are padded that way (151936 and 128256 are multiples
  of 64); anything else pays one copy of W here, and the launchers mask the
  padding rows (``rows_valid``).
  """
  rows = weight.shape[0 if layout == "vd" else 1]
  align = int(np.lcm(align, _VD_ROW_ALIGN if layout == "vd" else _DV_COL_ALIGN))
  rows_k = max(round_up(rows, align), 64)
  if rows_k != rows:
    weight = jnp.pad(weight, [(0, rows_k - rows), (0, 0)] if layout == "vd"
                     else [(0, 0), (0, rows_k - rows)])
  return weight, rows_k


def vocab_align(dtype, layout: str) -> int:
  """The vocabulary alignment :func:`pad_vocab` needs beyond its own for a
  weight of ``dtype``: an 8-bit "dv" weight's tiles have ``Vt`` (64 or
  128) bytes per row, swizzled as wide, so its vocabulary is a multiple of
  128 (real heads are: 151936, 128256, 201088)."""
  return 128 if layout == "dv" and jnp.dtype(dtype).itemsize == 1 else 1


# ----------------------------------------------------------------------------
# Epilogue ops with an inline-code GPU path
# ----------------------------------------------------------------------------


def col_reduce(x, op: str, scratch, *, interpret: bool):
  """``max``/``min``/``add`` of ``x`` [rows, C] (WGMMA layout) over axis 0.

  On the GPU the cross-warp step goes through ``scratch``, this warpgroup's
  own SMEM: ``jnp.max`` uses one scratch area at a fixed offset that two
  compute warpgroups would share and race on. Interpret mode cannot run
  inline Mosaic GPU code, and has no races: ``jnp`` there.
  """
  if interpret:
    return {"max": jnp.max, "min": jnp.min, "add": jnp.sum}[op](x, axis=0)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
      return_type=plgpu.ShapeDtypeStruct(
          (x.shape[1],), x.dtype, layout=plgpu.Layout.WGMMA.reduce(0)))
  def reduce(_, v, scratch_ref):
    return v.reduce(op, 0, scratch=scratch_ref)

  return reduce(x, scratch)


def store_column(x, ref, *, interpret: bool, axis: int = 0):
  """Stores ``x`` [C] into ``ref`` [C, 1], a column of a GMEM array (stride:
  its row length). ``x`` is an accumulator reduced over ``axis``: the layout
  ``WGMMA.reduce(axis)`` (0: one value per column of a vocabulary-major
  tile; 1: one per batch row of a batch-major tile).

  Each thread stores its values one by one (the copies of a value that other
  lanes or warps hold store the same value). Why not ``ref[:, 0] = x``: the
  column is strided, and a vectorized store needs the layout's vectorized
  dimension contiguous in memory; jax >= 0.12 also refuses a GMEM store
  whose lanes do not cover whole 32-byte sectors (docs/design.md, "Mosaic
  GPU facts"). These stores happen once per tile or per launch, so their
  width costs nothing measurable. Interpret mode: a plain store.
  """
  if interpret:
    ref[:, 0] = x
    return

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(axis),
                                plgpu.RefType()))
  def store(_, v, out):
    zero = mgpu.utils.c(0, ir.IndexType.get())
    v.foreach(lambda val, idx: memref.store(val, out, [idx[0], zero]))

  store(x, ref)


def store_tile(x, ref, *, interpret: bool):
  """Stores ``x`` (the ``WGMMA`` layout) into ``ref``, a GMEM window of the
  same shape, with each thread's vectors stored as they lie in registers.

  Why not ``ref[...] = x``: jax >= 0.12 plans GMEM stores and refuses one
  whose warps do not write whole 128-byte cache lines, which a window of
  a few columns per row never does; jax 0.11 stored it this way, so on
  both versions the same stores are emitted (docs/design.md, "Mosaic GPU
  facts"). Interpret mode: a plain store.
  """
  if interpret:
    ref[...] = x
    return

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def store(_, v, out):
    v.store_untiled(out, optimized=False)

  store(x, ref)


def epilogue_passes(acc, chunk, *, passes, acc_smem, epi: int, unroll: int,
                    carry=()):
  """Runs ``chunk(c, slot, carry) -> carry`` on each column chunk ``c`` of
  ``epi`` columns of the accumulator ``acc`` [rows, N], pass by pass: a
  pass's chunks are copied into ``acc_smem`` (``slot`` is a chunk's place
  there), then a loop over them, not unrolled: unrolled, a tile's epilogue
  was ~10k straight-line instructions and bound by instruction fetch
  (docs/performance.md, "The epilogue loop"). ``passes``: the ``(first,
  end)`` chunks of each pass; ``unroll`` chunks per iteration. Returns the
  last carry."""
  for first, end in passes:
    for j in range(first, end):
      acc_smem[j - first] = acc[:, j * epi:(j + 1) * epi]

    def body(it, carry, first=first):
      for u in range(unroll):
        slot = it * unroll + u
        carry = chunk(first + slot, slot, carry)
      return carry

    carry = lax.fori_loop(0, (end - first) // unroll, body, carry)
  return carry


def approx_exp(x, *, interpret: bool):
  """``exp`` as ``ex2.approx`` (relative error ~2^-22), for sums that feed
  only values read with tolerances (log-probabilities, the top-p
  normalizer), never the noise: its log must stay libdevice's, which
  ``CompilerParams(approx_math=True)`` would also replace."""
  if interpret:
    return jnp.exp(x)
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout,),
                     return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=layout))
  def fast(ctx, v):
    del ctx
    return v.exp(approx=True)

  return fast(x)


def rounded(x, zero):
  """``x`` with its bits ORed with ``zero`` (uint32 0 read from the per-row
  data, opaque to the compiler): Mosaic GPU marks multiplies and adds
  contractible, and ptxas would fuse the op that made ``x`` and an add
  after it into one fma, where XLA rounds twice (docs/design.md,
  "Division"). One integer op keeps the two roundings."""
  bits = lax.bitcast_convert_type(x, jnp.uint32) | zero
  return lax.bitcast_convert_type(bits, jnp.float32)


def divided(x, d, inv_d, zero, *, interpret: bool):
  """``x / d`` as XLA computes it in the same program.

  On a GPU: ``x`` times the reciprocal XLA computed (a row of the per-row
  data, :func:`~pallas_kernels.rowdata.pack_rows`): XLA's own ``x / d`` is
  ``div.full.f32``, equal to ``x * rcp.approx(d)``, and a ``d`` that is a
  constant of the program has its reciprocal folded at compile time, in
  XLA's ``x / d`` and in the row alike (docs/design.md, "Division"). The
  product is :func:`rounded`: XLA rounds the quotient before adding to it.
  In interpret mode an IEEE division (what XLA:CPU computes in most
  programs; in some it multiplies by ``1 / d`` instead, 1 ulp away for a
  few quotients, so CPU tests that compare scores bit for bit compute the
  expected ones in NumPy).
  """
  if interpret:
    return x / d
  return rounded(x * inv_d, zero)


def tile_ids(off, start, first_new, rows_valid: int, vocab_size: int):
  """``(base, lo, span)`` of a tile of the ping-pong kernels: its ids are
  ``base + column``, and the valid ones (not seen in an earlier tile, a
  real row of this shard's weight, below the vocabulary size) are
  ``[lo, lo + span)``, for :func:`valid_id`."""
  base = off + start
  lo = base + first_new
  span = jnp.maximum(jnp.minimum(off + rows_valid, vocab_size) - lo, 0)
  return base, lo, span.astype(jnp.uint32)


def valid_id(gid, lo, span):
  """Whether ids ``gid`` lie in ``[lo, lo + span)``: one unsigned compare
  per element where three signed ones would do."""
  return (gid - lo).astype(jnp.uint32) < span


def noise_log(interpret: bool):
  """The logarithm of the kernels' Gumbel noise: on a GPU libdevice's
  ``logf`` core without its special-case branches
  (:func:`~pallas_kernels.threefry.log_normal`: XLA's ``log`` on every
  value the noise takes, ~9 fewer instructions per log); in interpret mode
  XLA:CPU's own ``log``, which the CPU reference uses."""
  return jnp.log if interpret else threefry.log_normal


def tempered(x, t_safe, inv_t, zero, *, interpret: bool):
  """``x / T`` as XLA computes it (:func:`divided`; ``RowLayout``'s
  ``INV_TEMPERATURE``)."""
  return divided(x, t_safe, inv_t, zero, interpret=interpret)


def swizzle_bytes(minor_bytes: int) -> int:
  """The widest swizzle (128, 64 or 32 bytes) that divides an SMEM tile's
  minor dimension of ``minor_bytes``: 128 for every bf16/f16 tile (their
  minor dimension is a multiple of 64 elements); an 8-bit tile of 64
  elements takes 64."""
  for swizzle in (SWIZZLE, 64, 32):
    if minor_bytes % swizzle == 0:
      return swizzle
  raise ValueError(f"an SMEM tile's minor dimension of {minor_bytes} bytes "
                   "is not a multiple of 32 bytes")


def tma_transforms(dtype, minor: int | None = None):
  """Tiling and swizzle of an SMEM tile of ``dtype`` whose minor dimension
  holds ``minor`` elements (None: a multiple of the 128-byte swizzle)."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = SWIZZLE if minor is None else swizzle_bytes(minor * itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)),
          plgpu.SwizzleTransform(swizzle))


# ----------------------------------------------------------------------------
# Quantized weights: 8-bit tiles converted on chip
# ----------------------------------------------------------------------------

# Per 32-bit register of four 8-bit weights [b3 b2 b1 b0], PTX that writes
# the two 32-bit registers $0 = (b0, b2) and $1 = (b1, b3) of the
# bf16/f16 values, exactly (docs/design.md, "Quantized heads"): b1 and b3
# already sit in the high bytes of the 16-bit lanes, and one shift puts b0
# and b2 there (pairs of neighbours took a byte permute per pair). Hopper has
# no e4m3/e5m2 -> bf16 conversion (only -> f16, in ptxas >= 12.8 for bf16
# with a newer ISA), so the FP8 ones are bit moves: a byte placed in the
# high byte of a 16-bit lane, its magnitude bits shifted right by 8 - 1 -
# exponent bits, is the same number times 2^-(127 - bias) in bf16, for
# normal and subnormal codes alike; one bf16x2 fma by 2^(127 - bias) (and
# -0.0, which keeps the sign of zeros) rescales it exactly. int8 is
# CUTLASS's trick that Mosaic GPU uses too: 128 + low 7 bits in the
# mantissa, minus 128 or 256 by the sign bit. FP8 NaN (and e5m2 inf) codes
# decode as finite numbers on the bf16 route; the f16 route keeps them.
_FP8_BF16 = """{{
  .reg .b32 w<2>, t<2>, m, z;
  shl.b32 w0, $2, 8;
  mov.b32 w1, $2;
  and.b32 t0, w0, 0x7F007F00;
  and.b32 t1, w1, 0x7F007F00;
  shr.u32 t0, t0, {shift};
  shr.u32 t1, t1, {shift};
  lop3.b32 w0, w0, t0, 0x80008000, 0xEC;
  lop3.b32 w1, w1, t1, 0x80008000, 0xEC;
  mov.b32 m, {bias};
  mov.b32 z, 0x80008000;
  fma.rn.bf16x2 $0, w0, m, z;
  fma.rn.bf16x2 $1, w1, m, z;
}}"""
_INT8 = """{{
  .reg .b32 w<2>, a<2>, b<2>, c;
  prmt.b32 w0, $2, {magic}, 0x4240;
  prmt.b32 w1, $2, {magic}, 0x4341;
  {body}
}}"""
CONVERSIONS = {
    # e4m3: 4 exponent bits (bias 7): shift 4, times 2^120 (bf16 0x7B80).
    ("float8_e4m3fn", "bfloat16"): _FP8_BF16.format(shift=4, bias="0x7B807B80"),
    # e5m2: 5 exponent bits (bias 15): shift 3, times 2^112 (bf16 0x7780).
    ("float8_e5m2", "bfloat16"): _FP8_BF16.format(shift=3, bias="0x77807780"),
    ("int8", "bfloat16"): _INT8.format(magic="0x43", body="""
  and.b32 a0, w0, 0xff7fff7f;
  and.b32 b0, w0, 0xff80ff80;
  and.b32 a1, w1, 0xff7fff7f;
  and.b32 b1, w1, 0xff80ff80;
  sub.bf16x2 $0, a0, b0;
  sub.bf16x2 $1, a1, b1;"""),
    # f16 holds every e4m3 value: the hardware conversion (sm_89+).
    ("float8_e4m3fn", "float16"): """{
  .reg .b32 p;
  .reg .b16 l, h;
  prmt.b32 p, $2, 0, 0x3120;
  mov.b32 {l, h}, p;
  cvt.rn.f16x2.e4m3x2 $0, l;
  cvt.rn.f16x2.e4m3x2 $1, h;
}""",
    # e5m2 is the high byte of an f16.
    ("float8_e5m2", "float16"): """{
  prmt.b32 $0, $2, 0, 0x2404;
  prmt.b32 $1, $2, 0, 0x3414;
}""",
    # 1024 + (b ^ 0x80) in the mantissa of an f16, minus 1152 (0x6480).
    ("int8", "float16"): _INT8.format(magic="0x64", body="""
  mov.b32 c, 0x64806480;
  xor.b32 a0, w0, 0x00800080;
  xor.b32 a1, w1, 0x00800080;
  sub.f16x2 $0, a0, c;
  sub.f16x2 $1, a1, c;"""),
}


def permute_k(x, axis: int = -1):
  """``x`` with each group of 16 along ``axis`` reordered: element ``k =
  8a + 4b + 2c + d`` of a group comes from ``8c + 4b + 2d + a``.

  A converted 8-bit tile lies in registers in Mosaic GPU's
  ``WGMMA_UPCAST_2X`` layout (each thread holds 4 consecutive columns,
  loaded with one 32-bit shared load, converted to the pairs (0, 2) and
  (1, 3)); read as the wgmma's A layout (2 + 2 columns 8 apart) its
  columns are in this order. Instead of a shuffle per register, the
  launcher gives H's columns the same order: ``sum_k W[v, s(k)] H[b,
  s(k)]`` is the dot product (docs/design.md, "Quantized heads")."""
  axis = axis % x.ndim
  shape = x.shape
  if shape[axis] % 16:
    raise ValueError(f"axis {axis} of {shape} must be a multiple of 16")
  # Source index bits (c, b, d, a) -> output bits (a, b, c, d).
  g = x.reshape(shape[:axis] + (shape[axis] // 16, 2, 2, 2, 2) + shape[axis + 1:])
  a = axis + 1
  perm = list(range(g.ndim))
  perm[a:a + 4] = [a + 3, a + 1, a, a + 2]
  return g.transpose(perm).reshape(shape)


def dequantized(w_ref, dtype, *, interpret: bool, operand: bool):
  """The 8-bit tile ``w_ref`` (SMEM ``[R, C]``, R a multiple of 64, C of
  16) as ``dtype`` (bf16/f16) in registers, exactly.

  ``operand``: in the wgmma's A layout (``WGMMA``) with each group of 16
  columns in :func:`permute_k`'s order (the H operand must be permuted
  alike); else in ``WGMMA_UPCAST_2X`` in the tile's order (for a store).
  Interpret mode converts with ``astype`` (and permutes the operand's
  columns, so that the CPU tests see the launcher's permutation of H).
  """
  out = jnp.dtype(dtype)
  if interpret:
    x = w_ref[...].astype(out)
    return permute_k(x, 1) if operand else x
  key = (jnp.dtype(w_ref.dtype).name, out.name)
  if key not in CONVERSIONS:
    raise NotImplementedError(f"no conversion of {key[0]} weights to {key[1]}")
  ptx = CONVERSIONS[key]
  src = plgpu.load(w_ref, layout=plgpu.Layout.WGMMA_UPCAST_2X)
  shape = src.shape
  out_layout = plgpu.Layout.WGMMA if operand else plgpu.Layout.WGMMA_UPCAST_2X

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_2X,),
                     return_type=plgpu.ShapeDtypeStruct(shape, out, layout=out_layout))
  def convert(_, x):
    i8 = ir.IntegerType.get_signless(8)
    i32 = ir.IntegerType.get_signless(32)
    el = ir.BF16Type.get() if out == jnp.bfloat16 else ir.F16Type.get()
    pair = ir.VectorType.get((2,), el)
    layout = mgpu_fa.WGMMA_LAYOUT if operand else mgpu_fa.WGMMA_LAYOUT_UPCAST_2X
    regs = np.empty(layout.registers_shape(shape), dtype=object)
    for idx, reg in np.ndenumerate(x.registers):
      word = mgpu_utils.bitcast(
          mgpu_utils.bitcast(reg, ir.VectorType.get((4,), i8)), i32)
      if not operand:
        # Bytes (b0, b2, b1, b3): the pairs come out as (b0, b1), (b2, b3),
        # the tile's own order.
        word = llvm.inline_asm(i32, [word], "prmt.b32 $0, $1, 0, 0x3120;", "=r,r")
      res = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), [word],
                            ptx, "=r,=r,r")
      lo, hi = (mgpu_utils.bitcast(llvm.extractvalue(i32, res, [j]), pair)
                for j in (0, 1))
      if operand:
        # The two halves of a thread's 4 columns are its two 8-column
        # tiles of the A layout (WGMMA_UPCAST_2X -> WGMMA without the
        # shuffle): the columns come in permute_k's order.
        regs[(idx[0], idx[1] * 2, *idx[2:-1])] = lo
        regs[(idx[0], idx[1] * 2 + 1, *idx[2:-1])] = hi
      else:
        regs[idx] = mgpu_utils.vector_concat([lo, hi])
    return mgpu_fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return convert(src)


# Rows of an 8-bit tile converted at once into a staging tile: the
# converted rows occupy registers next to the epilogue state that the
# controls kernel carries across tiles.
_STAGE_ROWS = 64


def stage_weight(w_ref, stage_ref, *, interpret: bool):
  """Converts the 8-bit tile ``w_ref`` into ``stage_ref`` (SMEM, same
  shape, bf16/f16, wgmma transforms) and makes it visible to the wgmma
  (``WeightPath.STAGED``)."""
  for r in range(0, w_ref.shape[0], _STAGE_ROWS):
    rows = pl.ds(r, min(_STAGE_ROWS, w_ref.shape[0] - r))
    stage_ref[rows] = dequantized(w_ref.at[rows], stage_ref.dtype,
                                  interpret=interpret, operand=False)
  plgpu.commit_smem()


def scale_mode(scale) -> str | None:
  """How a launch reads the weight scale ``scale`` (None, an f32 scalar or
  an f32 ``[rows]``): None, ``"tensor"`` (a ``[1]`` GMEM array read once
  per tile) or ``"row"`` (each tile's ``[Vt]`` copied to SMEM)."""
  if scale is None:
    return None
  return "tensor" if jnp.ndim(scale) == 0 else "row"


def scale_operand(scale, rows_k: int):
  """``(operand, mode)``: the kernels' scale argument (None; ``[1]`` for a
  scalar: no ``[V]`` broadcast; ``[rows_k]`` per row, the padding rows'
  scale 0: they are masked anyway) and its :func:`scale_mode`."""
  mode = scale_mode(scale)
  if mode is None:
    return None, None
  scale = jnp.asarray(scale, jnp.float32)
  if mode == "tensor":
    return scale.reshape((1,)), mode
  return jnp.pad(scale, (0, rows_k - scale.shape[0])), mode


def scale_scratch(mode: str | None, vt: int) -> dict:
  """SMEM of a per-row scale: one ``[Vt]`` tile per compute warpgroup."""
  if mode != "row":
    return {}
  return dict(scale_smem=plgpu.SMEM((2, vt), jnp.float32),
              scale_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2))


def copy_scale_tile(scale_ref, start, vt: int, wg, *, scale_smem, scale_bar):
  """A compute warpgroup's prologue of a tile: copies the scale of its
  rows ``[start, start + Vt)`` to SMEM (the latency hides under the
  tile's wgmma)."""
  plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(start, vt)], scale_smem.at[wg],
                          scale_bar.at[wg])


def tile_scale(mode: str | None, scale_ref, wg, axis: int, *, scale_smem=None,
               scale_bar=None):
  """The scale of this warpgroup's tile for :func:`scaled`: None, a scalar,
  or the rows' ``[Vt]`` in ``WGMMA.reduce(1 - axis)`` (``axis``: the
  vocabulary axis of the accumulator). A per-row tile is waited for and
  read, then the warpgroup meets at a barrier, so that no warp's copy of
  its next tile overwrites the buffer before every warp has read it."""
  if mode is None:
    return None
  if mode == "tensor":
    return scale_ref[0]
  plgpu.barrier_wait(scale_bar.at[wg])
  s = plgpu.load(scale_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1 - axis))
  plgpu.commit_smem()  # the warpgroup's barrier (and a fence)
  return s


def scaled(acc, scale, axis: int):
  """The accumulator ``acc`` times the weight scale: ``scale`` a scalar
  (per tensor) or a vector along ``axis`` (per vocabulary row), in
  ``WGMMA.reduce(1 - axis)``. One f32 multiply before the accumulator goes
  to SMEM, so no later op can fuse with it (docs/design.md, "Quantized
  heads")."""
  if scale is None:
    return acc
  if jnp.ndim(scale) == 0:
    return acc * scale
  return acc * lax.broadcast_in_dim(scale, acc.shape, (axis,))


# ----------------------------------------------------------------------------
# The ping-pong frame
# ----------------------------------------------------------------------------


def batch_block(nb: int, n: int, h_ref, *per_block):
  """This CTA's part of a launch of ``nb`` batch blocks of ``n`` rows
  (``TuningConfig.batch_blocks``): CTA ``c`` of the grid serves block
  ``c % nb`` as CTA ``c // nb`` of that block's CTAs, so the ``nb`` CTAs
  that read one weight tile are grid neighbours and run at the same time
  (all but the first find the tile in L2).

  Returns ``(cta, h_ref, per_block)``: the CTA's index among its block's
  CTAs (the grid index when ``nb == 1``), ``h_ref`` [nb * n, D] narrowed to
  the block's rows, and each ref of ``per_block`` (a leading block axis)
  indexed by the block.
  """
  sm = lax.axis_index("sm")
  if nb == 1:
    return sm, h_ref, per_block
  block = lax.rem(sm, nb)
  return (sm // nb, h_ref.at[pl.ds(block * n, n)],
          tuple(r.at[block] for r in per_block))


def pingpong_frame(compute, *, cfg: TuningConfig, layout: str, n: int,
                   dim: int, rows: int, n_tiles: int, num_ctas: int, w_ref,
                   h_ref, rowdata_ref, rowdata_smem, acc_smem,
                   shared_acc: bool = True, cta=None, active=None,
                   interpret: bool = False, **scratch):
  """What the ping-pong kernels share: the SMEM ring and its barriers, the
  memory warpgroup, and each compute warpgroup's loop over its tiles.

  ``compute(wg=, tile_loop=, rowdata_smem=, acc_smem=, **scratch)`` runs on
  both compute warpgroups once the per-row data is in SMEM;
  ``tile_loop(epilogue, carry, prologue=None) -> carry`` runs the
  warpgroup's local tiles (:func:`pingpong_tile`). ``rowdata_smem``,
  ``acc_smem`` and ``scratch`` are the kernel's own SMEM allocations
  (``plgpu.SMEM`` types); ``shared_acc``: the warpgroups hand one
  accumulator buffer to each other (else each has its own). ``h_ref`` may
  have fewer rows than ``n`` (a multiple of 8, batch-major: the controls
  kernel's launches of fewer than 64 rows): its rows fill the top of each
  H slot, the rest of the slot is never written, and the accumulator rows
  it feeds are padding the caller drops (docs/performance.md, "The controls
  kernel"). The schedule's
  ``batch_major`` decides the operand order of the wgmma. ``cta``: this
  CTA's index among the ``num_ctas`` that share the tiles (default: its
  grid index; a kernel whose CTAs split into groups passes its own).
  ``active``: a traced bool; where false the CTA does nothing at all, so a
  launch whose work is not needed costs little more than its start.
  ``interpret``: Pallas' GPU interpret mode (the 8-bit conversion then
  runs as ``astype``).

  An 8-bit ``w_ref`` streams through the ring as it is and is converted by
  each compute warpgroup before its wgmma (:class:`~pallas_kernels.
  sm90_config.WeightPath`): into registers as the A operand (vocabulary on
  M, "vd": the caller passes H with :func:`permute_k`'s column order), or
  into a staging tile of the warpgroup's own.
  """
  vt, dt, S = cfg.tile_v, cfg.tile_d, cfg.max_concurrent_steps
  k_steps = step_count(dim, dt)
  w_block = (vt, dt) if layout == "vd" else (dt, vt)
  # The tile's swizzle must also divide the weight's own minor dimension
  # (the TMA copies whole swizzle rows): gpt-oss' D = 2880 of 8-bit weights
  # takes 64 bytes where its steps are 256 columns wide (step_count).
  w_minor = math.gcd(dt, w_ref.shape[1]) if layout == "vd" else w_block[1]
  h_transforms = tma_transforms(h_ref.dtype)
  path = weight_path(cfg.schedule, layout, jnp.dtype(w_ref.dtype).itemsize)
  batch_major = cfg.schedule.batch_major
  acc_shape = (n, vt) if batch_major else (vt, n)
  if path is WeightPath.STAGED or (path is WeightPath.REGISTERS and interpret):
    # One converted tile per compute warpgroup (WeightPath). Interpret mode
    # runs no wgmma with a register operand: the register path's tile, in
    # its permuted column order, goes through this tile there.
    scratch = dict(scratch, stage_smem=plgpu.SMEM(
        (2, *w_block), h_ref.dtype, transforms=h_transforms))

  def frame():
    @functools.partial(
        pl.run_scoped,
        w_smem=plgpu.SMEM((S, *w_block), w_ref.dtype,
                          transforms=tma_transforms(w_ref.dtype, w_minor)),
        h_smem=plgpu.SMEM((S, n, dt), h_ref.dtype, transforms=h_transforms),
        full=plgpu.Barrier(num_arrivals=2, num_barriers=2 * S),
        empty=plgpu.Barrier(num_arrivals=1, num_barriers=S),
        rowdata_smem=rowdata_smem,
        acc_smem=acc_smem,
        acc_free=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        rowdata_barrier=plgpu.Barrier(num_arrivals=1),
        collective_axes="wg",
        **scratch)
    def _scope(w_smem, h_smem, full, empty, rowdata_smem, acc_smem, acc_free,
               rowdata_barrier, **scratch):
      wg = lax.axis_index("wg")
      cta_ = lax.axis_index("sm") if cta is None else cta
      n_local = (n_tiles - 1 - cta_) // num_ctas + 1  # >= 1: num_ctas <= n_tiles

      @pl.when(wg == 2)
      def _memory_wg():
        plgpu.set_max_registers(40, action="decrease")
        # Per-row key words, counters and temperatures for every epilogue
        # (GMEM loads into the register layouts do not lower, SMEM ones do).
        plgpu.copy_gmem_to_smem(rowdata_ref, rowdata_smem, rowdata_barrier)
        with jax.named_scope("stream"):
          stream_steps(w_ref=w_ref, h_ref=h_ref, w_smem=w_smem, h_smem=h_smem,
                       full=full, empty=empty, layout=layout, vt=vt, dt=dt, S=S,
                       k_steps=k_steps, rows=rows, cta=cta_, num_ctas=num_ctas,
                       total=n_local * k_steps)

      stage_smem = scratch.pop("stage_smem", None)

      def operands(slot):
        w_slot = w_smem.at[slot]
        if path is WeightPath.REGISTERS:  # vocabulary on M, "vd"
          a = dequantized(w_slot, h_ref.dtype, interpret=interpret, operand=True)
          if interpret:
            stage_smem[wg] = a
            a = stage_smem.at[wg]
          return a, h_smem.at[slot].T
        if path is WeightPath.STAGED:
          w_slot = stage_smem.at[wg]
          stage_weight(w_smem.at[slot], w_slot, interpret=interpret)
        if batch_major:  # acc[N, Vt] = H @ W_tile.T
          return h_smem.at[slot], (w_slot.T if layout == "vd" else w_slot)
        return (w_slot if layout == "vd" else w_slot.T), h_smem.at[slot].T

      @pl.when(wg < 2)
      def _compute_wg():
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(rowdata_barrier)
        # A converted tile (staged or in registers) is rewritten every
        # step: its wgmma must be done first (WeightPath).
        in_flight = cfg.mma_in_flight if path is WeightPath.DIRECT else 0
        consume = functools.partial(consume_tile, wg=wg, k_steps=k_steps, S=S,
                                    full=full, empty=empty, operands=operands,
                                    in_flight=in_flight)

        def tile_loop(epilogue, carry, prologue=None):
          return lax.fori_loop(
              0, (n_local - wg + 1) // 2,
              lambda j, c: pingpong_tile(
                  i=wg + 2 * j, wg=wg, cta=cta_, num_ctas=num_ctas, vt=vt,
                  rows=rows, acc_shape=acc_shape, n_local=n_local,
                  acc_free=acc_free if shared_acc else None, consume=consume,
                  epilogue=epilogue,
                  prologue=prologue, carry=c),
              carry)

        compute(wg=wg, tile_loop=tile_loop, rowdata_smem=rowdata_smem,
                acc_smem=acc_smem, **scratch)

  if active is None:
    frame()
  else:
    # Nothing of the frame runs where the launch is not needed: no barrier,
    # no copy, no epilogue (its outputs are then not written).
    pl.when(active)(frame)


def pingpong_tile(*, i, wg, cta, num_ctas: int, vt: int, rows: int,
                  acc_shape, n_local, acc_free, consume, epilogue, prologue,
                  carry):
  """Local tile ``i`` of a ping-pong compute warpgroup: ``prologue(tile,
  start)`` if given (e.g. issue copies the epilogue needs), its wgmma over
  the stream (``consume``), then ``epilogue(acc, tile, start, first_new,
  carry) -> carry`` while holding the shared accumulator buffer
  (``acc_free``; None: each warpgroup has its own)."""
  tile = cta + i * num_ctas
  start = tile_start(tile, vt, rows)
  if prologue is not None:
    prologue(tile, start)

  def mma(acc_ref):
    consume(acc_ref, i=i)
    return acc_ref[...]

  with jax.named_scope("mma"):
    acc = pl.run_scoped(mma, plgpu.ACC(acc_shape, jnp.float32))

  if acc_free is None:
    with jax.named_scope("epilogue"):
      return epilogue(acc, tile, start, tile * vt - start, carry)

  # The accumulator buffer is shared: wait until the other warpgroup's
  # epilogue (of local tile i - 1) has read it all.
  @pl.when(i > 0)
  def _():
    with jax.named_scope("acc_wait"):
      plgpu.barrier_wait(acc_free.at[wg])

  with jax.named_scope("epilogue"):
    carry = epilogue(acc, tile, start, tile * vt - start, carry)

  # Every thread arrives once it is done reading (Lane semantics count 128
  # arrivals); none after the CTA's last tile, so that every phase is waited
  # on exactly once.
  @pl.when(i + 1 < n_local)
  def _():
    plgpu.barrier_arrive(acc_free.at[1 - wg])

  return carry


def stream_steps(*, w_ref, h_ref, w_smem, h_smem, full, empty, layout: str,
                 vt: int, dt: int, S: int, k_steps: int, rows: int, cta,
                 num_ctas: int, total):
  """The memory warpgroup of the ping-pong kernels: streams the CTA's
  ``(local tile i, k)`` steps in order through the ring of ``S`` slots.
  Where ``dt`` does not divide D the last step's copies run past the
  weight's and H's last column: the TMA fills zeros there
  (:func:`step_count`)."""

  @pl.loop(0, total)
  def _step(s):
    slot, i, k = ring_step(s, S=S, k_steps=k_steps, empty=empty)
    start = tile_start(cta + i * num_ctas, vt, rows)
    col = k * dt
    if layout == "vd":
      w_src = w_ref.at[pl.ds(start, vt), pl.ds(col, dt)]
    else:
      w_src = w_ref.at[pl.ds(col, dt), pl.ds(start, vt)]
    bar = full.at[lax.rem(i, 2) * S + slot]
    plgpu.copy_gmem_to_smem(w_src, w_smem.at[slot], bar)
    # H may have fewer rows than the slot (a multiple of 8): its rows fill
    # the top of the slot and the rest is never written (those accumulator
    # rows are padding, dropped by the caller).
    h_rows = h_ref.shape[0]
    h_dst = (h_smem.at[slot] if h_rows == h_smem.shape[1]
             else h_smem.at[slot, pl.ds(0, h_rows)])
    plgpu.copy_gmem_to_smem(h_ref.at[:, pl.ds(col, dt)], h_dst, bar)

  # Observe the last release of every slot used (each barrier phase is
  # waited once; interpret mode checks it), so that no slot is still read
  # when the CTA exits.
  @pl.loop(jnp.maximum(total - S, 0), total)
  def _drain(s):
    plgpu.barrier_wait(empty.at[lax.rem(s, S)])


def step_count(dim: int, dt: int) -> int:
  """A tile's steps of ``dt`` columns over ``dim``. Where ``dt`` does not
  divide ``dim`` (gpt-oss' 2880 in steps of 256: 12, the last holding 64
  columns) the last step's copies of W and H run past their last column:
  the TMA fills zeros there (interpret mode too), so the extra products are
  0 x 0 whatever the weight holds, and H needs no padding
  (docs/performance.md, "Steps that do not divide D")."""
  if dim % 64:
    raise ValueError(f"D={dim} must be a multiple of 64")
  return -(-dim // dt)


def ring_step(s, *, S: int, k_steps: int, empty):
  """Step ``s`` of a memory warpgroup's stream: ``(slot, local tile i, k)``,
  once the slot's previous use (step ``s - S``) has been released."""
  slot = lax.rem(s, S)
  i = s // k_steps

  @pl.when(s >= S)
  def _():
    plgpu.barrier_wait(empty.at[slot])

  return slot, i, s - i * k_steps


def tile_start(tile, vt: int, rows: int):
  """First weight row of a tile. The last tile is moved back so that it
  ends at the last weight row: no out-of-bounds TMA; rows already seen are
  masked in the epilogue (``first_new``)."""
  return jnp.minimum(tile * vt, rows - vt)


def consume_tile(acc_ref, *, i, wg, k_steps: int, S: int, full, empty,
                 operands, in_flight: int):
  """A compute warpgroup's wgmma over the ``k_steps`` slots of its local
  tile ``i`` (ping-pong kernels). With ``in_flight=1`` one wgmma stays in
  flight: a slot is released once the next step's wgmma is issued and the
  previous finished; with 0 each slot is released as soon as its wgmma
  is done."""

  def step(k, _):
    s = i * k_steps + k
    slot = lax.rem(s, S)
    plgpu.barrier_wait(full.at[wg * S + slot])
    plgpu.wgmma(acc_ref, *operands(slot))
    plgpu.wgmma_wait(in_flight)
    if in_flight:
      @pl.when(k > 0)
      def _():
        plgpu.barrier_arrive(empty.at[lax.rem(s - 1 + S, S)])
    else:
      plgpu.barrier_arrive(empty.at[slot])

    return ()

  lax.fori_loop(0, k_steps, step, ())
  if in_flight:
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(empty.at[lax.rem(i * k_steps + k_steps - 1, S)])

