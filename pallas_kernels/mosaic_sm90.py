"""The ``mosaic`` backend: a fused Pallas Mosaic GPU kernel for Hopper (sm90).

One launch streams the LM head ``W`` through shared memory once and keeps,
per batch row, the best ``(score, global id)`` of each vocabulary tile (or of
each warpgroup's tiles); plain JAX then reduces the few candidates
(DESIGN.md section 3)::

    logits = W_tile @ H.T                          (f32, wgmma, K loop over Dt)
    score  = logits / T + gumbel(key, ctr + gid)   (sampled rows; greedy: logits)
    cand   = (max score, lowest gid attaining it; NaN wins)

Three schedules, all warp-specialized (one TMA warpgroup, two compute
warpgroups) and persistent over vocabulary tiles; :func:`pick_config` picks
by batch size (measurements in ``benchmarks/PERF_LOG.md``):

* :func:`_kernel_pingpong` (v4, ``N <= 48``; v9, ``N > 128``): vocabulary on
  the wgmma M side ("swap AB"), the two warpgroups alternate whole tiles
  over one hand-written ring of SMEM slots (:func:`_stream_steps`,
  :func:`_consume_tile`), so one's epilogue overlaps the other's share of
  the weight stream. ``N <= 48``: tiles of 128 rows, one shared accumulator
  buffer, each slot released as soon as its wgmma is done. ``N > 128``:
  tiles of 64 rows, a buffer per warpgroup filled in 4 column passes.
  Column reductions across warps use per-warpgroup SMEM scratch through
  ``plgpu.inline_mgpu`` (:func:`_col_reduce`), because ``jnp.max``'s scratch
  sits at one fixed offset and races between warpgroups (DESIGN.md trap 1).
* :func:`_kernel_batch_major` (v5, ``48 < N <= 128``): the same ping-pong
  with the batch on the M side (``acc[N, Vt]``): the per-row argmax reduces
  inside each warp (no barriers, no scratch) with a running best carried
  over chunks and tiles.
* :func:`_kernel` (v3, "cooperative", only where V < 128: one compute
  warpgroup): every step of ``emit_pipeline_warp_specialized`` shared,
  the accumulator to SMEM in column passes; every step waits for its wgmma
  (trap 2).

Sampling controls (top-k/top-p/min-p, bias, mask, soft-cap, several samples,
log-probabilities) run in a fourth kernel built on the same ping-pong frame,
:mod:`pallas_kernels.mosaic_controls`.

The module has four parts (STYLE.md): the frozen :class:`TuningConfig`, the
kernel bodies (with the shared :func:`_epilogue`), the launcher
(:func:`_launch` and the public :func:`candidates`), and the heuristic
(:func:`pick_config`).
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
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import memref

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
_SMEM_BUDGET = 212 * 1024
# Widest epilogue pass (columns of the accumulator copied to SMEM at once).
_MAX_PASS_COLS = 64
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
    compute_wgs: compute warpgroups per CTA (1 or 2). With 2, each owns
      ``tile_v / 2`` rows of the vocabulary tile (its own wgmma accumulator,
      epilogue and candidates): twice the warps for the noise epilogue.
    epi_passes: the accumulator goes to SMEM in this many column passes
      (each followed by its epilogue loop), so that the SMEM copy is
      ``tile_v * N / epi_passes`` f32 and leaves room for pipeline slots.
      With ``pingpong`` (vocabulary on M) and more than one pass, each
      compute warpgroup copies into its own buffer: no hand-over, so the
      two warpgroups' epilogues may run at the same time.
    pingpong: with ``compute_wgs=2``, the two compute warpgroups take turns
      on whole tiles of ``tile_v`` rows (each its own accumulator
      ``[tile_v, N]``), so that one's epilogue overlaps the other's wgmma
      and the weight stream never waits for an epilogue. False: both
      warpgroups share every tile (``tile_v / 2`` rows each) and run their
      wgmma and their epilogue at the same time.
    batch_major: put the batch on the wgmma M side (``acc[N, Vt] = H @
      W_tile.T``, N padded to a multiple of 64) instead of the vocabulary.
      The per-row argmax then reduces along the accumulator's columns,
      inside each warp (no cross-warp reductions, no barriers), and a
      running best per (row, column slot) carries over chunks and tiles:
      one candidate row per warpgroup leaves the CTA. Needs ``pingpong``.
    mma_in_flight: ping-pong consumers: wgmmas left in flight after each
      step's issue (1 or 0). With 1 the next step's issue overlaps the
      running wgmma, and a slot is released one step after its wgmma (the
      consumer holds two slots); with 0 each step waits for its wgmma and
      releases its slot at once (one more slot of the ring loading).
  """

  tile_v: int = 128
  tile_d: int = 64
  max_concurrent_steps: int = 4
  epi_cols: int = 16
  epi_unroll: int = 1
  num_ctas: int | None = None
  compute_wgs: int = 1
  epi_passes: int = 1
  pingpong: bool = False
  batch_major: bool = False
  mma_in_flight: int = 1

  def __post_init__(self):
    tile_v, tile_d = self.tile_v, self.tile_d
    max_concurrent_steps, epi_cols = self.max_concurrent_steps, self.epi_cols
    num_ctas = self.num_ctas
    for name, v in (("tile_v", tile_v), ("tile_d", tile_d),
                    ("max_concurrent_steps", max_concurrent_steps),
                    ("epi_cols", epi_cols), ("epi_unroll", self.epi_unroll),
                    ("compute_wgs", self.compute_wgs),
                    ("epi_passes", self.epi_passes)):
      if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}={v!r} must be an int")
    if tile_v <= 0 or tile_v % 64:
      raise ValueError(f"{tile_v=} must be a positive multiple of 64")
    if self.compute_wgs not in (1, 2):
      raise ValueError(f"compute_wgs={self.compute_wgs} must be 1 or 2")
    if not isinstance(self.pingpong, bool):
      raise TypeError(f"pingpong={self.pingpong!r} must be a bool")
    if self.pingpong and self.compute_wgs != 2:
      raise ValueError(f"pingpong needs compute_wgs=2, got {self.compute_wgs}")
    if self.mma_in_flight not in (0, 1) or isinstance(self.mma_in_flight, bool):
      raise ValueError(f"mma_in_flight={self.mma_in_flight!r} must be 0 or 1")
    if self.pingpong and max_concurrent_steps < 1 + self.mma_in_flight:
      # With one wgmma in flight a slot is released one step after its
      # wgmma is issued: a ring of one slot would wait on itself.
      raise ValueError(
          f"pingpong with mma_in_flight={self.mma_in_flight} needs "
          f"max_concurrent_steps >= {1 + self.mma_in_flight}, got "
          f"{max_concurrent_steps}")
    if not isinstance(self.batch_major, bool):
      raise TypeError(f"batch_major={self.batch_major!r} must be a bool")
    if self.batch_major and not self.pingpong:
      raise ValueError("batch_major needs pingpong=True")
    if self.batch_major and tile_v % (epi_cols * self.epi_unroll):
      raise ValueError(
          f"batch_major: epi_cols={epi_cols} x epi_unroll={self.epi_unroll} "
          f"must divide {tile_v=}")
    if self.batch_major and self.epi_passes != 1:
      raise ValueError(
          f"epi_passes={self.epi_passes}: batch_major copies the whole "
          "accumulator at once (one buffer shared by both warpgroups)")
    if tile_v % (64 * self.wg_share):
      raise ValueError(
          f"{tile_v=} must be a multiple of 64 x compute_wgs={self.compute_wgs}"
          " (warpgroups sharing a tile)")
    if self.epi_passes < 1:
      raise ValueError(f"epi_passes={self.epi_passes} must be >= 1")
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

  @property
  def wg_share(self) -> int:
    """Compute warpgroups that split one tile's rows (1 with pingpong)."""
    return 1 if self.pingpong else self.compute_wgs

  @property
  def wg_rows(self) -> int:
    """Vocabulary rows of one compute warpgroup's accumulator."""
    return self.tile_v // self.wg_share

  def batch_pad(self, n: int) -> int:
    """The kernel's batch side for ``n`` rows (a multiple of 8)."""
    if self.batch_major:  # wgmma M: multiples of 64
      return _round_up(n, 64)
    return min(MAX_N, _round_up(n, self.epi_cols * self.epi_unroll))

  def smem_bytes(self, n: int, itemsize: int = 2) -> int:
    """SMEM of this config for a batch side of ``n`` rows: pipeline slots,
    the f32 accumulator copies the epilogues loop over, the per-row data."""
    pipeline = self.max_concurrent_steps * (self.tile_v + n) * self.tile_d * itemsize
    if self.batch_major:
      return pipeline + self.tile_v * n * 4 + _ROWDATA * n * 4
    if self.pingpong and self.epi_passes == 1:  # shared by both warpgroups
      acc = self.tile_v * n * 4
    elif self.pingpong:  # one pass's columns per warpgroup
      acc = 2 * self.tile_v * self._pass_cols(n) * 4
    else:
      acc = self.compute_wgs * self.wg_rows * self._pass_cols(n) * 4
    return (pipeline + acc + _ROWDATA * n * 4
            + self.compute_wgs * 2 * _wg_scratch_elems(self.epi_cols) * 4)

  def _pass_cols(self, n: int) -> int:
    """Columns of the largest epilogue pass (see :func:`_passes`)."""
    return max(b - a for a, b in _passes(self, n)) * self.epi_cols

  def check_problem(self, *, n: int, dim: int, rows: int, itemsize: int = 2):
    """Raises ValueError if this config cannot run the given shapes."""
    if n % _N_ALIGN or not 0 < n <= MAX_N:
      raise ValueError(f"batch side {n=} must be a multiple of 8 in [8, {MAX_N}]")
    if self.batch_major:
      self._check_batch_major(n=n, dim=dim, rows=rows, itemsize=itemsize)
      return
    if n % (self.epi_cols * self.epi_unroll):
      raise ValueError(
          f"epi_cols={self.epi_cols} x epi_unroll={self.epi_unroll} must "
          f"divide the batch side {n=}")
    if dim % self.tile_d:
      raise ValueError(f"tile_d={self.tile_d} must divide D={dim}")
    if rows < self.tile_v:
      raise ValueError(f"tile_v={self.tile_v} must be <= the weight rows V={rows}")
    iters = n // (self.epi_cols * self.epi_unroll)
    if self.epi_passes > iters:
      raise ValueError(
          f"epi_passes={self.epi_passes} exceeds the {iters} epilogue loop "
          f"iterations of N={n}")
    regs = self.wg_rows * n // 128
    if regs > 128:
      raise ValueError(
          f"tile_v={self.tile_v} (rows per warpgroup {self.wg_rows}) x N={n} "
          f"needs {regs} "
          "accumulator registers per thread; at most 128 leave room for the "
          "epilogue")
    self._check_smem(n, itemsize)

  def _check_smem(self, n: int, itemsize: int):
    smem = self.smem_bytes(n, itemsize)
    if smem > _SMEM_BUDGET:
      raise ValueError(
          f"{self} needs {smem} bytes of SMEM for N={n}, more than "
          f"{_SMEM_BUDGET}")

  def _check_batch_major(self, *, n: int, dim: int, rows: int, itemsize: int):
    if n % 64:
      raise ValueError(f"batch_major: batch side {n=} must be a multiple of 64")
    if self.tile_v > MAX_N:
      raise ValueError(
          f"batch_major: tile_v={self.tile_v} is the wgmma N side, <= {MAX_N}")
    if dim % self.tile_d:
      raise ValueError(f"tile_d={self.tile_d} must divide D={dim}")
    if rows < self.tile_v:
      raise ValueError(f"tile_v={self.tile_v} must be <= the weight rows V={rows}")
    regs = n * self.tile_v // 128
    if regs > 128:
      raise ValueError(
          f"batch_major: N={n} x tile_v={self.tile_v} needs {regs} "
          "accumulator registers per thread; at most 128 leave room for the "
          "epilogue")
    self._check_smem(n, itemsize)


# ----------------------------------------------------------------------------
# Heuristic
# ----------------------------------------------------------------------------


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _passes(cfg: TuningConfig, n: int) -> list[tuple[int, int]]:
  """Static (first, end) epilogue chunks of each pass: the loop iterations
  (``epi_unroll`` chunks each) split as evenly as possible."""
  iters = n // (cfg.epi_cols * cfg.epi_unroll)
  p = min(cfg.epi_passes, iters)
  bounds = [iters * i // p * cfg.epi_unroll for i in range(p + 1)]
  return list(zip(bounds[:-1], bounds[1:]))


def _wg_scratch_elems(epi_cols: int) -> int:
  """Elements of one warpgroup's cross-warp reduction scratch: 4 warps x 32
  lanes x 2-vectors per 8 reduced columns (all of a chunk at once)."""
  return 4 * 32 * 2 * (epi_cols // 8)


# Rows per launch (one pass over W each): full chunks first, then the rest.
# A launch's cost grows slower than its rows, so chunks are as full as the
# kernel allows (one launch of 256 rows vs two of 128 on the H200: S B=256
# 836 vs 831 us, L 1197 vs 1301; B=192 667 vs 832; PERF_LOG v7).
CHUNK_ROWS = MAX_N


def batch_chunks(batch: int) -> list[tuple[int, int]]:
  """``[(b0, b1), ...]``: the row ranges of the launches for ``batch`` rows."""
  return [(b0, min(batch, b0 + CHUNK_ROWS)) for b0 in range(0, batch, CHUNK_ROWS)]


def batch_side(batch: int) -> int:
  """wgmma N for a batch chunk of ``batch <= MAX_N`` rows."""
  return min(MAX_N, _round_up(max(batch, 1), _N_ALIGN))


def pick_config(n: int, dim: int, rows: int, itemsize: int = 2,
                num_sms: int | None = None) -> TuningConfig:
  """Config for batch side ``n`` (a multiple of 8), hidden ``D``, ``V`` rows.

  Heuristic, no autotuning (DESIGN.md section 4; the measurements behind
  each choice are in benchmarks/PERF_LOG.md):

  * ``N <= 48``: ping-pong (v4), vocabulary on the wgmma M side, tiles of
    128 rows: two compute warpgroups alternate tiles, so one's epilogue
    overlaps the other's share of the weight stream.
  * ``48 < N <= 128``: ping-pong with the batch on the M side (v5, N padded
    to 64 or 128): the per-row argmax stays inside each warp, no barriers
    in the epilogue.
  * ``N > 128``: ping-pong (v9), vocabulary on M, tiles of 64 rows (an
    accumulator of ``[64, N]`` is 128 registers at N = 256): each warpgroup
    copies its accumulator to its own SMEM buffer in 4 column passes, so
    both epilogues may run at once.
  * V < 128 (one compute warpgroup), any N: cooperative (v3), the
    accumulator in passes of at most 64 columns.
  * epilogue loop iterations of 8 to 16 noise elements per thread: the loop
    body bounds the epilogue's code size (v1 unrolled every chunk: ~10k
    straight-line instructions ran at 0.07 IPC per warp) while leaving
    ILP. :meth:`TuningConfig.batch_pad` gives the padded batch side.
  * ``Dt = 128`` when D allows and 3 slots fit (fewer pipeline steps and
    barrier waits), else 64; as many pipeline slots as fit the SMEM budget
    (2 to 8).
  """
  del num_sms  # One CTA per SM for now; the table may use it later.
  compute_wgs = 2 if rows >= 128 else 1
  epi_cols = 16
  if compute_wgs == 2 and n <= 48:
    # Ping-pong on tiles of 128 vocabulary rows, vocabulary on the wgmma M
    # side: H slices of N <= 48 rows leave room for 4-5 slots of Dt = 128
    # (batch-major pads N to 64: 3 slots; L B=8 535 -> 566 us, PERF_LOG v5;
    # B=24/32/48 1-4% faster than batch-major, PERF_LOG v7c). Each slot is
    # released as soon as its wgmma is done (S B=16 311 -> 302 us, L 516 ->
    # 504; at N = 24-48 within +-1.5% of one in flight; PERF_LOG v7).
    tile_v, epi_unroll = 128, 1
    base = TuningConfig(tile_v=tile_v, epi_cols=epi_cols, epi_unroll=1,
                        compute_wgs=2, pingpong=True, max_concurrent_steps=2,
                        mma_in_flight=0)
  elif compute_wgs == 2 and n <= 128:
    # Batch on the wgmma M side (N padded to 64 or 128), ping-pong on tiles
    # of 128 vocabulary rows: no cross-warp reductions in the epilogue, and
    # one warpgroup's epilogue overlaps the other's stream (PERF_LOG.md v5).
    # N = 64: one chunk of [64, 16] per loop iteration (8 noise elements per
    # thread; unrolling twice measured 2-4% slower) and one wgmma kept in
    # flight (releasing each slot at once: 323 -> 333 us on the H200).
    # N = 128: chunks of [128, 8] (half the loop body) and each slot released
    # as soon as its wgmma is done: on the H100 S 484 -> 462 us, L 783 ->
    # 773 (PERF_LOG v9); each alone 1-2% on the H200 (PERF_LOG v7).
    tile_v = 128
    n = _round_up(n, 64)
    epi_unroll = 1
    wide = n > 64
    base = TuningConfig(tile_v=tile_v, epi_cols=8 if wide else epi_cols,
                        epi_unroll=epi_unroll, compute_wgs=2, pingpong=True,
                        batch_major=True, max_concurrent_steps=2,
                        mma_in_flight=0 if wide else 1)
  elif compute_wgs == 2:
    # N > 128: ping-pong over tiles of 64 vocabulary rows, a buffer of a
    # quarter of the accumulator per warpgroup (SMEM for 4 slots of Dt =
    # 64). On the H100 vs v3: S B=256 864 -> 817 us, B=192 711 -> 644, L
    # B=256 1227 -> 1147, B=192 1016 -> 1042 (PERF_LOG v9; a shared whole
    # buffer: S 794 / 654, L 1233 / 1108).
    tile_v = 64
    n = _round_up(n, epi_cols)
    base = TuningConfig(tile_v=tile_v, epi_cols=epi_cols, epi_unroll=1,
                        compute_wgs=2, pingpong=True, max_concurrent_steps=2,
                        epi_passes=min(4, n // epi_cols))
  else:
    # V < 128 (one compute warpgroup): vocabulary on M, the accumulator in
    # passes of at most 64 columns (PERF_LOG.md v3).
    tile_v = 64
    epi_unroll = max(1, _EPI_ELEMS_PER_THREAD * 128 // (64 * epi_cols))
    # B <= 16: no padding to a second chunk. N > 128: one chunk per
    # iteration; with two, the columns of later passes still live in
    # registers pushed the loop over the 232-register cap (B=256: 1254 ->
    # 794 us on the H200 with two compute warpgroups, PERF_LOG.md v3).
    if n <= epi_cols or n > 128:
      epi_unroll = 1
    per_iter = epi_cols * epi_unroll
    n = _round_up(n, per_iter)
    iters = n // per_iter
    epi_passes = -(-iters // max(1, _MAX_PASS_COLS // per_iter))
    base = TuningConfig(tile_v=tile_v, epi_cols=epi_cols, epi_unroll=epi_unroll,
                        compute_wgs=1, epi_passes=epi_passes,
                        max_concurrent_steps=1)
  n = base.batch_pad(n)
  fixed = (dataclasses.replace(base, max_concurrent_steps=2).smem_bytes(n, itemsize)
           - 2 * (tile_v + n) * 64 * itemsize)
  options = (128, 64) if dim % 128 == 0 else (64,)
  for tile_d in options:
    per_step = (tile_v + n) * tile_d * itemsize
    steps = min(8, (_SMEM_BUDGET - fixed) // per_step)
    if steps >= 3 or (steps >= 2 and tile_d == options[-1]):
      break
  return dataclasses.replace(base, tile_d=tile_d,
                             max_concurrent_steps=max(2, steps))


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
  prev = getattr(_STATE, "interpret", False)
  _STATE.interpret = True
  try:
    with (abstract_h100(num_cores),
          plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(**params))):
      yield
  finally:
    _STATE.interpret = prev


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



def _col_reduce(x, op: str, scratch):
  """``max``/``min`` of ``x`` [rows, C] (WGMMA layout) over axis 0.

  On the GPU the cross-warp step goes through ``scratch``, this warpgroup's
  own SMEM: ``jnp.max`` uses one scratch area at a fixed offset that two
  compute warpgroups would share and race on (DESIGN.md trap 1). Interpret
  mode cannot run inline Mosaic GPU code, and has no races: ``jnp`` there.
  """
  if getattr(_STATE, "interpret", False):
    return jnp.max(x, axis=0) if op == "max" else jnp.min(x, axis=0)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
      return_type=plgpu.ShapeDtypeStruct(
          (x.shape[1],), x.dtype, layout=plgpu.Layout.WGMMA.reduce(0)))
  def reduce(_, v, scratch_ref):
    return v.reduce(op, 0, scratch=scratch_ref)

  return reduce(x, scratch)


def _store_column(x, ref):
  """Stores ``x`` [C] (the column layout ``WGMMA.reduce(0)``) into ``ref``
  [C, 1], a column of a GMEM array (stride: its row length).

  Mosaic GPU's vector stores need the layout's vectorized dimension (two
  adjacent columns per thread here) to be contiguous in memory, so each
  thread stores its values one by one (the copies of a value that other
  warps hold store the same value). Interpret mode: a plain store.
  """
  if getattr(_STATE, "interpret", False):
    ref[:, 0] = x
    return

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(0), plgpu.RefType()))
  def store(_, v, out):
    zero = mgpu.utils.c(0, ir.IndexType.get())
    v.foreach(lambda val, idx: memref.store(val, out, [idx[0], zero]))

  store(x, ref)


def _epilogue(acc, *, cfg: TuningConfig, passes, row0, start, first_new,
              off_ref, rowdata_smem, acc_smem, scratch_f, scratch_i,
              score_ref, index_ref, out_row, rows_valid: int, vocab_size: int):
  """Noise, transform and per-column (max, first argmax) of one accumulator.

  ``acc`` [vw, N] f32 holds rows ``start + row0 + [0, vw)`` of the weight;
  rows below ``first_new`` (tile-local) were done by an earlier tile.
  Writes one candidate column ``score_ref[:, :, out_row]`` (and index).

  The accumulator goes to SMEM (``acc_smem`` [pass_chunks, vw, C]) so that
  the noise runs in a (not unrolled) loop over column chunks: unrolled, the
  epilogue was ~10k straight-line instructions per tile and ran at ~0.07
  IPC per warp (PERF_LOG.md v1). ``passes`` lists the (first, end) chunks
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

  def chunk(c, slot):
    load = lambda i: bcast(plgpu.load(rowdata_smem.at[c, i],
                                      layout=col_layout))
    l = plgpu.load(acc_smem.at[slot], layout=plgpu.Layout.WGMMA)
    hi, lo = noise.add_u32(load(2), load(3), gid_u)
    g = noise.gumbel(load(0), load(1), hi, lo)
    t = lax.bitcast_convert_type(load(4), jnp.float32)
    greedy = t == 0.0
    s = jnp.where(greedy, l, _div_rn(l, jnp.where(greedy, 1.0, t)) + g)
    s = jnp.where(valid, s, -jnp.inf)
    # max.NaN: m is NaN iff the column holds a NaN; NaN rows then win.
    m = _col_reduce(s, "max", scratch_f)
    hit = valid & ((s == bcast(m)) | (s != s))
    idx = _col_reduce(jnp.where(hit, gid, _INT_MAX), "min", scratch_i)
    _store_column(m, score_ref.at[c, :, pl.ds(out_row, 1)])
    _store_column(idx, index_ref.at[c, :, pl.ds(out_row, 1)])

  for first, end in passes:
    for j in range(first, end):
      acc_smem[j - first] = acc[:, j * epi:(j + 1) * epi]

    def body(it, carry, first=first):
      for u in range(cfg.epi_unroll):
        slot = it * cfg.epi_unroll + u
        chunk(first + slot, slot)
      return carry

    lax.fori_loop(0, (end - first) // cfg.epi_unroll, body, 0)


def _tma_transforms(dtype):
  elems = _SWIZZLE // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(_SWIZZLE))


def _kernel(off_ref, rowdata_ref, h_ref, w_ref, score_ref, index_ref, *,
            cfg: TuningConfig, layout: str, n: int, dim: int, rows: int,
            rows_valid: int, vocab_size: int, n_tiles: int, num_ctas: int):
  """One CTA: a persistent loop over vocabulary tiles (cooperative schedule).

  Refs (GMEM), with ``C = cfg.epi_cols`` and ``nc = N / C`` epilogue
  chunks: ``off_ref`` int32 [1] vocabulary offset; ``rowdata_ref`` uint32
  [nc, 8, C]: key words k0, k1, base counter hi, lo, the bits of the f32
  temperature, 3 rows of padding; ``h_ref`` [N, D]; ``w_ref`` [V, D] ("vd")
  or [D, V] ("dv"), ``V = rows`` of which the first ``rows_valid`` are real
  (the rest is alignment padding, see :func:`candidates`); outputs
  ``score_ref`` f32 and ``index_ref`` int32, both
  [nc, C, n_tiles * compute_wgs] (one column per warpgroup's part of a
  tile).
  """
  del num_ctas  # nd_loop partitions the tiles over the "sm" axis.
  vt, dt = cfg.tile_v, cfg.tile_d
  n_wg = cfg.compute_wgs
  vw = cfg.wg_rows
  k_steps = dim // dt
  transforms = _tma_transforms(w_ref.dtype)
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
  pass_chunks = max(b - a for a, b in _passes(cfg, n))

  ignore = lambda *_, **__: None
  w_view = (w_ref.at[pl.ds(0, vt), :] if layout == "vd"
            else w_ref.at[:, pl.ds(0, vt)])
  scratch_elems = _wg_scratch_elems(epi)

  @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(ignore, ignore).get_allocations(w_view, h_ref),
      rowdata_smem=plgpu.SMEM((n_chunks, _ROWDATA, epi), jnp.uint32),
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
      # in flight (wgmma_wait(1) + delay_release=1, DESIGN.md trap 2) is not
      # safe across our per-tile pipelines: the memory warpgroup never waits
      # for the last step's release, so the next tile's prologue could
      # overwrite the slot the last wgmma still reads.
      plgpu.wgmma_wait(0)
      return acc_ref

    @plgpu.nd_loop((n_tiles,), collective_axes="sm")
    def _tile_loop(info):
      (tile,) = info.index
      start = _tile_start(tile, vt, rows)
      first_new = tile * vt - start  # local rows < first_new were done before
      w_tile = (w_ref.at[pl.ds(start, vt), :] if layout == "vd"
                else w_ref.at[:, pl.ds(start, vt)])

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped,
                           acc_ref=plgpu.ACC((vw, n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          _epilogue(acc_ref[...], cfg=cfg, passes=_passes(cfg, n),
                    row0=wg * vw,
                    start=start, first_new=first_new, off_ref=off_ref,
                    rowdata_smem=rowdata_smem, acc_smem=acc_smem.at[wg],
                    scratch_f=red_f.at[wg], scratch_i=red_i.at[wg],
                    score_ref=score_ref, index_ref=index_ref,
                    out_row=tile * n_wg + wg, rows_valid=rows_valid,
                    vocab_size=vocab_size)

      make_pipeline(mma_body, compute_context)(w_tile, h_ref,
                                               allocations=allocs)


def _kernel_pingpong(off_ref, rowdata_ref, h_ref, w_ref, score_ref, index_ref,
                     *, cfg: TuningConfig, layout: str, n: int, dim: int,
                     rows: int, rows_valid: int, vocab_size: int, n_tiles: int,
                     num_ctas: int):
  """One CTA, ping-pong schedule: the compute warpgroups alternate tiles.

  Same refs as :func:`_kernel`, but one candidate column per tile
  (``[nc, C, n_tiles]``). The CTA owns tiles ``cta + i * num_ctas``; its
  memory warpgroup streams their ``(tile, k)`` steps in order through one
  ring of ``S`` SMEM slots, and local tile ``i`` belongs to compute
  warpgroup ``i % 2``. While one warpgroup runs its epilogue, the other
  consumes the stream, so neither the weight stream nor the tensor cores
  wait for the noise (PERF_LOG.md v4).

  Barriers: ``full[w * S + slot]`` completes when a step for warpgroup
  ``w`` has landed in ``slot`` (each warpgroup waits only on its own, so
  the implicit phase of every barrier it waits on advances exactly once
  per wait); ``empty[slot]`` is arrived by the warpgroup that consumed the
  slot, after its wgmma finished reading it, and waited on by the memory
  warpgroup before reuse. ``cfg.mma_in_flight`` wgmmas stay in flight
  across steps.

  With ``epi_passes == 1`` the two warpgroups share one SMEM copy of the
  accumulator ``[N / C, Vt, C]`` (the whole of it: the epilogue then holds
  no accumulator registers and has room for ILP); ``acc_free[w]`` hands it
  to warpgroup ``w``, so the epilogues take turns. With more passes each
  warpgroup has its own buffer of one pass's columns (the later passes'
  columns wait in registers) and the epilogues of both may run at once
  (N > 128; 5-9% faster than taking turns there, PERF_LOG v9).
  """
  epi = cfg.epi_cols
  n_chunks = n // epi
  scratch_elems = _wg_scratch_elems(epi)
  shared = cfg.epi_passes == 1
  passes = [(0, n_chunks)] if shared else _passes(cfg, n)
  pass_chunks = max(b - a for a, b in passes)

  def compute(*, wg, tile_loop, rowdata_smem, acc_smem, red_f, red_i):
    def epilogue(acc, tile, start, first_new, carry):
      _epilogue(acc, cfg=cfg, passes=passes, row0=0, start=start,
                first_new=first_new, off_ref=off_ref,
                rowdata_smem=rowdata_smem,
                acc_smem=acc_smem if shared else acc_smem.at[wg],
                scratch_f=red_f.at[wg], scratch_i=red_i.at[wg],
                score_ref=score_ref, index_ref=index_ref, out_row=tile,
                rows_valid=rows_valid, vocab_size=vocab_size)
      return carry

    tile_loop(epilogue, ())

  _pingpong_frame(
      compute, cfg=cfg, layout=layout, n=n, dim=dim, rows=rows,
      n_tiles=n_tiles, num_ctas=num_ctas, w_ref=w_ref, h_ref=h_ref,
      rowdata_ref=rowdata_ref, batch_major=False, shared_acc=shared,
      rowdata_smem=plgpu.SMEM((n_chunks, _ROWDATA, epi), jnp.uint32),
      acc_smem=plgpu.SMEM(((pass_chunks,) if shared else (2, pass_chunks))
                          + (cfg.tile_v, epi), jnp.float32),
      red_f=plgpu.SMEM((2, scratch_elems), jnp.float32),
      red_i=plgpu.SMEM((2, scratch_elems), jnp.int32))


def _pingpong_frame(compute, *, cfg: TuningConfig, layout: str, n: int,
                    dim: int, rows: int, n_tiles: int, num_ctas: int, w_ref,
                    h_ref, rowdata_ref, batch_major: bool, rowdata_smem,
                    acc_smem, shared_acc: bool = True, **scratch):
  """What the ping-pong kernels share: the SMEM ring and its barriers, the
  memory warpgroup, and each compute warpgroup's loop over its tiles.

  ``compute(wg=, tile_loop=, rowdata_smem=, acc_smem=, **scratch)`` runs on
  both compute warpgroups once the per-row data is in SMEM;
  ``tile_loop(epilogue, carry, prologue=None) -> carry`` runs the
  warpgroup's local tiles (:func:`_pingpong_tile`). ``rowdata_smem``,
  ``acc_smem`` and ``scratch`` are the kernel's own SMEM allocations
  (``plgpu.SMEM`` types); ``shared_acc``: the warpgroups hand one
  accumulator buffer to each other (else each has its own). ``h_ref`` may
  have fewer rows than ``n`` (a multiple of 8, batch-major: the controls
  kernel's launches of fewer than 64 rows): its rows fill the top of each
  H slot, the rest of the slot is never written, and the accumulator rows
  it feeds are padding the caller drops (PERF_LOG c8).
  """
  vt, dt, S = cfg.tile_v, cfg.tile_d, cfg.max_concurrent_steps
  k_steps = dim // dt
  transforms = _tma_transforms(w_ref.dtype)
  w_block = (vt, dt) if layout == "vd" else (dt, vt)
  acc_shape = (n, vt) if batch_major else (vt, n)

  @functools.partial(
      pl.run_scoped,
      w_smem=plgpu.SMEM((S, *w_block), w_ref.dtype, transforms=transforms),
      h_smem=plgpu.SMEM((S, n, dt), h_ref.dtype, transforms=transforms),
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
    cta = lax.axis_index("sm")
    n_local = (n_tiles - 1 - cta) // num_ctas + 1  # >= 1: num_ctas <= n_tiles

    @pl.when(wg == 2)
    def _memory_wg():
      plgpu.set_max_registers(40, action="decrease")
      # Per-row key words, counters and temperatures for every epilogue
      # (GMEM loads into the register layouts do not lower, SMEM ones do).
      plgpu.copy_gmem_to_smem(rowdata_ref, rowdata_smem, rowdata_barrier)
      _stream_steps(w_ref=w_ref, h_ref=h_ref, w_smem=w_smem, h_smem=h_smem,
                    full=full, empty=empty, layout=layout, vt=vt, dt=dt, S=S,
                    k_steps=k_steps, rows=rows, cta=cta, num_ctas=num_ctas,
                    total=n_local * k_steps)

    def operands(slot):
      w_slot = w_smem.at[slot]
      if batch_major:  # acc[N, Vt] = H @ W_tile.T
        return h_smem.at[slot], (w_slot.T if layout == "vd" else w_slot)
      return (w_slot if layout == "vd" else w_slot.T), h_smem.at[slot].T

    @pl.when(wg < 2)
    def _compute_wg():
      plgpu.set_max_registers(232, action="increase")
      plgpu.barrier_wait(rowdata_barrier)
      consume = functools.partial(_consume_tile, wg=wg, k_steps=k_steps, S=S,
                                  full=full, empty=empty, operands=operands,
                                  in_flight=cfg.mma_in_flight)

      def tile_loop(epilogue, carry, prologue=None):
        return lax.fori_loop(
            0, (n_local - wg + 1) // 2,
            lambda j, c: _pingpong_tile(
                i=wg + 2 * j, wg=wg, cta=cta, num_ctas=num_ctas, vt=vt,
                rows=rows, acc_shape=acc_shape, n_local=n_local,
                acc_free=acc_free if shared_acc else None, consume=consume,
                epilogue=epilogue,
                prologue=prologue, carry=c),
            carry)

      compute(wg=wg, tile_loop=tile_loop, rowdata_smem=rowdata_smem,
              acc_smem=acc_smem, **scratch)


def _pingpong_tile(*, i, wg, cta, num_ctas: int, vt: int, rows: int,
                   acc_shape, n_local, acc_free, consume, epilogue, prologue,
                   carry):
  """Local tile ``i`` of a ping-pong compute warpgroup: ``prologue(tile,
  start)`` if given (e.g. issue copies the epilogue needs), its wgmma over
  the stream (``consume``), then ``epilogue(acc, tile, start, first_new,
  carry) -> carry`` while holding the shared accumulator buffer
  (``acc_free``; None: each warpgroup has its own)."""
  tile = cta + i * num_ctas
  start = _tile_start(tile, vt, rows)
  if prologue is not None:
    prologue(tile, start)

  def mma(acc_ref):
    consume(acc_ref, i=i)
    return acc_ref[...]

  acc = pl.run_scoped(mma, plgpu.ACC(acc_shape, jnp.float32))

  if acc_free is None:
    return epilogue(acc, tile, start, tile * vt - start, carry)

  # The accumulator buffer is shared: wait until the other warpgroup's
  # epilogue (of local tile i - 1) has read it all.
  @pl.when(i > 0)
  def _():
    plgpu.barrier_wait(acc_free.at[wg])

  carry = epilogue(acc, tile, start, tile * vt - start, carry)

  # Every thread arrives once it is done reading (Lane semantics count 128
  # arrivals); none after the CTA's last tile, so that every phase is waited
  # on exactly once.
  @pl.when(i + 1 < n_local)
  def _():
    plgpu.barrier_arrive(acc_free.at[1 - wg])

  return carry


def _stream_steps(*, w_ref, h_ref, w_smem, h_smem, full, empty, layout: str,
                  vt: int, dt: int, S: int, k_steps: int, rows: int, cta,
                  num_ctas: int, total):
  """The memory warpgroup of the ping-pong kernels: streams the CTA's
  ``(local tile i, k)`` steps in order through the ring of ``S`` slots."""

  @pl.loop(0, total)
  def _step(s):
    slot, i, k = _ring_step(s, S=S, k_steps=k_steps, empty=empty)
    start = _tile_start(cta + i * num_ctas, vt, rows)
    if layout == "vd":
      w_src = w_ref.at[pl.ds(start, vt), pl.ds(k * dt, dt)]
    else:
      w_src = w_ref.at[pl.ds(k * dt, dt), pl.ds(start, vt)]
    bar = full.at[lax.rem(i, 2) * S + slot]
    plgpu.copy_gmem_to_smem(w_src, w_smem.at[slot], bar)
    # H may have fewer rows than the slot (a multiple of 8): its rows fill
    # the top of the slot and the rest is never written (those accumulator
    # rows are padding, dropped by the caller).
    h_rows = h_ref.shape[0]
    h_dst = (h_smem.at[slot] if h_rows == h_smem.shape[1]
             else h_smem.at[slot, pl.ds(0, h_rows)])
    plgpu.copy_gmem_to_smem(h_ref.at[:, pl.ds(k * dt, dt)], h_dst, bar)

  # Observe the last release of every slot used (each barrier phase is
  # waited once; interpret mode checks it), so that no slot is still read
  # when the CTA exits.
  @pl.loop(jnp.maximum(total - S, 0), total)
  def _drain(s):
    plgpu.barrier_wait(empty.at[lax.rem(s, S)])


def _ring_step(s, *, S: int, k_steps: int, empty):
  """Step ``s`` of a memory warpgroup's stream: ``(slot, local tile i, k)``,
  once the slot's previous use (step ``s - S``) has been released."""
  slot = lax.rem(s, S)
  i = s // k_steps

  @pl.when(s >= S)
  def _():
    plgpu.barrier_wait(empty.at[slot])

  return slot, i, s - i * k_steps


def _tile_start(tile, vt: int, rows: int):
  """First weight row of a tile. The last tile is moved back so that it
  ends at the last weight row: no out-of-bounds TMA; rows already seen are
  masked in the epilogue (``first_new``)."""
  return jnp.minimum(tile * vt, rows - vt)


def _consume_tile(acc_ref, *, i, wg, k_steps: int, S: int, full, empty,
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


def _kernel_batch_major(off_ref, rowdata_ref, h_ref, w_ref, score_ref,
                        index_ref, *, cfg: TuningConfig, layout: str, n: int,
                        dim: int, rows: int, rows_valid: int, vocab_size: int,
                        n_tiles: int, num_ctas: int):
  """One CTA, ping-pong, batch on the wgmma M side (PERF_LOG.md v5).

  ``acc[N, Vt] = H[N, :] @ W[tile].T``: rows are batch rows (16 per warp),
  columns vocabulary ids (spread over the lanes of a quad and registers),
  so the per-row argmax needs no cross-warp reduction. Each compute
  warpgroup keeps a running best ``(score, id)`` per (row, column slot)
  over the column chunks of all its tiles, and reduces the slots (inside
  each warp) once at the end: outputs ``score_ref``/``index_ref``
  [N, 2 * num_ctas], one column per compute warpgroup. ``rowdata_ref`` is
  uint32 [8, N] (k0, k1, counter hi, lo, bits of T, padding).

  Streaming, slots, barriers and the shared accumulator buffer as in
  :func:`_kernel_pingpong`.
  """
  vt = cfg.tile_v
  epi = cfg.epi_cols
  n_chunks = vt // epi
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def compute(*, wg, tile_loop, rowdata_smem, acc_smem):
    row = lambda i: plgpu.load(rowdata_smem.at[i], layout=row_layout)
    bcast = lambda x: lax.broadcast_in_dim(x, (n, epi), (0,))
    k0, k1, c_hi, c_lo = (bcast(row(i)) for i in range(4))
    t = bcast(lax.bitcast_convert_type(row(4), jnp.float32))
    greedy = t == 0.0
    t_safe = jnp.where(greedy, 1.0, t)
    col = plgpu.broadcasted_iota(jnp.int32, (n, epi), 1, layout=wgmma_layout)
    off = off_ref[0]

    def chunk(c, start, first_new, best):
      l = plgpu.load(acc_smem.at[c], layout=wgmma_layout)
      local = col + c * epi  # vocabulary column within the tile
      gid = local + (off + start)
      valid = ((local >= first_new) & (local + start < rows_valid)
               & (gid < vocab_size))
      hi, lo = noise.add_u32(c_hi, c_lo, gid.astype(jnp.uint32))
      g = noise.gumbel(k0, k1, hi, lo)
      sc = jnp.where(greedy, l, _div_rn(l, t_safe) + g)
      sc = jnp.where(valid, sc, -jnp.inf)
      idx = jnp.where(valid, gid, _INT_MAX)
      # The combine rule elementwise: NaN wins, then the larger score, then
      # the lower id.
      return _core.combine(best, (sc, idx))

    def epilogue(acc, tile, start, first_new, best):
      del tile
      for c in range(n_chunks):
        acc_smem[c] = acc[:, c * epi:(c + 1) * epi]

      def body(it, best):
        for u in range(cfg.epi_unroll):
          best = chunk(it * cfg.epi_unroll + u, start, first_new, best)
        return best

      return lax.fori_loop(0, n_chunks // cfg.epi_unroll, body, best)

    init = (plgpu.layout_cast(jnp.full((n, epi), -jnp.inf, jnp.float32),
                              wgmma_layout),
            plgpu.layout_cast(jnp.full((n, epi), _INT_MAX, jnp.int32),
                              wgmma_layout))
    best_s, best_i = tile_loop(epilogue, init)
    # Reduce the column slots inside each warp (axis 1: lanes of a quad
    # and registers, no shared scratch, so trap 1 does not apply).
    m = jnp.max(best_s, axis=1)  # NaN if the row holds one
    mb = lax.broadcast_in_dim(m, (n, epi), (0,))
    hit = (best_s == mb) | ((best_s != best_s) & (mb != mb))
    idx = jnp.min(jnp.where(hit, best_i, _INT_MAX), axis=1)
    out = lax.axis_index("sm") * 2 + wg
    score_ref[:, out] = m
    index_ref[:, out] = idx

  _pingpong_frame(
      compute, cfg=cfg, layout=layout, n=n, dim=dim, rows=rows,
      n_tiles=n_tiles, num_ctas=num_ctas, w_ref=w_ref, h_ref=h_ref,
      rowdata_ref=rowdata_ref, batch_major=True,
      rowdata_smem=plgpu.SMEM((_ROWDATA, n), jnp.uint32),
      acc_smem=plgpu.SMEM((n_chunks, n, epi), jnp.float32))


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def _launch(offset, rowdata, h, w, *, cfg: TuningConfig, layout: str,
            rows_valid: int, vocab_size: int):
  """Runs the kernel on one batch chunk (``h`` [N, D], N <= 256 padded).

  Returns ``(score, index)``, both ``[N, n_out]``: each row's candidates
  (one per tile or per compute warpgroup) along the minor axis.
  """
  n, dim = h.shape
  rows = w.shape[0] if layout == "vd" else w.shape[1]
  n_tiles = -(-rows // cfg.tile_v)
  cfg.check_problem(n=n, dim=dim, rows=rows, itemsize=h.dtype.itemsize)
  num_ctas = min(cfg.num_ctas or _num_sms(), n_tiles)
  if cfg.batch_major:
    kernel = _kernel_batch_major
  else:
    kernel = _kernel_pingpong if cfg.pingpong else _kernel
  body = functools.partial(kernel, cfg=cfg, layout=layout, n=n, dim=dim,
                           rows=rows, rows_valid=rows_valid,
                           vocab_size=vocab_size, n_tiles=n_tiles,
                           num_ctas=num_ctas)
  # Candidates on the minor axis (each store is a strided column): stage 2
  # is then one row reduction, which XLA runs as one kernel; over the major
  # axis it took three (max, select, min; PERF_LOG c9).
  if cfg.batch_major:  # one candidate per compute warpgroup
    n_out = 2 * num_ctas
    shape = (n, n_out)
  else:  # one per tile (or per warpgroup's part of a tile)
    n_out = n_tiles * cfg.wg_share
    shape = (n // cfg.epi_cols, cfg.epi_cols, n_out)
  out_type = (jax.ShapeDtypeStruct(shape, jnp.float32),
              jax.ShapeDtypeStruct(shape, jnp.int32))
  f = plgpu.kernel(
      body, out_type=out_type, grid=(num_ctas,), grid_names=("sm",),
      num_threads=cfg.compute_wgs + 1, thread_name="wg",
      kernel_name="flashsample_sm90",  # the name profilers show
      compiler_params=plgpu.CompilerParams(
          reduction_scratch_bytes=_REDUCTION_SCRATCH_BYTES,
          lowering_semantics=plgpu.LoweringSemantics.Lane))
  s, i = f(offset, rowdata, h, w)
  return s.reshape(n, n_out), i.reshape(n, n_out)


def pad_vocab(p: Problem, align: int = 1):
  """``(W, rows_k)``: the weight with its vocabulary axis padded for TMA.

  TMA with a tiled SMEM destination tiles the whole GMEM array, so the
  vocabulary axis must be a multiple of the tile there: 8 rows for "vd",
  one 64-wide swizzle row for "dv" (and of ``align``), at least one 64-row
  tile. Real LM heads are padded that way (151936 and 128256 are multiples
  of 64); anything else pays one copy of W here, and the padding rows are
  masked in the kernel.
  """
  rows = p.weight_rows
  align = int(np.lcm(align, _VD_ROW_ALIGN if p.layout == "vd" else _DV_COL_ALIGN))
  rows_k = max(_round_up(rows, align), 64)
  w = p.weight
  if rows_k != rows:
    w = jnp.pad(w, [(0, rows_k - rows), (0, 0)] if p.layout == "vd"
                else [(0, 0), (0, rows_k - rows)])
  return w, rows_k


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
  w, rows_k = pad_vocab(p)
  scores, tokens = [], []
  for b0, b1 in batch_chunks(p.batch):
    nb = b1 - b0
    n = batch_side(nb)
    cfg = config or pick_config(n, p.hidden_dim, rows_k,
                                jnp.dtype(p.weight.dtype).itemsize)
    n = cfg.batch_pad(n)
    pad = lambda x: jnp.pad(x[b0:b1], [(0, n - nb)] + [(0, 0)] * (x.ndim - 1))
    rowdata = jnp.stack([
        p.k0, p.k1, p.ctr_hi, p.ctr_lo,
        lax.bitcast_convert_type(p.temperature, jnp.uint32)])
    rowdata = jnp.pad(rowdata[:, b0:b1], [(0, _ROWDATA - 5), (0, n - nb)])
    if not cfg.batch_major:
      # [8, N] -> [nc, 8, C]: one contiguous block per epilogue chunk.
      rowdata = rowdata.reshape(_ROWDATA, n // cfg.epi_cols, cfg.epi_cols)
      rowdata = rowdata.transpose(1, 0, 2)
    s, i = _launch(offset, rowdata, pad(p.hidden.astype(p.weight.dtype)),
                   w, cfg=cfg, layout=p.layout, rows_valid=rows,
                   vocab_size=p.vocab_size)
    s, i = _core.argbest(s[:nb], i[:nb], axis=1)
    scores.append(s)
    tokens.append(i)
  if len(scores) == 1:
    return scores[0], tokens[0]
  return jnp.concatenate(scores), jnp.concatenate(tokens)
