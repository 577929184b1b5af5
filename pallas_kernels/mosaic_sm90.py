"""The ``mosaic`` backend: a fused Pallas Mosaic GPU kernel for Hopper (sm90).

One launch streams the LM head ``W`` through shared memory once and keeps, for
every (vocabulary tile, batch row), the best ``(score, global id)``; plain JAX
then reduces the ``[n_tiles, B]`` candidates (DESIGN.md section 3).

Shape of the work ("swap AB", because decode batches are small and wgmma's M
is 64 per warpgroup)::

    acc[Vt, N] = W_tile[Vt, D] @ H[N, D].T        (f32, wgmma, K loop over Dt)
    score      = acc / T + gumbel(key, ctr + gid)  (sampled rows; greedy: acc)
    cand[t, n] = (max_v score, lowest gid attaining it; NaN wins)

The module has four parts (STYLE.md): the frozen :class:`TuningConfig`, the
kernel body (:func:`_kernel`), the launcher (:func:`_launch` and the public
:func:`candidates`), and the heuristic (:func:`pick_config`).

Design choices and the measurements behind them are in DESIGN.md section 3
and ``benchmarks/PERF_LOG.md``; the two traps it lists shape this kernel:

* one compute warpgroup per CTA, so the cross-warp column reductions (whose
  SMEM scratch sits at one fixed offset) never race (trap 1);
* every step waits for its wgmma (``wgmma_wait(0)``, no ``delay_release``):
  see trap 2 and the comment in ``mma_body``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashsample_jax import _core, noise
from flashsample_jax._validate import Problem

__all__ = [
    "TuningConfig",
    "check_supported",
    "candidates",
    "pick_config",
    "interpret_mode",
    "abstract_h100",
    "MAX_N",
]

# wgmma's N (our batch side) is a multiple of 8 up to 256 (DESIGN.md section 3,
# probed on the H100: N=4 and N>256 are rejected).
MAX_N = 256
_N_ALIGN = 8
# 128-byte swizzle: 64 bf16/f16 elements per swizzled row.
_SWIZZLE = 128
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# H100/H200 allow 227 KiB of dynamic SMEM per block; keep room for the
# reduction scratch and barriers.
_SMEM_BUDGET = 200 * 1024
_REDUCTION_SCRATCH_BYTES = 2 * 128 * 6 * 4  # CompilerParams' suggested value
_INT_MAX = np.iinfo(np.int32).max
# Noise elements per thread in one epilogue chunk (see pick_config).
_EPI_ELEMS_PER_THREAD = 16
# Alignment of the vocabulary axis that TMA needs (see candidates()).
_VD_ROW_ALIGN = 8
_DV_COL_ALIGN = _SWIZZLE // 2
# Rows of the per-row data block (5 used): 8 * N * 4 bytes is a multiple of
# 128, which Lane-semantics copies need (bytes divisible by warpgroup size).
_ROWDATA = 8
# An H100 SXM has 132 SMs; used only when no device or abstract mesh says.
_DEFAULT_NUM_SMS = 132


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Static tiling of one kernel launch; validated on construction.

  Attributes:
    tile_v: ``Vt``, vocabulary rows per tile (the wgmma M side): a multiple of
      64. The accumulator ``[Vt, N]`` f32 lives in the registers of one
      warpgroup: ``Vt * N / 128`` registers per thread.
    tile_d: ``Dt``, hidden elements per pipeline step (the wgmma K side): a
      multiple of 64 (one 128-byte swizzle row of bf16/f16).
    max_concurrent_steps: pipeline depth (SMEM slots per operand).
    epi_cols: columns of the accumulator in one epilogue chunk: 8 or 16
      (f32 SMEM transfers of wider WGMMA-layout chunks fail to lower: "Failed
      to synthesize a transfer pattern that avoids bank conflicts").
    epi_unroll: chunks per iteration of the epilogue loop (more independent
      work per thread, more code).
    num_ctas: CTAs of the persistent grid; None means one per SM.
  """

  tile_v: int = 128
  tile_d: int = 64
  max_concurrent_steps: int = 4
  epi_cols: int = 16
  epi_unroll: int = 1
  num_ctas: int | None = None

  def __post_init__(self):
    tile_v, tile_d = self.tile_v, self.tile_d
    max_concurrent_steps, epi_cols = self.max_concurrent_steps, self.epi_cols
    num_ctas = self.num_ctas
    for name, v in (("tile_v", tile_v), ("tile_d", tile_d),
                    ("max_concurrent_steps", max_concurrent_steps),
                    ("epi_cols", epi_cols), ("epi_unroll", self.epi_unroll)):
      if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}={v!r} must be an int")
    if tile_v <= 0 or tile_v % 64:
      raise ValueError(f"{tile_v=} must be a positive multiple of 64")
    if tile_d <= 0 or tile_d % 64:
      raise ValueError(f"{tile_d=} must be a positive multiple of 64")
    if max_concurrent_steps < 1:
      raise ValueError(f"{max_concurrent_steps=} must be >= 1")
    if epi_cols not in (8, 16):
      raise ValueError(f"{epi_cols=} must be 8 or 16")
    epi_unroll = self.epi_unroll
    if epi_unroll < 1:
      raise ValueError(f"{epi_unroll=} must be >= 1")
    if num_ctas is not None and (isinstance(num_ctas, bool)
                                 or not isinstance(num_ctas, int)
                                 or num_ctas < 1):
      raise ValueError(f"{num_ctas=} must be None or a positive int")

  def smem_bytes(self, n: int, itemsize: int = 2) -> int:
    """SMEM of this config for a batch side of ``n`` rows: pipeline slots,
    the f32 accumulator copy the epilogue loops over, the per-row data."""
    pipeline = self.max_concurrent_steps * (self.tile_v + n) * self.tile_d * itemsize
    return pipeline + self.tile_v * n * 4 + _ROWDATA * n * 4

  def check_problem(self, *, n: int, dim: int, rows: int, itemsize: int = 2):
    """Raises ValueError if this config cannot run the given shapes."""
    if n % _N_ALIGN or not 0 < n <= MAX_N:
      raise ValueError(f"batch side {n=} must be a multiple of 8 in [8, {MAX_N}]")
    if n % (self.epi_cols * self.epi_unroll):
      raise ValueError(
          f"epi_cols={self.epi_cols} x epi_unroll={self.epi_unroll} must "
          f"divide the batch side {n=}")
    if dim % self.tile_d:
      raise ValueError(f"tile_d={self.tile_d} must divide D={dim}")
    if rows < self.tile_v:
      raise ValueError(f"tile_v={self.tile_v} must be <= the weight rows V={rows}")
    if self.tile_v * n // 128 > 128:
      raise ValueError(
          f"tile_v={self.tile_v} x N={n} needs {self.tile_v * n // 128} "
          "accumulator registers per thread; at most 128 leave room for the "
          "epilogue")
    smem = self.smem_bytes(n, itemsize)
    if smem > _SMEM_BUDGET:
      raise ValueError(
          f"{self} needs {smem} bytes of SMEM for N={n}, more than "
          f"{_SMEM_BUDGET}")


# ----------------------------------------------------------------------------
# Heuristic
# ----------------------------------------------------------------------------


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def batch_side(batch: int) -> int:
  """wgmma N for a batch chunk of ``batch <= MAX_N`` rows."""
  return min(MAX_N, _round_up(max(batch, 1), _N_ALIGN))


def pick_config(n: int, dim: int, rows: int, itemsize: int = 2,
                num_sms: int | None = None) -> TuningConfig:
  """Config for batch side ``n`` (a multiple of 8), hidden ``D``, ``V`` rows.

  Heuristic, no autotuning (DESIGN.md section 4):

  * ``Vt = 128`` while the accumulator fits in 128 registers (N <= 128),
    else 64: a taller tile reads ``H`` from L2 fewer times per ``W`` byte.
  * epilogue loop iterations of ``Vt * epi_cols * epi_unroll / 128 = 16``
    noise elements per thread: the loop body bounds the epilogue's code size
    (v1 unrolled every chunk: ~10k straight-line instructions ran at 0.07
    IPC per warp, see benchmarks/PERF_LOG.md) while leaving ILP.
    :func:`candidates` pads N to a multiple of ``epi_cols * epi_unroll``.
  * ``Dt = 128`` when D allows (fewer pipeline steps and barrier waits),
    else 64; as many pipeline slots as fit the SMEM budget (2 to 8).
  """
  del num_sms  # One CTA per SM for now; the table may use it later.
  tile_v = 128 if n <= 128 and rows >= 128 else 64
  epi_cols = 16
  epi_unroll = max(1, _EPI_ELEMS_PER_THREAD * 128 // (tile_v * epi_cols))
  n = _round_up(n, epi_cols * epi_unroll)
  fixed = tile_v * n * 4 + _ROWDATA * n * 4
  for tile_d in ((128, 64) if dim % 128 == 0 else (64,)):
    per_step = (tile_v + n) * tile_d * itemsize
    steps = min(8, (_SMEM_BUDGET - fixed) // per_step)
    if steps >= 2:
      break
  return TuningConfig(tile_v=tile_v, tile_d=tile_d,
                      max_concurrent_steps=max(2, steps), epi_cols=epi_cols,
                      epi_unroll=epi_unroll)


# ----------------------------------------------------------------------------
# Interpret mode (CI on the CPU) and support checks
# ----------------------------------------------------------------------------

_STATE = threading.local()
# The abstract device interpret mode and CUDA lowering on the CPU pretend to
# be (JAX's own tests/pallas/gpu_pallas_interpret_test.py does the same).
_H100_KIND = "NVIDIA H100 80GB HBM3"


def _pretending_sm90() -> bool:
  """True inside interpret_mode() or abstract_h100(): act as if on an H100."""
  return getattr(_STATE, "pretend_sm90", False)


def h100_abstract_mesh(num_cores: int = _DEFAULT_NUM_SMS):
  """An abstract mesh whose device is an H100 with ``num_cores`` SMs."""
  device = jax.sharding.AbstractDevice(
      device_kind=_H100_KIND, platform="gpu", num_cores=num_cores)
  return jax.sharding.AbstractMesh((), (), abstract_device=device)


@contextlib.contextmanager
def _pretend_sm90():
  prev = _pretending_sm90()
  _STATE.pretend_sm90 = True
  try:
    yield
  finally:
    _STATE.pretend_sm90 = prev


@contextlib.contextmanager
def abstract_h100(num_cores: int = _DEFAULT_NUM_SMS):
  """Traces the kernel for an H100 without one (to lower for CUDA on a CPU).

  Inside, :func:`check_supported` accepts any device and the grid is sized
  for ``num_cores`` SMs. For tests: ``jax.jit(f).trace(...).lower(
  lowering_platforms=("cuda",))`` then runs the Pallas -> Mosaic GPU lowering
  of every config without a GPU.
  """
  with _pretend_sm90(), jax.sharding.use_abstract_mesh(
      h100_abstract_mesh(num_cores)):
    yield


@contextlib.contextmanager
def interpret_mode(num_cores: int = 4, **params):
  """Runs the real kernel on the CPU in Pallas Mosaic GPU interpret mode.

  For tests: inside this context :func:`check_supported` accepts any device,
  and every launch is traced with ``plgpu.force_gpu_interpret_mode`` under an
  abstract H100 mesh of ``num_cores`` SMs (few CTAs keep interpretation fast).
  Interpret mode misses races and accepts ops that do not lower; see
  DESIGN.md section 3.

  Args:
    num_cores: SMs of the pretend GPU (CTAs of the persistent grid).
    **params: passed to ``plgpu.InterpretGPUParams``.
  """
  with (abstract_h100(num_cores),
        plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(**params))):
    yield


def _is_sm90_device() -> bool:
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def _num_sms() -> int:
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
  return _DEFAULT_NUM_SMS


def check_supported(p: Problem) -> None:
  """Raises NotImplementedError if this backend cannot run ``p`` here.

  Needs an sm90 GPU as JAX's default device (or :func:`interpret_mode`),
  bf16/f16 weights and ``D`` a multiple of 64. Any ``B`` and ``V``.
  """
  if not _pretending_sm90() and not _is_sm90_device():
    try:
      dev = jax.devices()[0]
      where = f"{dev.platform} device {getattr(dev, 'device_kind', dev)}"
    except RuntimeError:
      where = "no device"
    raise NotImplementedError(
        f"the mosaic backend needs an sm90 (Hopper) GPU; the default device is "
        f"a {where}")
  dtype = jnp.dtype(p.weight.dtype)
  if dtype not in _SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"the mosaic backend supports bfloat16 and float16 weights, got "
        f"weight.dtype={dtype}")
  if p.hidden_dim % 64:
    raise NotImplementedError(
        f"the mosaic backend needs D a multiple of 64, got D={p.hidden_dim}")


# ----------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------


def _div_rn(x, y):
  """f32 ``x / y`` as the kernel computes it (a plain division).

  Measured on the H200 (benchmarks/PERF_LOG.md, "division"): XLA's own f32
  division on the GPU differs from IEEE (NumPy) on 28% of random pairs, and
  this kernel's quotient differs from XLA's for some non-power-of-two T, with
  a plain ``/`` and with an f64 division rounded to f32 alike. Tokens agreed
  with the reference in every test; scores agree bit for bit when T is a
  power of two (division exact). Matching XLA's rounding bit for bit needs
  knowing which PTX division XLA emits; left open.
  """
  return x / y



def _kernel(off_ref, rowdata_ref, h_ref, w_ref, score_ref, index_ref, *,
            cfg: TuningConfig, layout: str, n: int, dim: int, rows: int,
            rows_valid: int, vocab_size: int, n_tiles: int):
  """One CTA: a persistent loop over vocabulary tiles.

  Refs (GMEM), with ``C = cfg.epi_cols`` and ``nc = N / C`` epilogue
  chunks: ``off_ref`` int32 [1] vocabulary offset; ``rowdata_ref`` uint32
  [nc, 8, C]: key words k0, k1, base counter hi, lo, the bits of the f32
  temperature, 3 rows of padding; ``h_ref`` [N, D]; ``w_ref`` [V, D] ("vd")
  or [D, V] ("dv"), ``V = rows`` of which the first ``rows_valid`` are real
  (the rest is alignment padding, see :func:`candidates`); outputs
  ``score_ref`` f32 and ``index_ref`` int32, both [n_tiles, nc, C].
  """
  vt, dt = cfg.tile_v, cfg.tile_d
  k_steps = dim // dt
  elems = _SWIZZLE // jnp.dtype(w_ref.dtype).itemsize
  transforms = (plgpu.TilingTransform((8, elems)),
                plgpu.SwizzleTransform(_SWIZZLE))
  if layout == "vd":
    w_spec = plgpu.BlockSpec((vt, dt), lambda k: (0, k), transforms=transforms)
  else:
    w_spec = plgpu.BlockSpec((dt, vt), lambda k: (k, 0), transforms=transforms)
  h_spec = plgpu.BlockSpec((n, dt), lambda k: (0, k), transforms=transforms)

  def make_pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[w_spec, h_spec], wg_axis="wg", num_compute_wgs=1,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context)

  def mma_body(_, w_smem, h_smem, acc_ref):
    a = w_smem if layout == "vd" else w_smem.T
    plgpu.wgmma(acc_ref, a, h_smem.T)
    # Wait for this step's wgmma before its slot is released. Keeping one in
    # flight (wgmma_wait(1) + delay_release=1, DESIGN.md trap 2) is not safe
    # across our per-tile pipelines: the memory warpgroup never waits for the
    # last step's release, so the next tile's prologue could overwrite the
    # slot the last wgmma still reads.
    plgpu.wgmma_wait(0)
    return acc_ref

  epi = cfg.epi_cols
  n_chunks = n // epi

  def _epilogue(acc, tile, start, first_new, rowdata_smem, acc_smem):
    # The accumulator goes to SMEM so that the noise runs in a (not unrolled)
    # loop over column chunks: unrolled, the epilogue was ~10k straight-line
    # instructions per tile and ran at ~0.07 IPC per warp (PERF_LOG.md v1).
    for j in range(n_chunks):
      acc_smem[j] = acc[:, j * epi:(j + 1) * epi]
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    local = plgpu.broadcasted_iota(jnp.int32, (vt, epi), 0,
                                   layout=plgpu.Layout.WGMMA)
    gid = local + (off_ref[0] + start)
    valid = ((local >= first_new) & (local + start < rows_valid)
             & (gid < vocab_size))
    gid_u = gid.astype(jnp.uint32)
    bcast = lambda x: lax.broadcast_in_dim(x, (vt, epi), (1,))

    def chunk(c):
      load = lambda i: bcast(plgpu.load(rowdata_smem.at[c, i],
                                        layout=col_layout))
      l = plgpu.load(acc_smem.at[c], layout=plgpu.Layout.WGMMA)
      hi, lo = noise.add_u32(load(2), load(3), gid_u)
      g = noise.gumbel(load(0), load(1), hi, lo)
      t = lax.bitcast_convert_type(load(4), jnp.float32)
      greedy = t == 0.0
      s = jnp.where(greedy, l, _div_rn(l, jnp.where(greedy, 1.0, t)) + g)
      s = jnp.where(valid, s, -jnp.inf)
      # max.NaN: m is NaN iff the column holds a NaN; NaN rows then win.
      m = jnp.max(s, axis=0)
      hit = valid & ((s == bcast(m)) | (s != s))
      idx = jnp.min(jnp.where(hit, gid, _INT_MAX), axis=0)
      score_ref[tile, c] = m
      index_ref[tile, c] = idx

    def body(it, carry):
      for u in range(cfg.epi_unroll):
        chunk(it * cfg.epi_unroll + u)
      return carry

    lax.fori_loop(0, n_chunks // cfg.epi_unroll, body, 0)

  ignore = lambda *_, **__: None
  w_view = (w_ref.at[pl.ds(0, vt), :] if layout == "vd"
            else w_ref.at[:, pl.ds(0, vt)])

  @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(ignore, ignore).get_allocations(w_view, h_ref),
      rowdata_smem=plgpu.SMEM((n_chunks, _ROWDATA, epi), jnp.uint32),
      acc_smem=plgpu.SMEM((n_chunks, vt, epi), jnp.float32),
      rowdata_barrier=plgpu.Barrier(num_arrivals=1),
      collective_axes="wg")
  def _scope(allocs, rowdata_smem, acc_smem, rowdata_barrier):
    # Per-row key words, counters and temperatures, read by every epilogue:
    # GMEM loads into the column layout do not lower, SMEM ones do.
    @pl.when(lax.axis_index("wg") == 0)
    def _():
      plgpu.copy_gmem_to_smem(rowdata_ref, rowdata_smem, rowdata_barrier)
      plgpu.barrier_wait(rowdata_barrier)

    @plgpu.nd_loop((n_tiles,), collective_axes="sm")
    def _tile_loop(info):
      (tile,) = info.index
      # The last tile is moved back so that it ends at the last weight row:
      # no out-of-bounds TMA, and rows already seen are masked out below.
      start = jnp.minimum(tile * vt, rows - vt)
      first_new = tile * vt - start  # local rows < first_new were done before
      w_tile = (w_ref.at[pl.ds(start, vt), :] if layout == "vd"
                else w_ref.at[:, pl.ds(start, vt)])

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped,
                           acc_ref=plgpu.ACC((vt, n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...]
          _epilogue(acc, tile, start, first_new, rowdata_smem, acc_smem)

      make_pipeline(mma_body, compute_context)(w_tile, h_ref,
                                               allocations=allocs)

# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def _launch(offset, rowdata, h, w, *, cfg: TuningConfig, layout: str,
            rows_valid: int, vocab_size: int):
  """Runs the kernel on one batch chunk (``h`` [N, D], N <= 256 padded)."""
  n, dim = h.shape
  rows = w.shape[0] if layout == "vd" else w.shape[1]
  n_tiles = -(-rows // cfg.tile_v)
  cfg.check_problem(n=n, dim=dim, rows=rows, itemsize=h.dtype.itemsize)
  num_ctas = min(cfg.num_ctas or _num_sms(), n_tiles)
  body = functools.partial(_kernel, cfg=cfg, layout=layout, n=n, dim=dim,
                           rows=rows, rows_valid=rows_valid,
                           vocab_size=vocab_size, n_tiles=n_tiles)
  nc = n // cfg.epi_cols
  out_type = (jax.ShapeDtypeStruct((n_tiles, nc, cfg.epi_cols), jnp.float32),
              jax.ShapeDtypeStruct((n_tiles, nc, cfg.epi_cols), jnp.int32))
  f = plgpu.kernel(
      body, out_type=out_type, grid=(num_ctas,), grid_names=("sm",),
      num_threads=2, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          reduction_scratch_bytes=_REDUCTION_SCRATCH_BYTES,
          lowering_semantics=plgpu.LoweringSemantics.Lane))
  s, i = f(offset, rowdata, h, w)
  return s.reshape(n_tiles, n), i.reshape(n_tiles, n)


def candidates(p: Problem, *, vocab_offset=0, config: TuningConfig | None = None):
  """Best ``(score f32 [B], global id int32 [B])`` over ``p.weight``'s rows.

  Same contract as :func:`flashsample_jax.xla_backend.candidates`.

  Args:
    p: the validated problem (see :func:`check_supported`).
    vocab_offset: global id of the weight's first row (int or traced int32
      scalar, e.g. inside ``shard_map``).
    config: override the heuristic's config (tests, benchmarks).

  Returns:
    ``(score [B] f32, token [B] int32)``.
  """
  check_supported(p)
  offset = jnp.asarray(vocab_offset, jnp.int32).reshape((1,))
  rows = p.weight_rows
  w = p.weight
  # TMA with a tiled SMEM destination tiles the whole GMEM array, so the
  # vocabulary axis must be a multiple of the tile there: 8 rows for "vd",
  # one 64-wide swizzle row for "dv". Real LM heads are padded that way
  # (151936 and 128256 are multiples of 64); anything else pays one copy of
  # W here, and the padding rows are masked in the kernel.
  align = _VD_ROW_ALIGN if p.layout == "vd" else _DV_COL_ALIGN
  rows_k = max(_round_up(rows, align), 64)  # at least one 64-row tile
  if rows_k != rows:
    w = jnp.pad(w, [(0, rows_k - rows), (0, 0)] if p.layout == "vd"
                else [(0, 0), (0, rows_k - rows)])
  scores, tokens = [], []
  for b0 in range(0, p.batch, MAX_N):
    b1 = min(p.batch, b0 + MAX_N)
    nb = b1 - b0
    n = batch_side(nb)
    cfg = config or pick_config(n, p.hidden_dim, rows_k,
                                jnp.dtype(p.weight.dtype).itemsize)
    n = min(MAX_N, _round_up(n, cfg.epi_cols * cfg.epi_unroll))
    pad = lambda x: jnp.pad(x[b0:b1], [(0, n - nb)] + [(0, 0)] * (x.ndim - 1))
    rowdata = jnp.stack([
        p.k0, p.k1, p.ctr_hi, p.ctr_lo,
        lax.bitcast_convert_type(p.temperature, jnp.uint32)])
    rowdata = jnp.pad(rowdata[:, b0:b1], [(0, _ROWDATA - 5), (0, n - nb)])
    # [8, N] -> [nc, 8, C]: one contiguous block per epilogue chunk.
    rowdata = rowdata.reshape(_ROWDATA, n // cfg.epi_cols, cfg.epi_cols)
    rowdata = rowdata.transpose(1, 0, 2)
    s, i = _launch(offset, rowdata, pad(p.hidden.astype(p.weight.dtype)),
                   w, cfg=cfg, layout=p.layout, rows_valid=rows,
                   vocab_size=p.vocab_size)
    s, i = _core.reduce_candidates(s, i, axis=0)
    scores.append(s[:nb])
    tokens.append(i[:nb])
  if len(scores) == 1:
    return scores[0], tokens[0]
  return jnp.concatenate(scores), jnp.concatenate(tokens)
