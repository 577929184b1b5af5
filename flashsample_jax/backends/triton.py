"""The ``triton`` backend: the fused Triton kernels, for CUDA GPUs from sm80.

This adapter turns a checked problem into the array arguments of
:mod:`pallas_kernels.triton_sampler` (plain sampling) and
:mod:`pallas_kernels.triton_controls` (sampling controls), launched through
``jax_triton.triton_call``, and merges their per-tile outputs for stage 2.
Quantized heads (float8_e4m3fn, float8_e5m2, int8 weights with an f32
scale per vocabulary row or per tensor; docs/design.md, "Quantized heads")
run in the same kernels: each W tile is read in its 8-bit dtype and converted
on chip, and the scale multiplies the f32 dot result first.
The RL outputs (entropies, raw log-probabilities, kept sets, and the given
ids' t of ``score_tokens``; docs/design.md, "Determinism and RL") come from
the same controls launch, the first where several carry the samples.
Triton and jax-triton are an optional extra
(``pip install "flashsample-jax[triton]"``) imported only where a CUDA GPU is
present: a machine without them never imports them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from flashsample_jax import stage2
from flashsample_jax.backends import SamplerBackend, rows_per_pass
from pallas_kernels import devices, rules
from pallas_kernels.rowdata import pack_rows
from pallas_kernels.state import halve_parts

# Largest tempered logits each vocabulary tile lists for truncation. A tile
# holds 64-128 ids, so a row's kept set (top-k 50 of ~150k ids, say) rarely
# has more than a few in one tile; a tile that does raises the bound, and a
# row whose kept set reaches below it takes stage 2's exact path.
TILE_CANDIDATES = 4
# Rounds of pairing neighbouring tiles' lists before stage 2's top-M sort
# (pallas_kernels.state.halve_parts): each halves the candidates the sort
# reads (9496 per row at V = 152k and 64-id tiles, sorted padded to 16384,
# against the mosaic kernel's 924). After r rounds a row takes the exact
# path when more than TILE_CANDIDATES of its kept set fall in 2 ** r
# neighbouring tiles (top-k 50 of 152k ids, r = 2: 256 ids, P ~ 2e-5 per
# row if the kept ids fell at random; a vocabulary that keeps related or
# frequent tokens at neighbouring ids makes it likelier: not yet measured
# on a trained model's logits).
LIST_PAIRINGS = 2
# Samples per controls launch (each re-reads W); more take further launches.
MAX_KERNEL_SAMPLES = 4
# Several samples alone are drawn as S * B rows of one plain launch while
# those fit one batch block of the plain kernel's widest config.
SAMPLES_AS_ROWS_MAX = 64
# Rows (batch x samples) up to which auto prefers the kernels to the dense
# route without truncation (see TritonBackend.prefers). At B = 128 the kernel
# measured 1.06-1.10x faster than XLA's dot + categorical on an H100 but
# 0.82-0.88x on an H200 (docs/performance.md, "Routes on the GPU"), and it
# is not measured on the GPUs it is meant for (sm80, sm89, sm100): 64 until
# it is.
ROUTE_MAX_ROWS = 64


# 8-bit weights the kernels convert on chip (exactly) to the hidden dtype.
_QUANTIZED = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2),
              jnp.dtype(jnp.int8))


def _weight_scale(p):
  """The problem's weight scale (None for a float head): f32 ``()`` or
  ``[weight_rows]``, passed to the kernels as it is."""
  return getattr(p, "weight_scale", None)


def _kernels():
  from pallas_kernels import triton_controls, triton_sampler
  return triton_sampler, triton_controls


def _cuda_capability() -> tuple[int, int]:
  """The default device's CUDA compute capability; NotImplementedError if
  it is not a CUDA GPU."""
  capability = devices.cuda_capability()
  if capability is None:
    try:
      dev = jax.devices()[0]
    except RuntimeError as e:
      raise NotImplementedError(f"the triton backend needs a CUDA GPU: {e}") from None
    cc = getattr(dev, "compute_capability", "")
    raise NotImplementedError(
        f"the triton backend needs a CUDA GPU; the default device is a "
        f"{dev.platform} device {getattr(dev, 'device_kind', dev)}"
        + (f" (compute capability {cc!r})" if cc else ""))
  return capability


@dataclasses.dataclass(frozen=True)
class TritonBackend(SamplerBackend):
  """The fused Triton kernels (CUDA GPUs from sm80: A100, L40S, H100, B200).

  Attributes:
    config: a ``pallas_kernels.triton_sampler.TritonConfig`` for every plain
      launch instead of the per-GPU table's (tests, benchmarks).
    controls_config: the same for the controls kernel's launches (whose
      own choice is ``triton_controls.pick_controls_config``).
    list_pairings: rounds of pairing the tiles' candidate lists before
      stage 2 (:data:`LIST_PAIRINGS`; 0 sorts every tile's list).
    batch_invariant: calls that report floats (log-probabilities,
      entropies, scores) run the batch-invariant configs, so that a row's
      bits do not depend on the batch around it (docs/design.md,
      "Determinism and RL"); False: the per-B table's (faster at B = 33-64,
      docs/performance.md, "RL outputs and batch invariance").
  """

  name: ClassVar[str] = "triton"
  config: Any = None
  controls_config: Any = None
  list_pairings: int = LIST_PAIRINGS
  batch_invariant: bool = True

  def __post_init__(self):
    if (isinstance(self.list_pairings, bool) or not isinstance(self.list_pairings, int)
        or self.list_pairings < 0):
      raise ValueError(f"list_pairings={self.list_pairings!r} must be an int >= 0")
    if not isinstance(self.batch_invariant, bool):
      raise TypeError(f"batch_invariant={self.batch_invariant!r} must be a bool")

  def check(self, p, c):
    if getattr(c, "raw_top", False):
      # top_logprobs of the raw logits need lists of them, which the
      # controls kernel does not keep (getattr: an option newer than this
      # check).
      raise NotImplementedError(
          "the triton backend does not yet list the raw logits "
          "(top_logprobs_mode='raw'); the xla and dense backends do")
    major, minor = _cuda_capability()
    if major < 8:
      raise NotImplementedError(
          f"the triton backend needs a CUDA GPU from sm80 (bf16 tl.dot); this "
          f"is sm{major}{minor}")
    for module in ("triton", "jax_triton"):
      if importlib.util.find_spec(module) is None:
        raise NotImplementedError(
            f"the triton backend needs {module}: pip install "
            "'flashsample-jax[triton]' (jax-triton 0.3.1, triton 3.6)")
    dtype = jnp.dtype(p.weight.dtype)
    halves = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if dtype in _QUANTIZED:
      if _weight_scale(p) is None:
        raise NotImplementedError(
            f"the triton backend takes a {dtype} weight only with its "
            "weight_scale (per vocabulary row or per tensor)")
      if jnp.dtype(p.hidden.dtype) not in halves:
        raise NotImplementedError(
            f"the triton backend multiplies a quantized weight with bfloat16 or "
            f"float16 hidden states, got hidden.dtype={p.hidden.dtype}")
    elif dtype not in halves:
      raise NotImplementedError(
          f"the triton backend supports bfloat16, float16, float8_e4m3fn, "
          f"float8_e5m2 and int8 weights, got weight.dtype={dtype}")

  def candidates(self, p, *, vocab_offset=0):
    sampler, _ = _kernels()
    rows = pack_rows(k0=p.k0, k1=p.k1, temperature=p.temperature,
                     ctr_hi=p.ctr_hi, ctr_lo=p.ctr_lo)
    score, index = sampler.candidates(
        p.hidden, p.weight, rows, vocab_offset, layout=p.layout,
        vocab_size=p.vocab_size, weight_scale=_weight_scale(p),
        config=self.config)
    return rules.argbest(score, index, axis=1)

  def controls_state(self, p, c, *, vocab_offset=0):
    _, kernel = _kernels()
    ctr_hi, ctr_lo = p.counters(c.samples)
    # The entropy terms are relative to each tile's log-sum-exp max.
    need_lse = c.return_logprobs or c.lists or c.return_entropy
    given = c.given_ids is not None
    invariant = self._invariant(p, c)
    parts = []
    for g0 in range(0, c.samples, MAX_KERNEL_SAMPLES):
      g1 = min(c.samples, g0 + MAX_KERNEL_SAMPLES)
      # Only the first launch computes what does not depend on the samples:
      # the log-sum-exp, the lists and the RL fields.
      first = g0 == 0
      spec = kernel.Controls(
          samples=g1 - g0, softcap=c.softcap is not None,
          bias=c.logit_bias is not None, mask=c.allowed_mask is not None,
          t_best=c.return_logprobs, lse=first and need_lse, noise=c.noise,
          top_k=TILE_CANDIDATES if first and c.lists else 0,
          entropy=first and c.return_entropy,
          raw=first and c.return_raw_logprobs,
          finite=first and c.return_kept > 0, given=first and given)
      rows = pack_rows(k0=p.k0, k1=p.k1, temperature=p.temperature,
                       ctr_hi=ctr_hi[g0:g1], ctr_lo=ctr_lo[g0:g1],
                       softcap=c.softcap)
      parts.append(kernel.control_candidates(
          p.hidden, p.weight, rows, vocab_offset, layout=p.layout,
          vocab_size=p.vocab_size, controls=spec, bias=c.logit_bias,
          allowed_mask=c.allowed_mask,
          given_ids=c.given_ids.astype(jnp.int32) if spec.given else None,
          weight_scale=_weight_scale(p), config=self.controls_config,
          batch_invariant=invariant))
    first = parts[0]
    lists = (first.cand_vals, first.cand_ids, first.bound)
    if c.lists:
      lists = halve_parts(*lists, self.list_pairings)
    cat = lambda name: jnp.concatenate([getattr(q, name) for q in parts], axis=1)
    return stage2.state_from_parts(
        cat("best_score"), cat("best_index"),
        cat("best_t") if c.return_logprobs else None,
        first.lse_max, first.lse_sum, *lists, m=stage2.candidate_count(p, c),
        ent_sum=first.ent_sum, raw_max=first.raw_max, raw_sum=first.raw_sum,
        finite_count=first.finite_count, given_t=first.given_t)

  def rl_outputs(self):
    return True

  def prefers(self, p, c):
    # As the mosaic backend's (docs/performance.md, "Routes on the GPU"):
    # with truncation always, otherwise up to ROUTE_MAX_ROWS rows per pass
    # over W; plain sampling of a quantized head through XLA's GEMM
    # ("Quantized heads"); calls that report floats at every batch where
    # their bits are batch invariant here (the dense route's GEMM is not).
    if p.quantized and not c.active:
      return False
    if self._invariant(p, c):
      return True
    if p.quantized and c.lists:
      # As the mosaic backend's: the dense route with lists from slots
      # ("Candidate lists of the dense route").
      return False
    return c.truncates or rows_per_pass(self, p, c) <= ROUTE_MAX_ROWS

  def _invariant(self, p, c) -> bool:
    # Calls that report floats run the batch-invariant configs, so a row's
    # bits never depend on the batch around it (Controls.reports_floats;
    # docs/design.md, "Determinism and RL"), where the kernel has them.
    if not (self.batch_invariant and c.reports_floats and self.controls_config is None):
      return False
    _, kernel = _kernels()
    return kernel.has_invariant_config(jnp.dtype(p.weight.dtype).itemsize, p.layout)

  def samples_as_rows(self, p, c):
    return p.batch * c.samples <= SAMPLES_AS_ROWS_MAX
