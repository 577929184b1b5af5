"""The ``mosaic`` backend: the Pallas Mosaic GPU kernels for Hopper (sm90).

This adapter turns a checked problem into the kernels' array arguments
(:mod:`pallas_kernels.sm90_sampler` for plain sampling,
:mod:`pallas_kernels.sm90_controls` for sampling controls) and says where
they cannot run. The kernel modules are imported on first use: a CPU-only
user of the ``xla`` backend never imports Pallas Mosaic GPU.

For tests on a machine without a Hopper GPU, an instance can run the real
kernels in Pallas' GPU interpret mode (``MosaicBackend(interpret=True)``) or
trace them for an H100 to check their CUDA lowering
(``MosaicBackend(assume_sm90=True)`` under :func:`h100_lowering`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from flashsample_jax import dense_lists, stage2
from flashsample_jax.backends import SamplerBackend, rows_per_pass
from flashsample_jax.backends import xla as xla_backend
from pallas_kernels import devices, rowdata
from pallas_kernels.state import from_row_lists

# Several samples alone (no transform, truncation or log-probabilities) are
# drawn as S * B rows of one plain launch while those fit the fast plain
# kernels (N <= 128): row ``s * B + b`` is sample ``s`` of row ``b`` with its
# own counters, so the tokens are the same. The controls kernel pads B to
# 64 rows and evaluates every sample's noise for each (S = 4 at B = 1 took
# twice XLA's time that way: docs/performance.md, "Routes on the GPU").
SAMPLES_AS_ROWS_MAX = 128
# Rows (batch x samples) up to which auto prefers the controls kernel to
# the dense route without truncation (see MosaicBackend.prefers).
ROUTE_MAX_ROWS = 192
# Plain sampling where the dense route measured faster than the kernel:
# (smallest D, fewest rows, most rows). At D = 8192 and B = 320 (three
# blocks) the kernel ran 4-6% behind the dense route on the H100 in
# alternating rounds; at B = 256 (two blocks, since its epilogue passes and
# wgmma in flight) it ran 8-10% ahead of it and 2-8% ahead of XLA's dot +
# categorical, and at B = 128 and 512 it wins too (docs/performance.md,
# "Routes on the GPU").
PLAIN_DENSE = ((8192, 257, 320),)
# Where a GPU's points differ. The H200's faster memory leaves its single
# launches of 129-192 rows behind the dense route sooner (docs/performance.md,
# "Routes on the GPU", which has the interleaved rounds' times): at D = 8192
# the kernel won at 128 and lost from 144 on, so the range starts at the
# first row count of the single launch, 129; at D = 4096 the two overlapped
# at 160 and the kernel lost at 176 and 192, so it starts at 161. At D =
# 2048 and 2880 the kernel stays ahead at 192. D between 4096 and 8192 was
# not measured. With the D >= 8192 settings of the blocked launch its two
# blocks cost about the same from 193 to 256 rows while the dense route grows
# with B: the two cross between 240 and 244, and at 257-320 (three blocks)
# the dense route stays ahead.
PLAIN_DENSE_BY_KIND = {
    "NVIDIA H200": ((8192, 129, 240), (8192, 257, 320), (4096, 161, 192))}
# Bit-planes (allowed mask and history) a launch holds in shared memory
# next to its pipeline: at most 16, i.e. penalties in the kernel for up to
# 16383 output ids per row (a frequency penalty's count planes grow with
# their bit length); longer histories take the gathered-rows route.
MAX_PLANES = 16


def plain_dense(kind: str):
  """The ``(smallest D, fewest rows, most rows)`` points where plain
  sampling takes the dense route on the GPU ``kind``."""
  for name, points in PLAIN_DENSE_BY_KIND.items():
    if devices.is_kind(kind, name):
      return points
  return PLAIN_DENSE


def _kernels():
  # Imported here: Pallas Mosaic GPU only where the backend runs.
  from pallas_kernels import sm90_common, sm90_config, sm90_controls, sm90_sampler
  return sm90_common, sm90_config, sm90_sampler, sm90_controls


# Plain sampling of an 8-bit head: XLA's GEMM reads the 8-bit weight and
# converts it in its own kernel, and the dense route through it measured
# faster than the staged kernels. The register path (vocabulary on M, "vd")
# measured faster than it up to B = 128 on the S, Qwen3-1.7B and gpt-oss
# heads (D = 2048-4096), but on L's D = 8192 only where one launch runs the
# wide steps (B <= 48) and from B = 80 on (docs/performance.md, "Quantized
# heads at B = 17-128" and "Wide 8-bit steps"; H200, e4m3). Below D = 2048
# (not measured past 16 rows) only the wide steps of B <= 16.
QUANTIZED_KERNEL_MIN_D = 2048
QUANTIZED_SHALLOW_MAX_B = 16
QUANTIZED_DENSE_DEEP_D = 8192
QUANTIZED_DENSE_DEEP_ROWS = (17, 79)

# Truncation with an 8-bit head takes the plain kernel's slot lists
# (MosaicBackend.slot_lists) up to this many rows: faster than the dense
# route's at B = 1 and 16 on the benchmark heads (level on gpt-oss at
# B = 1), mixed at 32 and 48,
# slower from 64 on, where the register path's narrower tiles run behind
# XLA's GEMM (docs/performance.md, "Lists from the plain kernel"; H200).
SLOT_LISTS_MAX_ROWS = 16


def _quantized_plain_prefers(p) -> bool:
  """Whether plain sampling of ``p``'s 8-bit head runs here."""
  # sm90_config imports only jax.numpy (see check).
  from pallas_kernels import sm90_config  # pylint: disable=import-outside-toplevel
  if p.layout != "vd" or p.weight_rows < 128 or p.batch > sm90_config.REGISTER_PATH_MAX_N:
    return False
  wide = sm90_config.wide_8bit_steps(p.batch, p.hidden_dim, p.weight_rows,
                                     p.hidden.dtype.itemsize, p.layout)
  if p.hidden_dim < QUANTIZED_KERNEL_MIN_D:
    return wide and p.batch <= QUANTIZED_SHALLOW_MAX_B
  if wide:
    return True
  lo, hi = QUANTIZED_DENSE_DEEP_ROWS
  return not (p.hidden_dim >= QUANTIZED_DENSE_DEEP_D and lo <= p.batch <= hi)


@dataclasses.dataclass(frozen=True)
class MosaicBackend(SamplerBackend):
  """The fused Hopper kernels.

  Attributes:
    interpret: run the kernels in Pallas' GPU interpret mode on the CPU:
      True, or a ``plgpu.InterpretGPUParams``. For tests: it misses races
      and accepts some ops that do not lower for CUDA. Seen on a 2-core
      machine: 8-bit heads hung there with one host CPU device and ran with
      the 8 that tests/conftest.py sets
      (``--xla_force_host_platform_device_count``).
    num_sms: CTAs of the persistent grids. None: the GPU's SMs (4 in
      interpret mode, which keeps interpretation fast).
    assume_sm90: accept any device, to trace the kernels for CUDA on a
      machine without a Hopper GPU (see :func:`h100_lowering`).
    config: a ``pallas_kernels.sm90_config.TuningConfig`` for every plain
      launch instead of the heuristic's (tests, benchmarks).
    profile_dir: a directory where every launch on the GPU writes a trace
      of its warpgroups' named regions (Mosaic GPU's profiler; experiments).
    batch_invariant: calls that report floats (log-probabilities,
      entropies) run the controls kernel's batch-invariant split, so that a
      row's bits do not depend on the batch around it (docs/design.md,
      "Determinism and RL"); False: the per-B split.
    slot_rows: the most rows for which truncation with an 8-bit head takes
      the plain kernel's slot lists (:meth:`slot_lists`; default
      :data:`SLOT_LISTS_MAX_ROWS`; 0: never).
  """

  name: ClassVar[str] = "mosaic"
  interpret: Any = None
  num_sms: int | None = None
  assume_sm90: bool = False
  config: Any = None
  profile_dir: str | None = None
  batch_invariant: bool = True
  slot_rows: int = SLOT_LISTS_MAX_ROWS

  def __post_init__(self):
    if not isinstance(self.batch_invariant, bool):
      raise TypeError(f"batch_invariant={self.batch_invariant!r} must be a bool")
    if not isinstance(self.slot_rows, int) or isinstance(self.slot_rows, bool) \
        or self.slot_rows < 0:
      raise ValueError(f"slot_rows={self.slot_rows!r} must be an int >= 0")

  def _target(self):
    common = _kernels()[0]
    params = self.interpret or None  # None or False: the GPU, its whole grid
    if params is True:
      from jax.experimental.pallas import mosaic_gpu as plgpu
      params = plgpu.InterpretGPUParams()
    num_sms = self.num_sms or (4 if params is not None else None)
    return common.Target(interpret=params, num_sms=num_sms,
                         profile_dir=self.profile_dir)

  def check(self, p, c):
    del c  # every control is implemented
    if not (self.interpret or self.assume_sm90 or _is_sm90_device()):
      try:
        dev = jax.devices()[0]
        where = f"{dev.platform} device {getattr(dev, 'device_kind', dev)}"
      except RuntimeError:
        where = "no device"
      raise NotImplementedError(
          f"the mosaic backend needs an sm90 (Hopper) GPU; the default device "
          f"is a {where}")
    # sm90_config imports only jax.numpy: cheap where the kernels never run.
    from pallas_kernels import sm90_config
    dtype = jnp.dtype(p.weight.dtype)
    if not sm90_config.supported_dtype(dtype):
      raise NotImplementedError(
          f"the mosaic backend supports bfloat16, float16, float8_e4m3fn, "
          f"float8_e5m2 and int8 weights, got weight.dtype={dtype}")
    if sm90_config.quantized_dtype(dtype):
      # 8-bit tiles convert on chip in the ping-pong schedules, which need
      # two compute warpgroups' tiles of 64+ rows (docs/design.md,
      # "Quantized heads"); the hidden state is already the MMA's dtype.
      if jnp.dtype(p.hidden.dtype) not in (jnp.dtype(jnp.bfloat16),
                                           jnp.dtype(jnp.float16)):
        raise NotImplementedError(
            f"the mosaic backend multiplies 8-bit weights in bfloat16 or "
            f"float16, got hidden.dtype={p.hidden.dtype}")
      if p.weight_rows < 128:
        raise NotImplementedError(
            f"the mosaic backend converts {dtype} weights in its ping-pong "
            f"kernels, which need at least 128 weight rows; this weight has "
            f"{p.weight_rows}")
    if p.hidden_dim % 64:
      raise NotImplementedError(
          f"the mosaic backend needs D a multiple of 64, got D={p.hidden_dim}")

  def candidates(self, p, *, vocab_offset=0):
    _, _, sampler, _ = _kernels()
    rows = rowdata.pack_rows(k0=p.k0, k1=p.k1, temperature=p.temperature,
                            ctr_hi=p.ctr_hi[None], ctr_lo=p.ctr_lo[None])
    return sampler.candidates(p.hidden, p.weight, rows, vocab_offset,
                              layout=p.layout, vocab_size=p.vocab_size,
                              config=self.config, target=self._target(),
                              scale=p.weight_scale)

  def controls_state(self, p, c, *, vocab_offset=0):
    if self.slot_lists(p, c):
      return _slot_list_state(p, stage2.candidate_count(p, c), vocab_offset, self._target())
    _, _, _, controls_kernel = _kernels()
    rows, penalties, history = _kernel_rows(p, c, c.samples, given=c.given_ids)
    return controls_kernel.controls_state(
        p.hidden, p.weight, rows, vocab_offset, samples=c.samples,
        layout=p.layout, vocab_size=p.vocab_size, total_rows=p.total_rows,
        candidates=stage2.candidate_count(p, c), lists=c.lists,
        return_logprobs=c.return_logprobs, softcap=c.softcap is not None,
        noise=c.noise, logit_bias=c.logit_bias, allowed_mask=c.allowed_mask,
        penalties=penalties, history=history,
        lists_by_id=self._offers_exact_top(p, c), target=self._target(),
        scale=p.weight_scale, entropy=c.return_entropy, raw=c.raw_lse,
        finite=c.return_kept > 0, given=c.given_ids is not None,
        batch_invariant=self.fixed_split(c),
        invariant_rows=self.invariant_rows(p, c))

  def invariant_rows(self, p, c) -> int:
    """The controls kernel's ``invariant_rows`` for the call: its
    ``BATCH_WIDE`` (128-row blocks past 64 rows where the kernel allows
    them, with one epilogue at every batch: faster than 64-row blocks at
    large batches on deep heads, docs/performance.md, "RL outputs and
    batch invariance"). A subclass may narrow it (experiments). One
    value per head and controls, never per batch: a row's bits depend on
    it."""
    del p, c
    return _kernels()[3].BATCH_WIDE

  def fixed_split(self, c) -> bool:
    """Whether the call ``c`` runs the controls kernel's batch-invariant
    split: calls that report floats, unless ``batch_invariant`` is off;
    tokens and kept sets are the same on every split (docs/design.md,
    "Determinism and RL"). A subclass may widen it (experiments)."""
    return self.batch_invariant and c.reports_floats

  def rl_outputs(self):
    # Entropy terms, the raw logits' log-sum-exp, the finite count and the
    # given ids' t in the controls kernel's pass; raw top-N lists not
    # (raw_top_lists).
    return True

  def exact_top(self, p, c):
    # Early-exit kernels instead of XLA's conditional for top_logprobs'
    # uncertified rows: the conditional's CUDA graph node alone cost more
    # than both launches when they do nothing (docs/performance.md, "The
    # exact path's conditional"). One launch of at most
    # EXACT_TOP_MAX_ROWS rows: its [B, V] f32 buffer is allocated on every
    # call. Truncation rules keep the conditional (their exact path also
    # re-decides the tokens).
    if not self._offers_exact_top(p, c):
      return None
    _, _, _, controls_kernel = _kernels()

    def run(flags):
      rows, penalties, history = _kernel_rows(p, c, 1)
      return controls_kernel.exact_top(
          p.hidden, p.weight, rows, flags, n_top=c.top_logprobs, layout=p.layout,
          vocab_size=p.vocab_size, total_rows=p.total_rows,
          softcap=c.softcap is not None, logit_bias=c.logit_bias,
          allowed_mask=c.allowed_mask, penalties=penalties, history=history,
          target=self._target(), scale=p.weight_scale,
          wide_epilogue=self._wide_epilogue(p, c))
    return run

  def _wide_epilogue(self, p, c) -> bool:
    # The pass's (controls_kernel._block_rows) for an 8-bit weight, whose
    # Dt follows it: exact_top's t must be the pass's. A bf16 / f16 t is
    # the same at either config (docs/performance.md, "RL outputs and
    # batch invariance", "Their own Dt"), and keeps the one its GPU tests ran.
    return (p.quantized and self.fixed_split(c)
            and self.invariant_rows(p, c) == _kernels()[3].BATCH_WIDE)

  def _offers_exact_top(self, p, c) -> bool:
    # Also where the lists are merged in top_n's order (a two-key sort,
    # dearer than top_k's), which only this path reads. Under vocabulary
    # sharding stage 2 does not ask for it: the sort is then spent.
    from pallas_kernels.sm90_controls import EXACT_TOP_MAX_ROWS
    return (bool(c.top_logprobs) and not c.truncates and p.batch <= EXACT_TOP_MAX_ROWS
            and (not c.penalizes or self.fuses_penalties(p, c)))

  def prefers(self, p, c):
    # Measured against the dense route (XLA's GEMM writing the logits, then
    # one fused noise pass) on the H100: plain sampling in batch blocks is
    # faster at every batch up to 1024 on the four benchmark heads but the
    # points of PLAIN_DENSE, and so is a truncation rule (the dense route
    # sorts [B, V]); other controls up to ROUTE_MAX_ROWS rows per pass over
    # W (not measured in blocks), and calls that report floats at every
    # batch: their bits are batch invariant only on the kernel's fixed split,
    # the dense route's GEMM picks its algorithm by the batch
    # (docs/performance.md, "Routes on the GPU").
    if not c.active:
      if p.quantized:
        return _quantized_plain_prefers(p)
      return not any(p.hidden_dim >= d and lo <= p.batch <= hi
                     for d, lo, hi in plain_dense(devices.device_kind()))
    if self.fixed_split(c):
      return True
    if p.quantized and c.lists:
      # The controls kernel stages an 8-bit tile into bf16 before its
      # wgmma; XLA's GEMM and the dense route's lists from slots measured
      # faster at every batch (docs/performance.md, "Candidate lists of the
      # dense route"). Where the plain kernel's pass keeps the lists
      # (slot_lists) it runs here.
      return self.slot_lists(p, c)
    return c.truncates or rows_per_pass(self, p, c) <= ROUTE_MAX_ROWS

  def slot_lists(self, p, c) -> bool:
    """Whether the call's pass is the plain kernel keeping each tile's
    largest tempered logits (:mod:`pallas_kernels.sm90_slots`), its lists
    built by a Triton row kernel: an 8-bit ``"vd"`` head, a truncation
    rule on every row (the pass draws no noise, ``Controls.for_pass``), no
    transform, penalty or reported float, lists of at most 128 from at
    least 8 tiles per entry (as the dense route's slots), and at most
    ``slot_rows`` rows, which the plain kernel runs in one
    vocabulary-major launch (docs/performance.md, "Lists from the plain
    kernel")."""
    if not (p.quantized and p.layout == "vd" and c.lists and c.every_row_truncates
            and p.batch <= self.slot_rows):
      return False
    if (c.transforms or c.penalizes or c.reports_floats or c.return_kept or c.raw_lse
        or c.given_ids is not None or self.fixed_split(c)):
      return False
    if not (self.interpret or xla_backend.lists_kernel_usable()):
      return False
    m = stage2.candidate_count(p, c)
    if m > stage2.CANDIDATES:
      return False
    from pallas_kernels import sm90_config  # pylint: disable=import-outside-toplevel
    picked = sm90_config.slot_entries_config(p.batch, p.hidden_dim, p.weight_rows,
                                             p.hidden.dtype.itemsize, 1, p.layout)
    if picked is None:
      return False
    return -(-p.weight_rows // picked[0].tile_v) >= dense_lists.SLOTS_PER_ENTRY * m

  def fuses_penalties(self, p, c):
    # Bit-planes of the history beside the allowed mask: a few bits per id
    # instead of gathering B x (P + O) weight rows (docs/performance.md,
    # "Penalties in the kernel").
    del p
    planes = stage2.penalty_planes(c).planes + int(c.allowed_mask is not None)
    return planes <= MAX_PLANES

  def samples_as_rows(self, p, c):
    return p.batch * c.samples <= SAMPLES_AS_ROWS_MAX


def _kernel_rows(p, c, samples: int, given=None):
  """The controls kernel's per-row data for ``samples`` samples (and each
  row's ``given`` id, int ``[B]``, or None), and the penalties'
  ``(Penalties, (ids, flags))`` history planes (None, None without
  penalties)."""
  ctr_hi, ctr_lo = p.counters(samples)
  penalties = history = None
  if c.penalizes:
    *history, penalties = stage2.history_bits(c)
  rows = rowdata.pack_rows(
      k0=p.k0, k1=p.k1, temperature=p.temperature, ctr_hi=ctr_hi, ctr_lo=ctr_lo,
      softcap=c.softcap,
      penalties=stage2.penalty_rows(c, p.batch) if c.penalizes else None,
      given=given)
  return rows, penalties, history


def _slot_list_state(p, m: int, vocab_offset, target):
  """The pass of :meth:`MosaicBackend.slot_lists`: each tile's entries
  from the plain kernel, then the rows' lists, log-sum-exp and best from
  the Triton entry kernel (:func:`~pallas_kernels.state.from_row_lists`)."""
  # pylint: disable=import-outside-toplevel
  from pallas_kernels import sm90_slots, triton_lists
  rows = rowdata.pack_rows(k0=p.k0, k1=p.k1, temperature=p.temperature,
                           ctr_hi=p.ctr_hi[None], ctr_lo=p.ctr_lo[None])
  entries = sm90_slots.slot_entries(p.hidden, p.weight, rows, vocab_offset, layout=p.layout,
                                    vocab_size=p.vocab_size, target=target,
                                    scale=p.weight_scale)
  return from_row_lists(triton_lists.entry_lists(entries, m, p.batch))


def _is_sm90_device() -> bool:
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


@contextlib.contextmanager
def h100_lowering(num_sms: int = 132):
  """Traces under an abstract H100 of ``num_sms`` SMs, so that
  ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` runs the
  Pallas -> Mosaic GPU lowering of the kernels without a GPU (with
  ``MosaicBackend(assume_sm90=True)``)."""
  common = _kernels()[0]
  with jax.sharding.use_abstract_mesh(common.h100_abstract_mesh(num_sms)):
    yield
