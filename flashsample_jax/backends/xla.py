"""The ``xla`` backend: pure JAX, streams over vocabulary chunks.

Each step computes the logits of one chunk of the vocabulary, adds the noise
and keeps a running best ``(score, id)`` per row (with controls: the per-row
:class:`~pallas_kernels.state.ControlsState`), so no ``[B, V]`` array is
ever live. Runs on any JAX device and is the fallback for
``backend="auto"``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from flashsample_jax import controls, dense_lists, problem, stage2
from flashsample_jax.backends import SamplerBackend, rows_per_pass
from flashsample_jax.problem import Problem
from pallas_kernels import devices, rowdata, rules
from pallas_kernels.state import ControlsState, from_row_lists

# Elements of the [B, Vc] chunk. On a GPU 2**22 f32 values (16 MiB of
# logits, about as much again for the scores): measured on an H200, 2**20
# left the GEMMs too small (B=256: 1.7x slower; docs/performance.md, "The
# streaming xla backend's chunks"). On a
# CPU, where each chunk's slice of W is a copy, 2**20 keeps memory small.
_CHUNK_ELEMENTS = {"gpu": 2**22}
_DEFAULT_CHUNK_ELEMENTS = 2**20
_MIN_CHUNK = 512

# auto's route on a CPU (issue #42, defect 7): where the streaming backend
# splits the vocabulary into more than one chunk, the dense route measured
# faster up to about this many bytes of [rows, V] f32 logits, on the demo's
# head (Qwen3-0.6B: D=1024, V=151936; bf16 and f32 weights;
# benchmarks/experiments/exp_cpu_route.py; docs/performance.md, "Routes on
# the CPU"): 0.2-0.4x the streaming time at
# B 8-16, plain and top-k + top-p; at B 32-48 even for plain sampling and
# 0.6-0.8x with top-k + top-p; at B 64-128 plain sampling 1.25-2.4x slower
# and top-k + top-p 0.8-0.97x. One bound for both, where plain sampling stops
# gaining: above it auto stays on the streaming backend, which also keeps
# memory bounded.
DENSE_CPU_MAX_LOGIT_BYTES = 2**25  # 32 MiB: B <= 55 at V=151936

# XlaBackend.list_select's values.
LIST_SELECTS = ("top_k", "slots", "kernel", "auto")


def _platform() -> str:
  return jax.default_backend()


# On a GPU, XLA's GEMM of an 8-bit head runs slower for one row than for 16
# (the same weight read; docs/performance.md, "Candidate lists of the dense
# route"), so a block's GEMM takes at least this many rows of hidden states,
# the extra ones zero and dropped. Rows do not mix in a GEMM: each row's
# logits are the same products and sums; only their order may follow the
# kernel XLA picks.
MIN_GEMM_ROWS_8BIT = 16


def _gemm_rows(p: Problem, rows: int) -> int:
  """The rows :func:`_block_logits` gives XLA's GEMM for ``rows`` rows."""
  if _platform() == "gpu" and problem.is_quantized(p.weight.dtype):
    return max(rows, MIN_GEMM_ROWS_8BIT)
  return rows


def _block_logits(p: Problem, hidden, w):
  """f32 logits of ``hidden`` against a chunk ``w = (weight, scale)``
  (:func:`problem.logits`; scale None: the product alone), the GEMM padded
  to :func:`_gemm_rows` rows."""
  rows = hidden.shape[0]
  pad = _gemm_rows(p, rows) - rows
  if pad:
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
  l = problem.logits(hidden, w[0], p.layout, w[1])
  return l[:rows] if pad else l


def chunk_size(batch: int, rows: int) -> int:
  """Vocabulary rows per chunk: a fixed number of elements, a multiple of 128."""
  elements = _CHUNK_ELEMENTS.get(_platform(), _DEFAULT_CHUNK_ELEMENTS)
  c = max(_MIN_CHUNK, elements // max(batch, 1))
  c = (c // 128) * 128
  return min(c, rows)


# How _stream walks the chunks (measured on an H200; docs/performance.md,
# "The streaming xla backend's chunks"):
# on a GPU, static slices of W fuse into XLA's GEMM, while a fori_loop's
# dynamic slice is copied out of W first (a [chunk, D] copy per step: 2.7x
# slower at B=64). So there chunks are unrolled, each one's matmul ordered
# after the previous chunk's result by an optimization barrier (else XLA may
# run every chunk's matmul first and hold all their outputs at once). On a
# CPU a static slice is a copy too and unrolling only raises memory, and past
# MAX_UNROLLED chunks the loop keeps the program small.
MAX_UNROLLED = {"gpu": 32}


def _stream(p: Problem, block, combine, vc: int):
  """Folds ``block(hidden, (w_chunk, scale_chunk), start, width)`` over the
  vocabulary (``scale_chunk``: :meth:`Problem.scale_slice`).

  The first chunk seeds the state (rather than constants): in the loop form
  the carry then varies over the same shard_map axes as the data, which
  shard_map(check_vma=True) requires.
  """
  rows = p.weight_rows
  axis = 0 if p.layout == "vd" else 1
  n_full = rows // vc
  chunk = lambda start, width: (
      lax.slice_in_dim(p.weight, start, start + width, axis=axis),
      p.scale_slice(start, width))
  state = block(p.hidden, chunk(0, vc), 0, vc)

  def step(state, w, start, width):
    hidden, state = lax.optimization_barrier((p.hidden, state))
    return combine(state, block(hidden, w, start, width))

  if n_full <= MAX_UNROLLED.get(_platform(), 0):
    for i in range(1, n_full):
      state = step(state, chunk(i * vc, vc), i * vc, vc)
  else:
    def body(i, state):
      start = i * vc
      w = (lax.dynamic_slice_in_dim(p.weight, start, vc, axis=axis),
           p.scale_slice(start, vc))
      return combine(state, block(p.hidden, w, start, vc))
    state = lax.fori_loop(1, n_full, body, state)
  tail = rows - n_full * vc
  if tail:
    state = step(state, chunk(n_full * vc, tail), n_full * vc, tail)
  return state


def _row_best(s, gid):
  """Best ``(score, global id)`` of each row of a score block ``[B, Vc]``."""
  j = jnp.argmax(s, axis=1)  # first max, first NaN: the tie rule
  best = jnp.take_along_axis(s, j[:, None], axis=1)[:, 0]
  return best, jnp.broadcast_to(gid, s.shape[-1:])[j].astype(jnp.int32)


def _all_vocabulary(p: Problem, vocab_offset) -> bool:
  """Whether every id of the weight's rows is known, at trace time, to be a
  vocabulary id: an unsharded head without padding rows."""
  return (isinstance(vocab_offset, int) and vocab_offset == 0
          and p.weight_rows <= p.vocab_size)


def candidates(p: Problem, *, vocab_offset=0, chunk: int | None = None):
  """Best ``(score f32 [B], global id int32 [B])`` over ``p.weight``'s rows.

  Args:
    p: the checked problem.
    vocab_offset: global vocabulary id of the weight's first row (non-zero
      when ``weight`` is one shard of a vocabulary-sharded head).
    chunk: vocabulary rows per step; default :func:`chunk_size`.
  """
  vc = min(chunk or chunk_size(p.batch, p.weight_rows), p.weight_rows)
  offset = jnp.asarray(vocab_offset, jnp.int32)
  # XLA does not fold the mask of an iota against a bound it never reaches,
  # and it made the noise pass measurably slower than XLA's categorical
  # (docs/performance.md, "The dense route's noise pass").
  masked = not _all_vocabulary(p, vocab_offset)

  def block(hidden, w, start, width):
    gid = offset + start + lax.iota(jnp.int32, width)
    l = _block_logits(p, hidden, w)
    s = stage2.perturbed(p, l, stage2.tempered(p, l), gid, 1)[:, 0]
    if masked:
      s = jnp.where(gid < p.vocab_size, s, -jnp.inf)
    return _row_best(s, gid)

  return _stream(p, block, rules.combine, vc)



# -- sampling controls ---------------------------------------------------------


def _chunk_rows(p: Problem, c: controls.Controls) -> int:
  """The rows :func:`chunk_size` sizes a pass's chunks for: B x S (each
  sample's noise is a chunk's worth), but B where the call reports floats,
  whose merges over the chunks must not depend on S: ``score_tokens`` (one
  sample) then returns ``sample(num_samples=S)``'s floats bit for bit."""
  return p.batch * (1 if c.reports_floats else c.samples)


def controls_state(p: Problem, c: controls.Controls, *, vocab_offset=0,
                   chunk: int | None = None, list_select: str = "top_k") -> ControlsState:
  """The :class:`~pallas_kernels.state.ControlsState` of ``p``'s rows in one
  streaming pass over the vocabulary.

  Per row: the best perturbed score of each sample (with its tempered
  logit), an online log-sum-exp of the tempered logits, and (with
  truncation) the top-M tempered logits of each chunk: exact by
  ``lax.top_k`` (bound ``-inf``), or from slots or the list kernels
  (``list_select``, :func:`_block_lists`, :func:`_kernel_slot`), whose bound
  sends a row they cannot certify to stage 2's exact path.
  """
  vc = min(chunk or chunk_size(_chunk_rows(p, c), p.weight_rows), p.weight_rows)
  m = stage2.candidate_count(p, c)
  offset = jnp.asarray(vocab_offset, jnp.int32)
  product_is_x = _product_is_x(p, c, vocab_offset)

  def block(hidden, w, start, width):
    gid = offset + start + lax.iota(jnp.int32, width)
    dot = _block_logits(p, hidden, (w[0], None))
    l = problem.scaled(dot, w[1])
    x = controls.transform(l, gid, c, p.vocab_size)
    t = _one_t(p, c, stage2.tempered(p, x))
    slot = _kernel_slot(c, m, width, list_select)
    if slot is None:
      st = _pass_state(p, c, x, t, gid)
    elif product_is_x:
      st = _kernel_state(p, dot, w[1], gid[0], m, slot)
    else:
      st = _kernel_state(p, x, None, gid[0], m, slot)
    st = stage2.rl_state(c, st, t, controls.raw_logits(l, gid, c, p.vocab_size)
                         if c.raw_lse else None, gid=gid, raw_m=stage2.raw_count(p, c))
    if c.lists and slot is None:
      st = st._replace(**_block_lists(t, gid, m, width, list_select))
    return st

  return _stream(p, block, stage2.state_combine(c, m), vc)


def _one_t(p: Problem, c: controls.Controls, t):
  """``t`` made once for all its readers where the call reports floats on a
  CPU. XLA:CPU's ``x / T`` can round apart by an ulp between two fusions (a
  vectorized loop and a scalar one), so the row's maximum and its
  ``exp(t - max)`` sum would read two values of the top id's ``t``; at small
  T one ulp of ``t`` is large, and the log-sum-exp and entropies went wrong
  (T = 1e-30: infinite), while tokens do not depend on it. The reference and
  the exact path fence ``t`` alike (``stage2.materialized_rows``). A GPU's
  fusions divide with one instruction; the fence, which would write ``t``
  out, is left off there (not yet checked on a GPU at small T)."""
  if c.reports_floats and _platform() == "cpu":
    return lax.optimization_barrier(t)
  return t


@jax.named_scope("xla.pass_state")
def _pass_state(p: Problem, c: controls.Controls, x, t, gid) -> ControlsState:
  """A block's best of each sample and online log-sum-exp, by XLA."""
  sc = stage2.pass_scores(p, c, x, t, gid)                         # [B, S, W]
  j = jnp.argmax(sc, axis=2)                                       # [B, S]
  mx = jnp.max(t, axis=1)
  return ControlsState(
      best_score=jnp.take_along_axis(sc, j[:, :, None], axis=2)[:, :, 0],
      best_id=gid[j], best_t=jnp.take_along_axis(t, j, axis=1), lse_max=mx,
      lse_sum=jnp.sum(jnp.where(mx[:, None] == -jnp.inf, 0.0, jnp.exp(t - mx[:, None])),
                      axis=1))


def _kernel_slot(c: controls.Controls, m: int, width: int, list_select: str) -> int | None:
  """The slot size of :func:`_kernel_state` for a block, or None where it
  does not serve: lists by ``"kernel"``, a pass without noise because every
  row truncates (its best is the argmax of ``t``, read only for greedy rows,
  where ``t`` is ``x``; ``Controls.for_pass``), lists of at most
  ``LISTS_MAX`` and a block wide enough for slots
  (:func:`dense_lists.slot_size`). ``score_tokens``' pass draws no noise
  whatever the rules: it takes the kernels only where ``sample``'s pass
  does, so that both read the same lists and log-sum-exp, and a drawn
  token scores with the bits it was drawn with (docs/design.md,
  "Determinism and RL")."""
  if (list_select != "kernel" or not c.lists or c.noise
      or not c.every_row_truncates):
    return None
  from pallas_kernels import triton_lists  # pylint: disable=import-outside-toplevel
  if m > triton_lists.LISTS_MAX:
    return None
  return dense_lists.slot_size(width, m)


def _product_is_x(p: Problem, c: controls.Controls, vocab_offset) -> bool:
  """Whether a block's ``x`` is its scaled product itself: no transform or
  penalty, and every id of the weight's rows a vocabulary id (padding rows
  ``transform`` would set to -inf)."""
  return not (c.transforms or c.penalizes) and _all_vocabulary(p, vocab_offset)


@jax.named_scope("xla.kernel_state")
def _kernel_state(p: Problem, x, scale, first_id, m: int, slot: int) -> ControlsState:
  """A block's best, log-sum-exp and top-``m`` lists from the Triton list
  kernels (:mod:`pallas_kernels.triton_lists`; ids ``first_id + column``)
  over ``(x * scale) / T``, which the kernels temper as XLA does: from the
  GEMM's own output where it is ``x`` up to the scale, so that the tempered
  logits are not written for them. The best's score is its ``t``: a pass
  without noise scores greedy rows only, whose ``t`` is ``x``."""
  from pallas_kernels import triton_lists  # pylint: disable=import-outside-toplevel
  return from_row_lists(triton_lists.row_lists(
      x, first_id, m, slot=slot, scale=scale,
      inv_temperature=rowdata.reciprocal(p.temperature)))


def lists_kernel_usable() -> bool:
  """The list kernels can launch: the default device is a CUDA GPU (a
  numeric compute capability; jax-triton launches CUDA kernels, and a ROCm
  device is a "gpu" too), and triton and jax-triton are installed."""
  return (devices.cuda_capability() is not None
          and all(importlib.util.find_spec(name) is not None
                  for name in ("triton", "jax_triton")))


@jax.named_scope("xla.block_lists")
def _block_lists(t, gid, m: int, width: int, list_select: str) -> dict:
  """A block's top-``m`` candidate list as ControlsState fields: exact by
  ``lax.top_k`` (bound ``-inf``), or by :func:`dense_lists.slot_lists`
  where the block is wide enough for its slots (``list_select`` "slots",
  or "kernel" where the list kernels do not serve the block,
  :func:`dense_lists.slot_size`)."""
  slot = dense_lists.slot_size(width, m) if list_select in ("slots", "kernel") else None
  if slot is not None:
    vals, ids, bound = dense_lists.slot_lists(t, gid, m, slot=slot)
    return dict(cand_vals=vals, cand_ids=ids, cand_bound=bound)
  vals, j = lax.top_k(t, min(m, width))
  if width < m:
    pad = ((0, 0), (0, m - width))
    vals = jnp.pad(vals, pad, constant_values=-jnp.inf)
    j = jnp.pad(j, pad, constant_values=width - 1)
  return dict(cand_vals=vals, cand_ids=gid[j],
              cand_bound=jnp.full((t.shape[0],), -jnp.inf))


@dataclasses.dataclass(frozen=True)
class XlaBackend(SamplerBackend):
  """Pure JAX streaming over vocabulary chunks; runs on every device.

  Attributes:
    chunk: vocabulary rows per step (None: :func:`chunk_size`).
    list_select: how a chunk's candidate list (truncation, top-N, kept
      sets) is read off its logits: ``"top_k"`` (``lax.top_k``),
      ``"slots"`` (:mod:`flashsample_jax.dense_lists`, for chunks of
      at least ``64 M`` ids; the same results), ``"kernel"`` (the Triton
      list kernels, :mod:`pallas_kernels.triton_lists`, which also give the
      log-sum-exp and the best where the pass draws no noise; slots
      elsewhere; a CUDA GPU with jax-triton), or ``"auto"``: the kernels on
      a GPU with jax-triton, slots on one without, where ``lax.top_k``
      sorts each row, ``lax.top_k`` elsewhere (docs/performance.md,
      "Candidate lists of the dense route").
  """

  name: ClassVar[str] = "xla"
  chunk: int | None = None
  list_select: str = "top_k"

  def __post_init__(self):
    if self.list_select not in LIST_SELECTS:
      raise ValueError(f"list_select={self.list_select!r} must be one of {LIST_SELECTS}")

  def lists_by(self) -> str:
    """``list_select`` with ``"auto"`` resolved for the default backend."""
    if self.list_select != "auto":
      return self.list_select
    if _platform() != "gpu":
      return "top_k"
    return "kernel" if lists_kernel_usable() else "slots"

  def check(self, p, c):
    del p, c  # every checked problem; only list_select="kernel" needs more
    if self.list_select == "kernel" and not (_platform() == "gpu" and lists_kernel_usable()):
      raise NotImplementedError(
          "list_select='kernel' launches Triton kernels: it needs a CUDA GPU, triton "
          "and jax-triton (pip install 'flashsample-jax[triton]')")

  def candidates(self, p, *, vocab_offset=0):
    return candidates(p, vocab_offset=vocab_offset, chunk=self.chunk)

  def controls_state(self, p, c, *, vocab_offset=0):
    return controls_state(p, c, vocab_offset=vocab_offset, chunk=self.chunk,
                          list_select=self.lists_by())

  def rl_outputs(self):
    return True

  def raw_top_lists(self):
    return True


@dataclasses.dataclass(frozen=True)
class DenseBackend(XlaBackend):
  """XLA's dot writes the f32 logits of the whole vocabulary, then one fused
  pass adds the noise and takes the argmax (the xla backend with a single
  chunk). It holds ``B x V x 4`` bytes of logits, which the fused kernels
  never write: where the kernels lose to XLA (large batches on a GPU) it is
  the fastest exact route, and ``auto`` takes it there; on a CPU ``auto``
  takes it up to :data:`DENSE_CPU_MAX_LOGIT_BYTES` of logits. Its candidate
  lists come from the Triton list kernels on a GPU (slots without
  jax-triton; ``list_select="auto"``).
  """

  name: ClassVar[str] = "dense"
  chunk: int | None = 2**31 - 1
  list_select: str = "auto"

  def prefers(self, p, c):
    # On a GPU, after the fused kernels (which come first in the registry
    # and prefer the calls where they measured faster): XLA's GEMM and one
    # fused pass beat the streaming backend's chunked GEMMs there. On a CPU
    # up to DENSE_CPU_MAX_LOGIT_BYTES of logits, where the streaming backend
    # would take more than one chunk (within one chunk it runs this very
    # program, and auto keeps its name). Elsewhere (not measured) the
    # bounded-memory streaming backend is the fallback.
    platform = jax.default_backend()
    if platform == "gpu":
      return True
    if platform != "cpu":
      return False
    rows = rows_per_pass(self, p, c)
    if chunk_size(rows, p.weight_rows) >= p.weight_rows:
      return False
    return rows * p.weight_rows * 4 <= DENSE_CPU_MAX_LOGIT_BYTES
