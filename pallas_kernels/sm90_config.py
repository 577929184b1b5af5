"""Configs of the sm90 kernels: the schedule, the frozen tiling, the heuristic.

A launch is described by a :class:`TuningConfig`, a frozen dataclass validated
on construction (and against a problem's shapes by
:meth:`TuningConfig.check_problem`). Its :class:`Schedule` names how the
warpgroups share the work; :func:`pick_config` chooses one from a table of
measured settings (the measurements behind them: ``docs/performance.md``),
with no autotuning at call time.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp

from pallas_kernels import devices

__all__ = [
    "Schedule",
    "TuningConfig",
    "pick_config",
    "batch_chunks",
    "batch_side",
    "round_up",
    "MAX_N",
    "SMEM_BUDGET",
    "pick_blocked_config",
    "wide_d_min_blocks",
    "BLOCKED_MIN_ROWS",
    "BLOCK_ROWS",
    "MAX_BLOCKS",
    "ROWDATA_ROWS",
    "WeightPath",
    "weight_path",
    "supported_dtype",
    "quantized_dtype",
    "wide_8bit_steps",
    "WIDE_8BIT_STEP",
    "balanced_ctas",
    "slot_entries_config",
]

# wgmma's N (the batch side when the vocabulary is on M) is a multiple of 8
# up to 256 (N = 4 and N > 256 are rejected; docs/design.md).
MAX_N = 256
N_ALIGN = 8
# H100/H200 allow 227 KiB of dynamic SMEM per block; keep room for the
# reduction scratch and barriers.
SMEM_BUDGET = 212 * 1024
# Widest epilogue pass (columns of the accumulator copied to SMEM at once).
_MAX_PASS_COLS = 64
# Noise elements per thread in one epilogue loop iteration (see pick_config).
_EPI_ELEMS_PER_THREAD = 16
# Rows of the per-row data block of the plain kernels (RowLayout(samples=1)):
# 8 * N * 4 bytes is a multiple of 128, which Lane-semantics copies need.
ROWDATA_ROWS = 8


class Schedule(enum.Enum):
  """How the compute warpgroups of a CTA share the vocabulary tiles.

  Every schedule is warp-specialized (a memory warpgroup issues the TMA
  copies) and persistent (a CTA loops over its tiles).
  """

  #: Vocabulary on the wgmma M side; one or two compute warpgroups share
  #: every tile (``emit_pipeline_warp_specialized``): each takes
  #: ``tile_v / compute_wgs`` rows, both run their wgmma, then both their
  #: epilogue. The only schedule for one compute warpgroup (V < 128).
  COOPERATIVE = "cooperative"
  #: Vocabulary on M ("swap AB": W tile times H.T); two compute warpgroups
  #: alternate whole tiles over one hand-written ring of SMEM slots, so one's
  #: epilogue overlaps the other's share of the weight stream.
  PINGPONG_VOCAB_M = "pingpong_vocab_m"
  #: The same ping-pong with the batch on M (``acc[N, Vt] = H @ W_tile.T``,
  #: N padded to 64): the per-row argmax reduces inside each warp and a
  #: running best carries over chunks and tiles.
  PINGPONG_BATCH_M = "pingpong_batch_m"

  @property
  def pingpong(self) -> bool:
    return self is not Schedule.COOPERATIVE

  @property
  def batch_major(self) -> bool:
    return self is Schedule.PINGPONG_BATCH_M


class WeightPath(enum.Enum):
  """How a launch's compute warpgroups feed the weight tile to the wgmma.

  8-bit weights (FP8 e4m3/e5m2, int8) travel through TMA and the SMEM ring
  as they are (half the bytes of bf16) and become bf16/f16 on chip, exactly
  (docs/design.md, "Quantized heads"). The wgmma has no mixed bf16 x 8-bit
  form, so the tile is converted before the MMA, in one of two ways.
  """

  #: bf16/f16 weights: the wgmma reads the ring's slot.
  DIRECT = "direct"
  #: Vocabulary on M with a ``[V, D]`` weight: the weight tile is the A
  #: operand, which wgmma takes from registers. Each compute warpgroup loads
  #: its slot into registers, converts, and issues the wgmma with the
  #: converted tile as A: no second SMEM copy. The wgmma reads those
  #: registers asynchronously and nothing keeps the compiler from reusing
  #: them for the next step's conversion, so every step waits for its wgmma
  #: (no wgmma in flight; on an H200 the N = 192 launch with one in flight
  #: returned wrong tokens).
  REGISTERS = "registers"
  #: Batch on M (the weight is the B operand, which wgmma reads only from
  #: SMEM), or a ``[D, V]`` weight (its tile would need a transposed 8-bit
  #: load into the A layout): each compute warpgroup converts the slot into
  #: a bf16/f16 staging tile of its own in SMEM, which the wgmma reads. The
  #: staging tile is rewritten every step, so its wgmma is waited for
  #: before the next conversion (no wgmma in flight across steps).
  STAGED = "staged"


def weight_path(schedule: Schedule, layout: str, w_itemsize: int) -> WeightPath:
  """The :class:`WeightPath` of a launch (``w_itemsize``: the weight's bytes
  per element; 1 for the quantized dtypes)."""
  if w_itemsize != 1:
    return WeightPath.DIRECT
  if schedule.batch_major or layout != "vd":
    return WeightPath.STAGED
  return WeightPath.REGISTERS


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Static tiling of one kernel launch; validated on construction.

  Attributes:
    schedule: see :class:`Schedule`.
    tile_v: ``Vt``, vocabulary rows per tile: a multiple of 64. With the
      vocabulary on M, the accumulator ``[Vt, N]`` f32 lives in the registers
      of one warpgroup (``Vt * N / 128`` per thread); with the batch on M
      it is ``[N, Vt]`` and ``Vt`` is the wgmma N side (<= 256).
    tile_d: ``Dt``, hidden elements per pipeline step (the wgmma K side): a
      multiple of 64 (one 128-byte swizzle row of bf16/f16).
    max_concurrent_steps: pipeline depth (SMEM slots per operand).
    epi_cols: columns of the accumulator in one epilogue chunk: 8 or 16
      (f32 SMEM transfers of wider WGMMA-layout chunks fail to lower: "Failed
      to synthesize a transfer pattern that avoids bank conflicts").
    epi_unroll: chunks per iteration of the epilogue loop (more independent
      work per thread, more code).
    num_ctas: CTAs of the persistent grid; None means one per SM.
    compute_wgs: compute warpgroups per CTA. ``COOPERATIVE``: 1 or 2 (each
      owns ``tile_v / 2`` rows of a tile: its own accumulator, epilogue and
      candidates); the ping-pong schedules always have 2. None: the
      schedule's default (1 for ``COOPERATIVE``).
    epi_passes: the accumulator goes to SMEM in this many column passes
      (each followed by its epilogue loop), so that the SMEM copy is
      ``tile_v * N / epi_passes`` f32 and leaves room for pipeline slots.
      With ``PINGPONG_VOCAB_M`` and more than one pass, each compute
      warpgroup copies into its own buffer: no hand-over, so the two
      warpgroups' epilogues may run at the same time. ``PINGPONG_BATCH_M``
      keeps one buffer handed between the warpgroups, of one pass's columns.
    mma_in_flight: ping-pong consumers: wgmmas left in flight after each
      step's issue (1 or 0). With 1 the next step's issue overlaps the
      running wgmma, and a slot is released one step after its wgmma (the
      consumer holds two slots); with 0 each step waits for its wgmma and
      releases its slot at once (one more slot of the ring loading).
    batch_blocks: ``PINGPONG_BATCH_M`` only: the launch's rows split into
      this many blocks of N rows; CTA ``c`` takes block ``c % batch_blocks``
      and the vocabulary tiles ``c // batch_blocks + i * (CTAs /
      batch_blocks)``, so the CTAs of one tile's blocks run side by side and
      all but the first read its weight rows from L2: one pass over W from
      HBM for ``N * batch_blocks`` rows, work items of ``N x Vt``.
  """

  schedule: Schedule = Schedule.COOPERATIVE
  tile_v: int = 128
  tile_d: int = 64
  max_concurrent_steps: int = 4
  epi_cols: int = 16
  epi_unroll: int = 1
  num_ctas: int | None = None
  compute_wgs: int | None = None
  epi_passes: int = 1
  mma_in_flight: int = 1
  batch_blocks: int = 1

  def __post_init__(self):
    if not isinstance(self.schedule, Schedule):
      raise TypeError(f"schedule={self.schedule!r} must be a Schedule")
    for name in ("tile_v", "tile_d", "max_concurrent_steps", "epi_cols",
                 "epi_unroll", "epi_passes", "mma_in_flight", "batch_blocks"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}={v!r} must be an int")
    tile_v, tile_d = self.tile_v, self.tile_d
    steps, epi_cols = self.max_concurrent_steps, self.epi_cols
    if tile_v <= 0 or tile_v % 64:
      raise ValueError(f"{tile_v=} must be a positive multiple of 64")
    wgs = self.compute_wgs
    if wgs is not None and (isinstance(wgs, bool) or not isinstance(wgs, int)):
      raise TypeError(f"compute_wgs={wgs!r} must be an int or None")
    if self.schedule.pingpong:
      if wgs not in (None, 2):
        raise ValueError(f"{self.schedule.name} runs 2 compute warpgroups, "
                         f"got compute_wgs={wgs}")
    elif wgs not in (None, 1, 2):
      raise ValueError(f"compute_wgs={wgs} must be 1 or 2")
    if self.mma_in_flight not in (0, 1):
      raise ValueError(f"mma_in_flight={self.mma_in_flight} must be 0 or 1")
    if self.schedule.pingpong and steps < 1 + self.mma_in_flight:
      # With one wgmma in flight a slot is released one step after its
      # wgmma is issued: a ring of one slot would wait on itself.
      raise ValueError(
          f"{self.schedule.name} with mma_in_flight={self.mma_in_flight} "
          f"needs max_concurrent_steps >= {1 + self.mma_in_flight}, got {steps}")
    if self.epi_passes < 1:
      raise ValueError(f"epi_passes={self.epi_passes} must be >= 1")
    if self.schedule.batch_major:
      if tile_v % (epi_cols * self.epi_unroll):
        raise ValueError(
            f"PINGPONG_BATCH_M: epi_cols={epi_cols} x epi_unroll="
            f"{self.epi_unroll} must divide {tile_v=}")
      chunks = tile_v // epi_cols
      if chunks % self.epi_passes or (chunks // self.epi_passes) % self.epi_unroll:
        raise ValueError(
            f"PINGPONG_BATCH_M: epi_passes={self.epi_passes} must split the "
            f"{chunks} column chunks of tile_v={tile_v} into passes of a "
            f"multiple of epi_unroll={self.epi_unroll} chunks")
    if tile_v % (64 * self.wg_share):
      raise ValueError(
          f"{tile_v=} must be a multiple of 64 x compute_wgs="
          f"{self.num_compute_wgs} (warpgroups sharing a tile)")
    if self.batch_blocks < 1:
      raise ValueError(f"batch_blocks={self.batch_blocks} must be >= 1")
    if self.batch_blocks > 1 and not self.schedule.batch_major:
      raise ValueError(f"batch_blocks={self.batch_blocks} needs PINGPONG_BATCH_M, "
                       f"got {self.schedule.name}")
    if tile_d <= 0 or tile_d % 64:
      raise ValueError(f"{tile_d=} must be a positive multiple of 64")
    if steps < 1:
      raise ValueError(f"max_concurrent_steps={steps} must be >= 1")
    if epi_cols not in (8, 16):
      raise ValueError(f"{epi_cols=} must be 8 or 16")
    if self.epi_unroll < 1:
      raise ValueError(f"epi_unroll={self.epi_unroll} must be >= 1")
    num_ctas = self.num_ctas
    if num_ctas is not None and (isinstance(num_ctas, bool)
                                 or not isinstance(num_ctas, int) or num_ctas < 1):
      raise ValueError(f"{num_ctas=} must be None or a positive int")

  @property
  def num_compute_wgs(self) -> int:
    if self.schedule.pingpong:
      return 2
    return self.compute_wgs or 1

  @property
  def wg_share(self) -> int:
    """Compute warpgroups that split one tile's rows (1 when they alternate)."""
    return 1 if self.schedule.pingpong else self.num_compute_wgs

  @property
  def wg_rows(self) -> int:
    """Vocabulary rows of one compute warpgroup's accumulator."""
    return self.tile_v // self.wg_share

  def batch_pad(self, n: int) -> int:
    """The kernel's batch side for ``n`` rows (a multiple of 8)."""
    if self.schedule.batch_major:  # wgmma M: multiples of 64
      return round_up(n, 64)
    return min(MAX_N, round_up(n, self.epi_cols * self.epi_unroll))

  def passes(self, n: int) -> list[tuple[int, int]]:
    """Static ``(first, end)`` epilogue chunks of each pass: the loop
    iterations (``epi_unroll`` chunks each) split as evenly as possible."""
    iters = n // (self.epi_cols * self.epi_unroll)
    p = min(self.epi_passes, iters)
    bounds = [iters * i // p * self.epi_unroll for i in range(p + 1)]
    return list(zip(bounds[:-1], bounds[1:]))

  def smem_bytes(self, n: int, itemsize: int = 2, w_itemsize: int | None = None,
                 staged: bool = False) -> int:
    """SMEM of this config for a batch side of ``n`` rows: pipeline slots,
    the f32 accumulator copies the epilogues loop over, the per-row data.
    ``itemsize``: H's bytes per element; ``w_itemsize``: W's (default
    ``itemsize``; 1: a quantized weight, whose per-row scale tiles take
    ``2 * tile_v`` f32); ``staged``: each compute warpgroup also holds a
    converted ``[tile_v, tile_d]`` staging tile (``WeightPath.STAGED``)."""
    w_itemsize = itemsize if w_itemsize is None else w_itemsize
    pipeline = self.max_concurrent_steps * (
        self.tile_v * w_itemsize + n * itemsize) * self.tile_d
    if w_itemsize == 1:
      pipeline += 2 * self.tile_v * 4
    if staged:
      pipeline += 2 * self.tile_v * self.tile_d * itemsize
    rowdata = ROWDATA_ROWS * n * 4
    if self.schedule.batch_major:  # one pass's columns, shared
      return pipeline + self.tile_v * n * 4 // self.epi_passes + rowdata
    if self.schedule.pingpong and self.epi_passes == 1:  # shared buffer
      acc = self.tile_v * n * 4
    elif self.schedule.pingpong:  # one pass's columns per warpgroup
      acc = 2 * self.tile_v * self._pass_cols(n) * 4
    else:
      acc = self.num_compute_wgs * self.wg_rows * self._pass_cols(n) * 4
    return (pipeline + acc + rowdata
            + self.num_compute_wgs * 2 * wg_scratch_elems(self.epi_cols) * 4)

  def _pass_cols(self, n: int) -> int:
    """Columns of the largest epilogue pass (see :meth:`passes`)."""
    return max(b - a for a, b in self.passes(n)) * self.epi_cols

  def check_problem(self, *, n: int, dim: int, rows: int, itemsize: int = 2,
                    w_itemsize: int | None = None, staged: bool = False):
    """Raises ValueError if this config cannot run the given shapes (byte
    sizes as in :meth:`smem_bytes`)."""
    if w_itemsize == 1 and not self.schedule.pingpong:
      raise ValueError(
          f"{self.schedule.name} takes bf16/f16 weights only; 8-bit weights "
          "run on the ping-pong schedules")
    if n % N_ALIGN or not 0 < n <= MAX_N:
      raise ValueError(f"batch side {n=} must be a multiple of 8 in [8, {MAX_N}]")
    if dim < self.tile_d or (dim % self.tile_d and not self.schedule.pingpong):
      # The ping-pong schedules' last step runs past D (TMA zeros) where
      # tile_d does not divide D (sm90_common.step_count).
      raise ValueError(f"tile_d={self.tile_d} must divide D={dim}")
    if rows < self.tile_v:
      raise ValueError(f"tile_v={self.tile_v} must be <= the weight rows V={rows}")
    if self.schedule.batch_major:
      if n % 64:
        raise ValueError(f"PINGPONG_BATCH_M: batch side {n=} must be a multiple of 64")
      if self.tile_v > MAX_N:
        raise ValueError(
            f"PINGPONG_BATCH_M: tile_v={self.tile_v} is the wgmma N side, <= {MAX_N}")
      regs = n * self.tile_v // 128
      if regs > 128:
        raise ValueError(
            f"PINGPONG_BATCH_M: N={n} x tile_v={self.tile_v} needs {regs} "
            "accumulator registers per thread; at most 128 leave room for the "
            "epilogue")
    else:
      if n % (self.epi_cols * self.epi_unroll):
        raise ValueError(
            f"epi_cols={self.epi_cols} x epi_unroll={self.epi_unroll} must "
            f"divide the batch side {n=}")
      iters = n // (self.epi_cols * self.epi_unroll)
      if self.epi_passes > iters:
        raise ValueError(
            f"epi_passes={self.epi_passes} exceeds the {iters} epilogue loop "
            f"iterations of N={n}")
      regs = self.wg_rows * n // 128
      if regs > 128:
        raise ValueError(
            f"tile_v={self.tile_v} (rows per warpgroup {self.wg_rows}) x N={n} "
            f"needs {regs} accumulator registers per thread; at most 128 leave "
            "room for the epilogue")
    smem = self.smem_bytes(n, itemsize, w_itemsize, staged)
    if smem > SMEM_BUDGET:
      raise ValueError(
          f"{self} needs {smem} bytes of SMEM for N={n}, more than {SMEM_BUDGET}")


def wg_scratch_elems(epi_cols: int) -> int:
  """Elements of one warpgroup's cross-warp reduction scratch: 4 warps x 32
  lanes x 2-vectors per 8 reduced columns (all of a chunk at once)."""
  return 4 * 32 * 2 * (epi_cols // 8)


# Rows per launch (one pass over W each): full chunks first, then the rest.
# A launch's cost grows slower than its rows, so chunks are as full as the
# kernel allows (one launch of 256 rows against two of 128:
# docs/performance.md, "Launches of up to 256 rows").
CHUNK_ROWS = MAX_N


def batch_chunks(batch: int) -> list[tuple[int, int]]:
  """``[(b0, b1), ...]``: the row ranges of the launches for ``batch`` rows."""
  return [(b0, min(batch, b0 + CHUNK_ROWS)) for b0 in range(0, batch, CHUNK_ROWS)]


def batch_side(batch: int) -> int:
  """wgmma N for a batch chunk of ``batch <= MAX_N`` rows."""
  return min(MAX_N, round_up(max(batch, 1), N_ALIGN))


@dataclasses.dataclass(frozen=True)
class _Row:
  """One row of the heuristic's table: the settings for N up to ``n_max``."""

  n_max: int
  schedule: Schedule
  tile_v: int
  epi_cols: int
  mma_in_flight: int
  epi_passes: int = 1
  n_align: int = 16


# Two compute warpgroups (V >= 128): the schedule by batch side N. Each row
# is the best of the settings measured at those N on the H100/H200
# (Qwen3-8B and Llama-3-70B heads; docs/performance.md, "Schedules by batch
# size"):
# * N <= 48: vocabulary on M, tiles of 128 rows; H slices this small leave
#   room for 4-5 slots of Dt = 128, and each slot is released as soon as its
#   wgmma is done. Up to 8 rows the batch side is 8 (epilogue chunks of 8
#   columns): half of every tile's noise and argmax, and the last tile's
#   epilogue is the kernel's tail after its last weight byte; 2-3 us
#   shorter on an H200 with bf16 and 8-bit heads (docs/performance.md,
#   "Small batches").
# * N = 64: batch on M, chunks of [64, 16], one wgmma kept in flight.
# * N = 128: batch on M, chunks of [128, 8] (half the loop body), each slot
#   released at once.
# * N > 128: vocabulary on M over tiles of 64 rows (an accumulator [64, N]
#   is 128 registers at N = 256), a quarter-accumulator buffer per
#   warpgroup so both epilogues may run at once.
_EIGHT_ROWS = _Row(8, Schedule.PINGPONG_VOCAB_M, tile_v=128, epi_cols=8, mma_in_flight=0,
                   n_align=8)
_TABLE = (
    _EIGHT_ROWS,
    _Row(48, Schedule.PINGPONG_VOCAB_M, tile_v=128, epi_cols=16, mma_in_flight=0),
    _Row(64, Schedule.PINGPONG_BATCH_M, tile_v=128, epi_cols=16, mma_in_flight=1,
         n_align=64),
    _Row(128, Schedule.PINGPONG_BATCH_M, tile_v=128, epi_cols=8, mma_in_flight=0,
         n_align=64),
    _Row(MAX_N, Schedule.PINGPONG_VOCAB_M, tile_v=64, epi_cols=16, mma_in_flight=1,
         epi_passes=4),
)


# An 8-bit "vd" weight: vocabulary on M (the register path) up to N = 128
# (REGISTER_PATH_MAX_N), where the batch-major rows would stage each tile
# into bf16 first: on an H200 the staged kernel took 1.3-1.8x the register
# path's time at B = 64-128 on the S, L, Qwen3-1.7B and gpt-oss heads
# (docs/performance.md, "Quantized heads at B = 17-128"). Its steps are 128
# columns wide even where 128 does not divide D (gpt-oss' 2880: the last
# step runs past D, sm90_common.step_count): 1.13x faster than 64-column
# steps there at B = 24.
REGISTER_PATH_MAX_N = 128
_TABLE_8BIT_VD = (
    _EIGHT_ROWS,
    _Row(REGISTER_PATH_MAX_N, Schedule.PINGPONG_VOCAB_M, tile_v=128, epi_cols=16,
         mma_in_flight=0),
    _TABLE[-1],
)


def _table(w_itemsize: int, layout: str):
  """The schedule table for a weight of ``w_itemsize`` bytes in ``layout``."""
  return _TABLE_8BIT_VD if w_itemsize == 1 and layout == "vd" else _TABLE


def _one_warpgroup(n: int) -> tuple[TuningConfig, int]:
  """V < 128 (one compute warpgroup): cooperative, vocabulary on M, the
  accumulator in passes of at most 64 columns. Epilogue loop
  iterations of 16 noise elements per thread: the loop body bounds the code
  size (an unrolled epilogue ran at 0.07 IPC per warp: docs/performance.md,
  "The epilogue loop") while leaving
  ILP; one chunk per iteration where N <= 16 (no padding to a second chunk)
  or N > 128 (the later passes' columns in registers pushed the loop over
  the register cap)."""
  epi_cols = 16
  epi_unroll = max(1, _EPI_ELEMS_PER_THREAD * 128 // (64 * epi_cols))
  if n <= epi_cols or n > 128:
    epi_unroll = 1
  per_iter = epi_cols * epi_unroll
  n = round_up(n, per_iter)
  iters = n // per_iter
  passes = -(-iters // max(1, _MAX_PASS_COLS // per_iter))
  cfg = TuningConfig(schedule=Schedule.COOPERATIVE, tile_v=64, epi_cols=epi_cols,
                     epi_unroll=epi_unroll, compute_wgs=1, epi_passes=passes,
                     max_concurrent_steps=1)
  return cfg, n


@dataclasses.dataclass(frozen=True)
class _WideStep:
  """The 8-bit register path's wide tiles, used where ``min_steps`` fit."""

  tile_v: int
  tile_d: int
  min_steps: int


# The 8-bit register path's steps (vocabulary on M, "vd"): each step
# converts its tile and waits for its wgmma (WeightPath.REGISTERS), a cost
# per step that wider steps spread over more bytes. On an H200 128 x 256
# tiles in 4 slots measured fastest of the shapes tried at B <= 16
# (interleaving the two warpgroups' steps gained nothing), and in the 3
# slots that fit beside 17-48 rows faster than the 128 x 128 tiles in 5-7
# slots; in the 2 slots of N >= 64 level at best, and much slower from
# N = 80 (docs/performance.md, "Wide 8-bit steps"). The converted tile
# takes 128 registers per thread. Used where D allows and min_steps slots
# fit, else the Dt = 128 tiles.
WIDE_8BIT_STEP = _WideStep(tile_v=128, tile_d=256, min_steps=3)


def _wide_8bit(base: TuningConfig, n: int, dim: int, itemsize: int):
  """``base`` with the register path's wide tiles and the most slots that
  fit, or None where D or the SMEM budget does not allow them. Where the
  tiles do not divide D the last step runs past D (TMA zeros:
  :func:`~pallas_kernels.sm90_common.step_count`): taken where the
  alternative is steps of 64 columns (128 does not divide D) and the
  columns past D are at most an eighth of D; measured on gpt-oss' 2880
  (192 columns: docs/performance.md, "Steps that do not divide D")."""
  pad = -dim % WIDE_8BIT_STEP.tile_d
  if pad and (dim % 128 == 0 or 8 * pad > dim):
    return None
  wide = dataclasses.replace(base, tile_v=WIDE_8BIT_STEP.tile_v,
                             tile_d=WIDE_8BIT_STEP.tile_d)
  steps = most_steps(wide, n, itemsize, 1)
  if steps < WIDE_8BIT_STEP.min_steps:
    return None
  return dataclasses.replace(wide, max_concurrent_steps=steps)


def wide_8bit_steps(batch: int, dim: int, rows: int, itemsize: int = 2,
                    layout: str = "vd") -> bool:
  """Whether one launch of ``batch`` rows of an 8-bit head runs the
  register path's wide steps (:data:`WIDE_8BIT_STEP`)."""
  if batch > MAX_N or rows < 128:
    return False
  cfg = pick_config(batch_side(batch), dim, rows, itemsize, 1, layout)
  return (weight_path(cfg.schedule, layout, 1) is WeightPath.REGISTERS
          and cfg.tile_d == WIDE_8BIT_STEP.tile_d)


def pick_config(n: int, dim: int, rows: int, itemsize: int = 2,
                w_itemsize: int | None = None, layout: str = "vd") -> TuningConfig:
  """The config for batch side ``n`` (a multiple of 8), hidden ``D`` and
  ``rows`` weight rows: a row of the measured table (by N), then the
  largest ``Dt`` and the most pipeline slots that fit the SMEM budget:
  ``Dt = 128`` when D allows and 3 slots fit (fewer steps and barrier
  waits), else 64; 2 to 8 slots. :meth:`TuningConfig.batch_pad` gives the
  padded batch side. ``itemsize``: H's bytes; ``w_itemsize``: W's (1 for
  an 8-bit weight, whose slots take half the bytes, so the ring is deeper;
  its steps each wait for their wgmma, see :class:`WeightPath`; on the
  register path :data:`WIDE_8BIT_STEP`'s tiles where they fit). An 8-bit
  ``"vd"`` weight takes the register path up to N =
  :data:`REGISTER_PATH_MAX_N`, where bf16 puts the batch on M."""
  w_itemsize = itemsize if w_itemsize is None else w_itemsize
  return _pick(n, dim, rows, itemsize, w_itemsize, layout, _table(w_itemsize, layout))


def _pick(n: int, dim: int, rows: int, itemsize: int, w_itemsize: int, layout: str,
          table) -> TuningConfig:
  """:func:`pick_config` with the schedule table ``table``."""
  if rows < 128:
    base, n = _one_warpgroup(n)
  else:
    row = next(r for r in table if n <= r.n_max)
    n = round_up(n, row.n_align)
    passes = min(row.epi_passes, n // row.epi_cols)
    base = TuningConfig(schedule=row.schedule, tile_v=row.tile_v,
                        epi_cols=row.epi_cols, mma_in_flight=row.mma_in_flight,
                        epi_passes=passes, max_concurrent_steps=2)
  n = base.batch_pad(n)
  path = weight_path(base.schedule, layout, w_itemsize)
  staged = path is WeightPath.STAGED
  if path is not WeightPath.DIRECT:  # no wgmma in flight (WeightPath)
    base = dataclasses.replace(base, mma_in_flight=0)
  if path is WeightPath.REGISTERS:
    wide = _wide_8bit(base, n, dim, itemsize)
    if wide is not None:
      return wide
  options = tuple(t for t in (128, 64)
                  if t <= dim and (dim % t == 0 or path is WeightPath.REGISTERS)) or (64,)
  for tile_d in options:
    cfg = dataclasses.replace(base, tile_d=tile_d)
    steps = most_steps(cfg, n, itemsize, w_itemsize, staged)
    # The register path measured with Dt = 128 in 2 slots at N = 128
    # (REGISTER_PATH_MAX_N's note).
    if steps >= 3 or (steps >= 2 and (tile_d == options[-1]
                                      or path is WeightPath.REGISTERS)):
      break
  return dataclasses.replace(cfg, max_concurrent_steps=max(2, steps))


def most_steps(cfg: TuningConfig, n: int, itemsize: int = 2,
               w_itemsize: int | None = None, staged: bool = False,
               extra: int = 0, limit: int = 8) -> int:
  """The most pipeline slots (at most ``limit``) with which ``cfg`` fits
  the SMEM budget beside ``extra`` bytes of the kernel's own (0 if not
  even one fits)."""
  two = dataclasses.replace(cfg, max_concurrent_steps=2)
  w_itemsize = itemsize if w_itemsize is None else w_itemsize
  per_step = (cfg.tile_v * w_itemsize + n * itemsize) * cfg.tile_d
  fixed = two.smem_bytes(n, itemsize, w_itemsize, staged) - 2 * per_step
  return int(max(0, min(limit, (SMEM_BUDGET - extra - fixed) // per_step)))


def balanced_ctas(n_tiles: int, ctas: int) -> int:
  """The fewest CTAs that take ``n_tiles`` tiles in as many rounds as
  ``ctas`` CTAs do: every CTA then runs the same number of rounds, but for
  at most one fewer, instead of a last round in which many SMs idle while
  the rest read (L's 1002 tiles over 132 SMs: 78 read in the 8th round, 54
  idle; 126 CTAs run 8 nearly full rounds: docs/performance.md, "Small
  batches")."""
  ctas = max(1, min(ctas, n_tiles))
  rounds = -(-n_tiles // ctas)
  return -(-n_tiles // rounds)


# Plain sampling of more rows than BLOCKED_MIN_ROWS - 1 runs in batch blocks
# (TuningConfig.batch_blocks) of BLOCK_ROWS rows, up to MAX_BLOCKS per
# launch. Measured on an H100 (docs/performance.md, "Batch blocks"): at B = 256..1024
# the blocks beat the vocabulary-major N = 256 launches (one per 256 rows,
# each a pass over W) on every head, by 1.1-1.35x; at B = 192 the single
# N = 192 launch is faster than two blocks (a quarter of padding).
BLOCKED_MIN_ROWS = 193
BLOCK_ROWS = 128
MAX_BLOCKS = 16


def pick_blocked_config(batch: int, dim: int, rows: int,
                        itemsize: int = 2, kind: str | None = None,
                        w_itemsize: int | None = None,
                        layout: str = "vd") -> TuningConfig:
  """The config of one launch of ``batch <= BLOCK_ROWS * MAX_BLOCKS`` rows in
  ``ceil(batch / 128)`` blocks: the N = 128 settings of the table, with
  ``Dt = 128`` in 2 slots where D allows from :func:`wide_d_min_blocks`
  blocks on (the device kind ``kind``: default the first GPU's). From
  :data:`DEEP_D` on, the epilogue runs in :data:`DEEP_D_PASSES` passes with
  one wgmma in flight, in the most slots that fit. An 8-bit weight
  (``w_itemsize=1``) is staged (:class:`WeightPath`): no wgmma in flight."""
  blocks = max(1, -(-batch // BLOCK_ROWS))
  if blocks > MAX_BLOCKS:
    raise ValueError(f"{batch=} rows need {blocks} blocks, more than {MAX_BLOCKS}")
  w_itemsize = itemsize if w_itemsize is None else w_itemsize
  # Blocks share each tile across CTAs of the batch-major schedule, 8-bit
  # weights too (staged).
  base = _pick(BLOCK_ROWS, dim, rows, itemsize, w_itemsize, layout, _TABLE)
  staged = weight_path(base.schedule, layout, w_itemsize) is WeightPath.STAGED
  if blocks >= wide_d_min_blocks(kind) and dim % 128 == 0:
    steps = most_steps(dataclasses.replace(base, tile_d=128), BLOCK_ROWS,
                       itemsize, w_itemsize, staged)
    if steps >= 2:
      base = dataclasses.replace(base, tile_d=128, max_concurrent_steps=steps)
  if dim >= DEEP_D:
    base = dataclasses.replace(base, epi_passes=DEEP_D_PASSES,
                               mma_in_flight=0 if staged else 1)
    base = dataclasses.replace(base, max_concurrent_steps=max(2, most_steps(
        base, BLOCK_ROWS, itemsize, w_itemsize, staged)))
  return dataclasses.replace(base, batch_blocks=blocks)


# Blocked launches at D >= DEEP_D take the epilogue in DEEP_D_PASSES passes
# (a quarter of the accumulator buffer: Dt = 64 in 6 slots instead of 4,
# Dt = 128 in 3 instead of 2) and keep one wgmma in flight. There a tile's
# wgmma steps (128 per tile at D = 8192, Dt = 64) take longer than the
# other warpgroup's epilogue, so the gap each wgmma_wait(0) leaves between
# steps is what the tensor cores lose. Measured on an H100 in alternating
# rounds (docs/performance.md, "Deep D: epilogue passes and a wgmma in
# flight"): at D = 8192 4-8% faster at B = 256,
# 512 and 1024; at D = 2048 and 4096 no better or slower (the epilogue
# passes cost more than the slots gain).
DEEP_D = 8192
DEEP_D_PASSES = 4


# The fewest batch blocks whose launch takes Dt = 128 in 2 slots, for the
# devices where that differs from WIDE_D_MIN_BLOCKS. Measured at B = 256
# (two blocks; docs/performance.md, "Batch blocks", has the times): on an
# H200 Dt = 128 was faster on shapes S and L than Dt = 64 in 4 slots; on an
# H100 Dt = 64 was as fast on L and 0-4% faster on S. From three blocks
# Dt = 128 won on both.
WIDE_D_MIN_BLOCKS = 3
WIDE_D_MIN_BLOCKS_BY_KIND: dict[str, int] = {"NVIDIA H200": 2}


def wide_d_min_blocks(kind: str | None = None) -> int:
  """:data:`WIDE_D_MIN_BLOCKS` for the device kind ``kind`` (default: the
  first GPU's)."""
  if kind is None:
    kind = devices.device_kind()
  for name, n in WIDE_D_MIN_BLOCKS_BY_KIND.items():
    if devices.is_kind(kind, name):
      return n
  return WIDE_D_MIN_BLOCKS


def supported_dtype(dtype) -> bool:
  """Whether the kernels take weights of ``dtype``: bf16 and f16 (the
  wgmma's operands), and the 8-bit dtypes they convert on chip."""
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          or quantized_dtype(dtype))


# 8-bit weights converted to the hidden state's bf16/f16 on chip, exactly
# (docs/design.md, "Quantized heads").
QUANTIZED_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8)


def quantized_dtype(dtype) -> bool:
  """Whether ``dtype`` is one of :data:`QUANTIZED_DTYPES`."""
  return any(jnp.dtype(dtype) == jnp.dtype(q) for q in QUANTIZED_DTYPES)


def slot_entries_config(batch: int, dim: int, rows: int, itemsize: int = 2,
                        w_itemsize: int | None = None,
                        layout: str = "vd") -> tuple[TuningConfig, int] | None:
  """``(cfg, n)`` of the plain kernel's launch for ``batch`` rows where it is
  one launch of the vocabulary-major ping-pong schedule with whole tiles
  per warpgroup (the schedule whose epilogue ``sm90_slots`` replaces), as
  ``sm90_sampler.launches`` plans it; else None."""
  if batch > CHUNK_ROWS or (batch >= BLOCKED_MIN_ROWS and rows >= 128):
    return None
  n = batch_side(batch)
  cfg = pick_config(n, dim, rows, itemsize, w_itemsize=w_itemsize, layout=layout)
  if (cfg.schedule is not Schedule.PINGPONG_VOCAB_M or cfg.wg_share != 1
      or cfg.batch_blocks != 1):
    return None
  return cfg, cfg.batch_pad(n)
