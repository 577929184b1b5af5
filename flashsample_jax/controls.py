"""Sampling controls: their validation and their exact meaning.

Order of the transforms (docs/design.md, "The exactness contract"), for row
``b`` and id ``v``:

1. ``x = l``                                  f32 logits ``hidden @ W.T``
2. ``x = c * tanh(x / c)``                     ``softcap=c`` (Gemma 2)
3. ``x = x + logit_bias[v]``                   ``logit_bias [V]``
4. penalties, for ids in the row's history    ``prompt_ids``, ``output_ids`` (vLLM's)
   (``n`` = count of ``v`` in ``output_ids[b]``):
   ``x = x / r if x > 0 else x * r``          ``repetition_penalty=r``, ids in either
   ``x = x - f * n - p * (n > 0)``            ``frequency_penalty=f``, ``presence_penalty=p``
5. ``x = -inf`` where ``v`` is not allowed     ``allowed_mask``, and ids >= vocab_size
6. ``t = x / T[b]``                            temperature (greedy rows: argmax of ``x``)

Truncation of sampled rows, on the tempered ``t``:

* ``top_k[b] = k > 0``: keep ids with ``t >= `` the k-th largest ``t`` of the row
  (ties at the k-th value are all kept, so a row may keep more than k ids).
* ``top_p[b] = p < 1``: on ``q = softmax(t)`` restricted to what top-k kept,
  sort ids by ``t`` descending (ties by id); keep an id if the probability
  mass ranked strictly before it is ``< p`` (so the most probable id is
  always kept), and also every id whose ``t`` equals the last kept one's.
  In f32: ``e = exp(t - max t)`` in that order, ``s = prefix_sums(e)`` (prefix
  sums whose order of additions depends on the index alone), ``Z`` the value
  of ``s`` at the set's last id, the mass before an id the value of ``s`` at
  the id before it over ``Z`` (0 for the first; :func:`nucleus_terms`,
  :func:`mass_before`).
* ``min_p[b] = m > 0``: keep ids with ``exp(t - max t) >= m``: probability at
  least ``m`` times the row's top probability. For finite logits the top id
  is never removed by any rule, so min-p's kept set does not depend on its
  place among the rules (a ``+inf`` logit makes ``exp(t - max t)`` NaN:
  nothing is kept).

``truncation_order`` says what top-p's mass is measured over; the kept set is
the intersection of the three rules' sets either way:

* ``"hf"`` (default; Hugging Face's warpers): over what top-k kept.
* ``"vllm"`` (vLLM V1's sampler, which applies min-p first and renormalizes):
  over what top-k *and* min-p kept. With both top-p and min-p on, the nucleus
  is then larger or equal.

The token is then ``argmax(t + gumbel)`` over the kept ids, with the same
noise counters as without truncation: the result equals
``jax.random.categorical(key, where(kept, t, -inf))``.

``top_logprobs=N`` reports, per row, the N ids with the largest ``t`` before
truncation (greedy rows: ``T = 1``), ties (equal values: ``-0.0 == 0.0``) by
lower id, and ``t - logsumexp(t)`` for each: what ``lax.top_k(log_softmax(t),
N)`` returns, except where two logits round to one log-probability (the
order is by ``t``). :func:`top_n` is the definition. Entries of probability 0 (fewer than N allowed ids) have
id ``-1`` and log-probability ``-inf``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from flashsample_jax import checks, problem


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Controls:
  """Validated controls; ``None`` fields are off. A pytree (arrays as
  leaves), so checked controls pass into ``jax.jit`` and ``shard_map``.

  Attributes:
    top_k: int32 ``[B]`` (0 = off for that row) or None.
    top_p: f32 ``[B]`` (1 = off) or None.
    min_p: f32 ``[B]`` (0 = off) or None.
    logit_bias: f32 ``[vocab_size]`` or None.
    allowed_mask: uint32 ``[B, ceil(vocab_size / 32)]``; bit ``v % 32`` of word
      ``v // 32`` set means id ``v`` is allowed. None: all allowed.
    softcap: f32 scalar or None.
    repetition_penalty, presence_penalty, frequency_penalty: f32 ``[B]`` or
      None (1 / 0 / 0 = off for a row).
    prompt_ids, output_ids: int32 ``[B, P]`` / ``[B, O]`` histories padded
      with ``-1`` (ids may repeat), or None. Both None, or every penalty
      None: no penalty (:attr:`penalizes`).
    num_samples: static int or None (None: tokens ``[B]``; S: ``[S, B]``).
    return_logprobs: static bool.
    top_logprobs: static int N, 0 = off: the N most likely ids per row.
    every_row_truncates: static; True when a truncation rule was given as a
      concrete value that is on for every row (e.g. ``top_k=50``), so that
      every sampled row is decided on the candidates (:meth:`for_pass`).
    top_k_max: static; where ``top_k`` was given as a concrete value that is
      on for every row, a bound on its largest k (:func:`k_bound`): every
      row's kept set then lies in its top k and their ties, which candidate
      lists of ``top_k_max + LIST_SLACK`` ids decide
      (``stage2.candidate_count``). 0 otherwise.
    noise: static; False in the controls of a pass that draws no noise: its
      best of each row is the argmax of ``x`` (:meth:`for_pass`).
    truncation_order: static, ``"hf"`` or ``"vllm"``: what top-p's mass is
      measured over (the module docstring).
    return_entropy: static bool: entropies of each row's distribution
      before and after truncation.
    return_raw_logprobs: static bool: each token's log-probability under
      the raw logits (soft-capped only: :func:`raw_logits`).
    return_kept: static int N (0 = off): each row's kept set, its N most
      likely ids and its size.
    given_ids: int32 ``[B]`` or None: ids whose tempered logit the pass
      reports (``ControlsState.given_t``; :func:`flashsample_jax.score_tokens`).
    top_logprobs_mode: static, ``"processed"`` (the top N of ``t``, as
      sampled) or ``"raw"`` (of the raw logits: :func:`raw_logits`).
    uniform: static; the names of the per-row fields that are one traced
      value broadcast over the rows (a number under ``jax.jit``), which
      stage 2's exact path rebuilds inside its conditional (:func:`in_branch`).
      Whoever replaces such a field with values that differ by row must
      drop its name here.
  """

  top_k: Any = None
  top_p: Any = None
  min_p: Any = None
  logit_bias: Any = None
  allowed_mask: Any = None
  softcap: Any = None
  repetition_penalty: Any = None
  presence_penalty: Any = None
  frequency_penalty: Any = None
  prompt_ids: Any = None
  output_ids: Any = None
  given_ids: Any = None
  num_samples: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  return_logprobs: bool = dataclasses.field(default=False, metadata=dict(static=True))
  top_logprobs: int = dataclasses.field(default=0, metadata=dict(static=True))
  every_row_truncates: bool = dataclasses.field(default=False, metadata=dict(static=True))
  top_k_max: int = dataclasses.field(default=0, metadata=dict(static=True))
  noise: bool = dataclasses.field(default=True, metadata=dict(static=True))
  truncation_order: str = dataclasses.field(default="hf", metadata=dict(static=True))
  return_entropy: bool = dataclasses.field(default=False, metadata=dict(static=True))
  return_raw_logprobs: bool = dataclasses.field(default=False, metadata=dict(static=True))
  return_kept: int = dataclasses.field(default=0, metadata=dict(static=True))
  top_logprobs_mode: str = dataclasses.field(default="processed", metadata=dict(static=True))
  uniform: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))

  @property
  def truncates(self) -> bool:
    return any(x is not None for x in (self.top_k, self.top_p, self.min_p))

  @property
  def penalizes(self) -> bool:
    """Penalties apply: a history and a penalty were both given (otherwise
    :func:`prepare_controls` drops them)."""
    return self.prompt_ids is not None or self.output_ids is not None

  @property
  def returns_output(self) -> bool:
    """The call returns a :class:`SampleOutput` (not bare tokens)."""
    return self.return_logprobs or self.top_logprobs > 0 or self.rl_outputs

  @property
  def rl_outputs(self) -> bool:
    """Entropies, raw log-probabilities or kept sets are asked for (the
    outputs for RL rollouts; docs/design.md, "Determinism and RL")."""
    return (self.return_entropy or self.return_raw_logprobs or self.return_kept > 0
            or self.raw_top)

  @property
  def raw_top(self) -> bool:
    """``top_logprobs`` of the raw logits: the pass keeps lists of them."""
    return self.top_logprobs > 0 and self.top_logprobs_mode == "raw"

  @property
  def raw_lse(self) -> bool:
    """The pass keeps an online log-sum-exp of the raw logits."""
    return self.return_raw_logprobs or self.raw_top

  @property
  def reports_floats(self) -> bool:
    """The call reports floats (log-probabilities, entropies, scores of
    given tokens), whose last bits follow the order in which a pass adds a
    row's terms: the kernels run such calls on their batch-invariant
    schedules (docs/design.md, "Determinism and RL"). Tokens and kept sets
    are the same on every schedule."""
    return (self.return_logprobs or self.top_logprobs > 0 or self.return_entropy
            or self.return_raw_logprobs or self.given_ids is not None)

  @property
  def needs_kept_set(self) -> bool:
    """Outputs that depend on each row's exact kept set (not only on its
    token): stage 2 may then not take shortcuts that decide the token
    alone."""
    return self.return_logprobs or self.return_entropy or self.return_kept > 0

  @property
  def lists(self) -> bool:
    """A pass must keep the top-M candidate lists (truncation, top-N, kept
    sets)."""
    return (self.truncates or (self.top_logprobs > 0 and not self.raw_top)
            or self.return_kept > 0)

  @property
  def transforms(self) -> bool:
    return any(x is not None for x in (self.logit_bias, self.allowed_mask, self.softcap))

  @property
  def active(self) -> bool:
    return (self.truncates or self.transforms or self.penalizes
            or self.num_samples is not None or self.returns_output)

  @property
  def samples(self) -> int:
    return self.num_samples or 1

  def for_pass(self) -> "Controls":
    """The controls a pass over W runs with. Where a truncation rule is on
    for every row (known when the call is traced), each sampled row's token
    is drawn in stage 2 from its kept candidates, with the noise of those
    few ids; the pass's own best of each row is read only for greedy rows,
    which take the argmax of ``x``. That pass then draws no noise (the bulk
    of its per-element work) and one best per row serves every sample:
    ``noise=False, num_samples=None``. Otherwise ``self``."""
    if self.every_row_truncates and self.noise:
      return dataclasses.replace(self, num_samples=None, noise=False)
    return self

  @property
  def samples_only(self) -> bool:
    """Only several samples are asked for: no transform, truncation or
    log-probabilities (a backend may then draw them as rows)."""
    return not (self.truncates or self.transforms or self.penalizes
                or self.returns_output)


def _concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _per_row(name, value, batch, *, integer, lo, hi, lo_open=False, off, check=None):
  """A scalar or ``[B]`` control as a ``[B]`` array; range-checks concrete values.

  Values are checked before the cast to int32/float32, so an out-of-range
  int64 cannot wrap into range. ``check(name, value)``, if given, replaces
  the ``[lo, hi]`` check (e.g. :func:`flashsample_jax.problem.check_normal`).
  """
  if value is None:
    return None
  if isinstance(value, bool):
    raise TypeError(f"{name}={value!r} must be a number or a [B] array")
  if isinstance(value, (int, float, np.integer, np.floating)):
    if integer and not isinstance(value, (int, np.integer)):
      raise TypeError(f"{name}={value!r} must be an int or an int [B] array")
    raw = np.asarray(value)
  else:
    if not hasattr(value, "dtype"):
      raise TypeError(f"{name} must be a number or an array, got {type(value).__name__}")
    kind_ok = (jnp.issubdtype(value.dtype, jnp.integer) if integer else
               (jnp.issubdtype(value.dtype, jnp.floating)
                or jnp.issubdtype(value.dtype, jnp.integer))) and value.dtype != jnp.bool_
    if not kind_ok:
      raise TypeError(f"{name}.dtype={value.dtype} must be "
                      f"{'an integer' if integer else 'a float'} dtype")
    if value.ndim not in (0, 1) or (value.ndim == 1 and value.shape != (batch,)):
      raise ValueError(f"{name} must be a scalar or have shape [B]=({batch},), got "
                       f"{name}.shape={tuple(value.shape)}")
    raw = np.asarray(value) if _concrete(value) else None
  if check is not None:   # its own range, eager or (traced) under checkify
    check(name, value)
  elif raw is None:
    _debug_check_range(name, value, lo=lo, hi=hi, lo_open=lo_open, off=off)
  else:
    v = np.atleast_1d(raw).astype(np.float64)
    bad = np.isnan(v)
    bad |= (v <= lo) if lo_open else (v < lo)
    bad |= v > hi
    if bad.any():
      i = int(np.argmax(bad))
      shown = raw.item() if raw.ndim == 0 else raw[i]
      where = name if raw.ndim == 0 else f"{name}[{i}]"
      raise ValueError(f"{where}={shown} must be {_range_text(lo, hi, lo_open)} ({off})")
  dtype = jnp.int32 if integer else jnp.float32
  return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))


def _range_text(lo, hi, lo_open: bool) -> str:
  if (lo, hi) == (-_F32_MAX, _F32_MAX):
    return "finite"
  return f"in {'(' if lo_open else '['}{lo}, {hi}]"


def _debug_check(name: str, value, ok, want: str) -> None:
  """A :func:`flashsample_jax.checks.debug_check` that every entry of a
  traced ``value`` is ``ok`` (bool, ``value``'s shape): while traced checks
  are on, a no-op unless the caller wraps the call in ``checkify.checkify``
  (README, "Invalid values"), then an error naming the first bad entry."""
  flat_ok = jnp.ravel(ok)
  i = jnp.argmin(flat_ok)
  if jnp.ndim(value) == 0:
    where = name
  else:
    shape = tuple(jnp.shape(value))
    where = f"{name}[{{i}}]" if len(shape) == 1 else f"{name} entry {{i}} (flat, shape {shape})"
  checks.debug_check(jnp.all(flat_ok), f"{where}={{v}} must be {want}",
                     i=i, v=jnp.ravel(value)[i])


def _debug_check_range(name: str, value, *, lo, hi, lo_open: bool, off: str) -> None:
  """The range check of :func:`_per_row` for a traced value (NaN fails)."""
  x = jnp.asarray(value)
  ok = (x > lo) if lo_open else (x >= lo)
  _debug_check(name, x, ok & (x <= hi), f"{_range_text(lo, hi, lo_open)} ({off})")


def _on_everywhere(value, on, dtype=np.float64) -> bool:
  """Whether a truncation argument is concrete (not traced) and ``on`` holds
  for every row of it (called before its range check: NaN is not on).
  ``on`` sees the values as ``dtype``: a float rule's as the float32 the
  call keeps, so that a value on in float64 but off in float32 (``top_p``
  0.99999999 is 1.0) is off here too, as stage 2 and the reference read it."""
  if value is None or isinstance(value, bool) or not _concrete(value):
    return False
  try:
    with np.errstate(over="ignore", invalid="ignore"):
      raw = np.asarray(value).astype(dtype)
  except (TypeError, ValueError):
    return False
  return bool(raw.size) and bool(np.all(on(raw)))


# The smallest normal float32: a min_p below it is 0 where a GPU flushes
# subnormals (XLA does), so only one at or above it is on everywhere.
_F32_TINY = float(np.finfo(np.float32).tiny)


# Candidates a list holds beyond the largest N it decides (top-k's k,
# ``top_logprobs``' and ``return_kept``'s N): a tie at the N-th value is told
# from a clean cut only by the values after it (stage2.candidate_count).
LIST_SLACK = 8


# The shortest lists a concrete top-k gets (k_bound(k) + LIST_SLACK ids): one
# length for every k up to 56, so that the usual k (20-50) share one
# compiled program, and lists of 64 measured faster than 128
# (docs/performance.md, "The list kernels").
MIN_K_BOUND = 64 - LIST_SLACK


def k_bound(k: int) -> int:
  """The smallest ``2**n - LIST_SLACK`` at least ``k`` and
  :data:`MIN_K_BOUND`: lists of ``k_bound(k) + LIST_SLACK`` ids are a power
  of two long, and calls whose largest k differs a little share one bound,
  so one compiled program (1 .. 56 -> 56, 57 .. 120 -> 120)."""
  n = MIN_K_BOUND + LIST_SLACK
  while n - LIST_SLACK < k:
    n *= 2
  return n - LIST_SLACK


def _top_k_max(top_k, on_everywhere: bool) -> int:
  """:attr:`Controls.top_k_max` for the ``top_k`` argument (called after its
  range check), ``on_everywhere`` if it is concrete and on for every row:
  :func:`k_bound` of its largest k, at most ``RETURN_KEPT_MAX`` where k is
  (the longest lists any output asks for: stage2.candidate_count)."""
  if not on_everywhere:
    return 0
  k = int(np.max(np.asarray(top_k, np.int64)))
  return min(k_bound(k), RETURN_KEPT_MAX) if k <= RETURN_KEPT_MAX else k_bound(k)


# The largest ``top_logprobs``; the candidate lists hold a few more ids per
# row (stage2.candidate_count).
TOP_LOGPROBS_MAX = 128
# The largest ``return_kept``: kept sets are reported by their N most likely
# ids (RL trainers renormalize over them; past N the count flags overflow).
RETURN_KEPT_MAX = 1024
# What top_logprobs lists (vLLM's logprobs_mode, its "processed_logprobs" and
# "raw_logprobs"): the distribution sampled, or the model's raw logits.
TOP_LOGPROBS_MODES = ("processed", "raw")
_F32_MAX = float(np.finfo(np.float32).max)
# What top-p's mass is measured over (the module docstring).
TRUNCATION_ORDERS = ("hf", "vllm")


def _history(name, ids, batch, vocab_size):
  """``prompt_ids``/``output_ids``: int32 ``[B, n]``, ids in [-1, vocab_size)."""
  if ids is None:
    return None
  if not hasattr(ids, "dtype") or not hasattr(ids, "shape"):
    raise TypeError(f"{name} must be an int array [B, n] padded with -1, got "
                    f"{type(ids).__name__}")
  if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.dtype == jnp.bool_:
    raise TypeError(f"{name}.dtype={ids.dtype} must be an integer dtype")
  if ids.ndim != 2 or ids.shape[0] != batch:
    raise ValueError(f"{name}.shape={tuple(ids.shape)} must be [B, n] with "
                     f"B={batch} (pad rows with -1)")
  want = f"an id in [0, {vocab_size}) or -1 (padding)"
  if _concrete(ids) and ids.size:
    raw = np.asarray(ids)
    bad = (raw < -1) | (raw >= vocab_size)
    if bad.any():
      b, j = np.argwhere(bad)[0]
      raise ValueError(f"{name}[{b}, {j}]={raw[b, j]} must be {want}")
  elif ids.size:
    _debug_check(name, ids, ids_in_range(ids, vocab_size), want)
  return jnp.asarray(ids, jnp.int32)


def ids_in_range(ids, vocab_size: int):
  """bool, where traced ``ids`` are ids in ``[0, vocab_size)`` or -1. An
  unsigned dtype holds no -1, and ``ids >= -1`` would compare with the
  dtype's largest value (-1 converted): only the upper bound applies."""
  if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
    return ids < vocab_size
  return (ids >= -1) & (ids < vocab_size)


def _static_choice(name: str, value, choices: tuple[str, ...]) -> None:
  """A static option that names one of ``choices``."""
  if isinstance(value, str) and value in choices:
    return
  if isinstance(value, jax.core.Tracer):
    raise problem.static_arg_error(name, value, f"one of {choices}")
  raise ValueError(f"{name}={value!r} must be one of {choices}")


def _static_count(name: str, value, limit: int, vocab_size: int) -> int:
  """A static count of ids per row (0 = off), at most ``limit`` and the
  vocabulary size."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise problem.static_arg_error(name, value, "a Python int (0 = off)")
  top = min(limit, vocab_size)
  if not 0 <= value <= top:
    raise ValueError(f"{name}={value} must be in [0, {top}] "
                     f"(at most {limit} and the vocabulary size)")
  return int(value)


def prepare_controls(*, batch: int, vocab_size: int, rows: int, top_k=None,
                     top_p=None, min_p=None, logit_bias=None, allowed_mask=None,
                     softcap=None, repetition_penalty=None, presence_penalty=None,
                     frequency_penalty=None, prompt_ids=None, output_ids=None,
                     num_samples=None, return_logprobs=False,
                     top_logprobs=0, truncation_order="hf", return_entropy=False,
                     return_raw_logprobs=False, return_kept=0,
                     top_logprobs_mode="processed") -> Controls:
  """Checks the control arguments of :func:`flashsample_jax.sample`."""
  _static_choice("truncation_order", truncation_order, TRUNCATION_ORDERS)
  top_k_everywhere = _on_everywhere(top_k, lambda k: k > 0)
  # The pass drops its noise when every row truncates (Controls.for_pass):
  # a rule must then be on in every row as stage 2 reads it, else such a
  # row would take the pass's noiseless best.
  every_row_truncates = (top_k_everywhere
                         or _on_everywhere(top_p, lambda p: p < 1, np.float32)
                         or _on_everywhere(min_p, lambda m: m >= _F32_TINY, np.float32))
  given = dict(top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
  checked_top_k = _per_row("top_k", top_k, batch, integer=True, lo=0, hi=2**31 - 1,
                           off="0 turns top-k off")
  top_k_max = _top_k_max(top_k, top_k_everywhere)
  top_k = checked_top_k
  top_p = _per_row("top_p", top_p, batch, integer=False, lo=0.0, hi=1.0,
                   lo_open=True, off="1 turns top-p off")
  min_p = _per_row("min_p", min_p, batch, integer=False, lo=0.0, hi=1.0,
                   off="0 turns min-p off")
  if logit_bias is not None:
    if not hasattr(logit_bias, "dtype") or not jnp.issubdtype(logit_bias.dtype, jnp.floating):
      raise TypeError(f"logit_bias must be a float array [V], got "
                      f"{getattr(logit_bias, 'dtype', type(logit_bias).__name__)}")
    if logit_bias.shape not in ((vocab_size,), (rows,)):
      raise ValueError(f"logit_bias.shape={tuple(logit_bias.shape)} must be "
                       f"[vocab_size]=({vocab_size},) (or the weight's {rows} rows)")
    logit_bias = jnp.asarray(logit_bias, jnp.float32)[:vocab_size]
  if allowed_mask is not None:
    words = -(-vocab_size // 32)
    if not hasattr(allowed_mask, "dtype") or allowed_mask.dtype not in (
        jnp.dtype(jnp.uint32), jnp.dtype(jnp.int32)):
      raise TypeError(f"allowed_mask.dtype="
                      f"{getattr(allowed_mask, 'dtype', type(allowed_mask).__name__)}"
                      " must be uint32 or int32 (a packed bitmask)")
    if allowed_mask.shape != (batch, words):
      raise ValueError(f"allowed_mask.shape={tuple(allowed_mask.shape)} must be "
                       f"[B, ceil(vocab_size / 32)]=({batch}, {words})")
    allowed_mask = jax.lax.bitcast_convert_type(allowed_mask, jnp.uint32) \
        if allowed_mask.dtype == jnp.int32 else jnp.asarray(allowed_mask)
  if softcap is not None:
    softcap = _softcap(softcap)
  if num_samples is not None:
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)):
      raise problem.static_arg_error("num_samples", num_samples, "a Python int or None")
    if num_samples < 1:
      raise ValueError(f"{num_samples=} must be >= 1")
    num_samples = int(num_samples)
  if not isinstance(return_logprobs, bool):
    raise problem.static_arg_error("return_logprobs", return_logprobs, "a bool")
  top_logprobs = _static_count("top_logprobs", top_logprobs, TOP_LOGPROBS_MAX, vocab_size)
  for name, flag in (("return_entropy", return_entropy),
                     ("return_raw_logprobs", return_raw_logprobs)):
    if not isinstance(flag, bool):
      raise problem.static_arg_error(name, flag, "a bool")
  return_kept = _static_count("return_kept", return_kept, RETURN_KEPT_MAX, vocab_size)
  _static_choice("top_logprobs_mode", top_logprobs_mode, TOP_LOGPROBS_MODES)
  repetition_penalty = _per_row("repetition_penalty", repetition_penalty, batch,
                                integer=False, lo=None, hi=None,
                                off="1 turns it off", check=problem.check_normal)
  presence_penalty = _per_row("presence_penalty", presence_penalty, batch,
                              integer=False, lo=-_F32_MAX, hi=_F32_MAX,
                              off="0 turns it off")
  frequency_penalty = _per_row("frequency_penalty", frequency_penalty, batch,
                               integer=False, lo=-_F32_MAX, hi=_F32_MAX,
                               off="0 turns it off")
  prompt_ids = _history("prompt_ids", prompt_ids, batch, vocab_size)
  output_ids = _history("output_ids", output_ids, batch, vocab_size)
  penalties = (repetition_penalty, presence_penalty, frequency_penalty)
  width = sum(0 if a is None else a.shape[1] for a in (prompt_ids, output_ids))
  if all(x is None for x in penalties) or width == 0:
    # Penalties without a history, or a history without penalties, change
    # nothing: drop them so the call keeps its fast path.
    repetition_penalty = presence_penalty = frequency_penalty = None
    prompt_ids = output_ids = None
  uniform = _uniform(given, dict(
      top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty))
  return Controls(top_k=top_k, top_p=top_p, min_p=min_p, logit_bias=logit_bias,
                  allowed_mask=allowed_mask, softcap=softcap,
                  repetition_penalty=repetition_penalty,
                  presence_penalty=presence_penalty,
                  frequency_penalty=frequency_penalty, prompt_ids=prompt_ids,
                  output_ids=output_ids, num_samples=num_samples,
                  return_logprobs=return_logprobs,
                  top_logprobs=top_logprobs,
                  every_row_truncates=every_row_truncates,
                  top_k_max=top_k_max,
                  truncation_order=truncation_order, return_entropy=return_entropy,
                  return_raw_logprobs=return_raw_logprobs, return_kept=return_kept,
                  top_logprobs_mode=top_logprobs_mode, uniform=uniform)


def _softcap(softcap):
  """``softcap`` as an f32 scalar: a real number, finite and > 0 in float32
  (``c * tanh(x / c)`` is NaN for every logit at ``c = inf``, and every row
  would return id 0)."""
  dtype = getattr(softcap, "dtype", None)
  real = (isinstance(softcap, (int, float, np.integer, np.floating)) if dtype is None else
          jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
  if isinstance(softcap, bool) or not real or getattr(softcap, "ndim", 0) != 0:
    raise TypeError(f"softcap={softcap!r} must be a positive real scalar (a float or an int)")
  want = "> 0 and finite in float32 (None turns it off)"
  if _concrete(softcap):
    with np.errstate(over="ignore"):
      c = np.float32(np.asarray(softcap))
    if not (np.isfinite(c) and c > 0):
      raise ValueError(f"softcap={np.asarray(softcap).item()} must be {want}")
  else:
    c32 = jnp.asarray(softcap, jnp.float32)
    _debug_check("softcap", softcap, jnp.isfinite(c32) & (c32 > 0), want)
  return jnp.asarray(softcap, jnp.float32)


def _uniform(given: dict, per_row: dict) -> tuple[str, ...]:
  """:attr:`Controls.uniform`: the names whose ``[B]`` array (``per_row``)
  is one traced value broadcast from its argument (``given``)."""
  return tuple(name for name, value in per_row.items()
               if value is not None and problem.one_traced_value(given[name], value))


def in_branch(c: Controls):
  """A function, for a conditional's branch to call, that returns ``c``
  with its :attr:`Controls.uniform` fields broadcast there from their first
  entries (taken here, outside): the branch then does not take them as
  ``[B]`` operands (:func:`flashsample_jax.problem.in_branch`)."""
  firsts = {name: getattr(c, name)[0] for name in c.uniform if getattr(c, name) is not None}

  def rebuild() -> Controls:
    batch = lambda name: getattr(c, name).shape[0]
    return dataclasses.replace(c, **{name: jnp.broadcast_to(v, (batch(name),))
                                     for name, v in firsts.items()})

  return rebuild


def allowed_bits(allowed_mask, gid):
  """Whether ids ``gid`` (int32, ``[Vc]`` or per row ``[B, Vc]``) are
  allowed: bool ``[B, Vc]``."""
  if gid.ndim == 1:
    word = jnp.take(allowed_mask, gid // 32, axis=1, mode="clip")
  else:
    word = jnp.take_along_axis(allowed_mask, jnp.clip(gid // 32, 0, allowed_mask.shape[1] - 1),
                               axis=1)
  return ((word >> (gid % 32).astype(jnp.uint32)) & jnp.uint32(1)) == 1


def penalize(x, c: Controls, seen, count):
  """Step 4 of the module docstring: ``x [B, W]`` of ids that are in the
  row's history where ``seen`` (bool ``[B, W]``), ``count`` (int32 ``[B, W]``)
  times in its output. The one definition: the reference, the exact path
  and the fused path's history scoring all call it."""
  if c.repetition_penalty is not None:
    r = c.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
  n = count.astype(jnp.float32)
  sub = None
  if c.frequency_penalty is not None:
    sub = c.frequency_penalty[:, None] * n
  if c.presence_penalty is not None:
    pres = c.presence_penalty[:, None] * (count > 0).astype(jnp.float32)
    sub = pres if sub is None else sub + pres
  if sub is not None:
    x = jnp.where(count > 0, x - sub, x)
  return x


def dense_history(c: Controls, batch: int, width: int):
  """``(seen, count)`` of :func:`penalize` for every id ``[0, width)``:
  bool / int32 ``[B, width]`` (materialized; the reference and the exact
  path use it)."""
  rows = jnp.arange(batch)[:, None]
  scatter = lambda ids: jnp.zeros((batch, width), jnp.int32).at[
      rows, jnp.where(ids >= 0, ids, width)].add(1, mode="drop")
  count = (scatter(c.output_ids) if c.output_ids is not None
           else jnp.zeros((batch, width), jnp.int32))
  seen = count > 0
  if c.prompt_ids is not None:
    seen |= scatter(c.prompt_ids) > 0
  return seen, count


def transform(l, gid, c: Controls, vocab_size, history=None):
  """Steps 1-5 of the module docstring on a block: ``x [B, Vc]``.

  ``gid``: the block's ids, ``[Vc]`` or per row ``[B, Vc]``. ``history``:
  ``(seen, count)`` of :func:`penalize` for the block (required when
  ``c.penalizes``).
  """
  x = softcapped(l, c)
  if c.logit_bias is not None:
    bias = jnp.take(c.logit_bias, gid, mode="clip")
    x = x + (bias[None, :] if gid.ndim == 1 else bias)
  if c.penalizes:
    x = penalize(x, c, *history)
  valid = gid < vocab_size
  if c.allowed_mask is not None:
    valid = valid & allowed_bits(c.allowed_mask, gid)
  return jnp.where(valid, x, -jnp.inf)


def softcapped(l, c: Controls):
  """Step 2 of the module docstring: ``c * tanh(l / c)``, or ``l``.

  Its own fusion (optimization barriers on both sides): on a GPU XLA's
  f32 ``tanh`` takes the bits of the fusion it is emitted in, and the
  same soft-cap computed inside a pass's reductions and inside stage 2's
  history scoring came out an ulp apart (docs/design.md, "Division",
  soft-capping). Alone it is one elementwise loop, the same in every
  program, the reference's included."""
  if c.softcap is None:
    return l
  l = lax.optimization_barrier(l)
  return lax.optimization_barrier(c.softcap * jnp.tanh(l / c.softcap))


def raw_logits(l, gid, c: Controls, vocab_size):
  """The raw logits of a block (``return_raw_logprobs``; vLLM's "raw"): the
  model's logits soft-capped (step 2), ``-inf`` only for ids ``>=
  vocab_size``; no bias, penalty, mask or temperature."""
  return jnp.where(gid < vocab_size, softcapped(l, c), -jnp.inf)


def _sum_last(x):
  return jnp.sum(x, axis=-1)


def entropy_terms(t, m, row_sum=_sum_last):
  """``sum(exp(t - m) * (t - m))`` over the last axis, ``m`` the rows' max
  (``[B]``, as ``t``'s leading axes): with ``s = sum(exp(t - m))`` the
  entropy of ``softmax(t)`` is ``log(s) - terms / s``. Ids with ``t = -inf``
  (probability 0) add nothing; rows whose max is ``-inf`` add 0.
  ``row_sum``: the sum over the last axis (a fixed-order one where the
  bits must not follow the batch, :func:`flashsample_jax.stage2.fixed_logsumexp`)."""
  d = t - m[..., None]
  return row_sum(jnp.where(t > -jnp.inf, jnp.exp(d) * d, 0.0))


def entropy(t, row_sum=_sum_last):
  """The entropy of ``softmax(t)`` over the last axis (NaN for a row of
  ``-inf``): :func:`entropy_terms`' formula on materialized rows, its sums
  by ``row_sum`` (as there)."""
  m = jnp.max(t, axis=-1)
  s = row_sum(jnp.exp(t - m[..., None]))
  return jnp.log(s) - entropy_terms(t, m, row_sum) / s


def kept_list(kept, n: int, ids=None):
  """``(ids int32 [B, n], count int32 [B])`` of each row's kept set (the
  finite entries of ``kept``, ``-inf`` elsewhere): its ``n`` most likely
  ids in :func:`top_n`'s order, ``-1`` past its end, and its size."""
  vals, top = top_n(kept, n, ids=ids)
  count = jnp.sum(kept > -jnp.inf, axis=-1, dtype=jnp.int32)
  return jnp.where(vals > -jnp.inf, top, -1).astype(jnp.int32), count


def nothing_to_sample(x, kept, greedy, allowed_mask=None, vocab_size: int | None = None):
  """Rows with nothing to sample, bool ``[B]``: every id ``-inf`` after the
  controls (``x [B, V]``), for sampled rows also every id truncated away
  (``kept [B, V]``), or an ``allowed_mask`` that allows no id below
  ``vocab_size``. Their token is -1, not categorical's id 0."""
  none = jnp.where(greedy, jnp.all(x == -jnp.inf, axis=-1), jnp.all(kept == -jnp.inf, axis=-1))
  if allowed_mask is not None:
    none |= none_allowed(allowed_mask, vocab_size)
  return none


def valid_bits(words: int, vocab_size: int):
  """uint32 ``[words]``: the bits of an ``allowed_mask`` row's words that
  stand for ids below ``vocab_size``."""
  ids_in_word = vocab_size - 32 * jnp.arange(words)          # ids of each word < V
  full = jnp.uint32(0xFFFFFFFF)
  return jnp.where(ids_in_word >= 32, full,
                   (jnp.uint32(1) << jnp.clip(ids_in_word, 0, 31).astype(jnp.uint32))
                   - jnp.uint32(1))


def none_allowed(allowed_mask, vocab_size: int):
  """Rows of ``allowed_mask`` that allow no id below ``vocab_size``: bool ``[B]``."""
  bits = valid_bits(allowed_mask.shape[1], vocab_size)
  return ~jnp.any((allowed_mask & bits[None, :]) != 0, axis=1)


def _sort_desc(x):
  """Rows of ``x`` sorted descending.

  One sort with two keys, ``(-x, id)``: the ids only break ties, so the
  values come out as a stable argsort of ``-x`` would order them. A sort of
  one or two operands with one key may become a CUB radix-sort custom call
  on GPUs, which CUDA graphs cannot hold; then XLA decides a ``lax.cond``
  around this (the exact fallback of the fused path) on the host, stalling
  every launch after it. A two-key sort stays an XLA sort kernel, and the
  conditional stays on the device.
  """
  ids = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  neg, _ = lax.sort((-x, ids), dimension=x.ndim - 1, num_keys=2)
  return -neg


def top_n(t, n: int, ids=None):
  """The ``n`` largest values of each row of ``t`` and their ids, ordered by
  value (descending; ``-0.0 == 0.0``), ties by lower id: ``(vals, ids)``.
  ``ids``: the ids of ``t``'s entries (default: their positions).

  One sort with two keys, not ``lax.top_k``: top_k orders ``0.0`` before
  ``-0.0`` (which ``log_softmax`` makes equal), and on a GPU a top-k of a
  whole vocabulary may become a custom call that a CUDA graph cannot hold.
  """
  if ids is None:
    ids = lax.broadcasted_iota(jnp.int32, t.shape, t.ndim - 1)
  neg, ids = lax.sort((-t, ids), dimension=t.ndim - 1, num_keys=2)
  return -neg[..., :n], ids[..., :n]


@jax.named_scope("controls.prefix_sums")
def prefix_sums(x):
  """Inclusive prefix sums of ``x [B, N]`` along axis 1, each entry's
  additions in an order fixed by its index alone.

  A doubling scan (step ``s`` adds the entry ``2**s`` places before, or
  ``+0.0`` where there is none, which changes nothing): entry ``j`` is the
  same sum of the same terms in the same order whatever ``N > j`` is. So
  the prefix sums of a row's first ``M`` sorted values computed on a
  candidate list of ``M`` equal those of the whole sorted row, bit for bit
  (docs/design.md, "The nucleus edge, bit for bit"). Neither XLA's
  reductions nor its cumsum promise that: their order follows the tiling
  and the scan XLA picks for the length.
  """
  n = x.shape[1]
  # Each step reads the last one twice; fused into one loop, XLA would
  # recompute the earlier steps per read (XLA's CPU compiler does, many
  # times over on a 152k row). Fenced on the CPU and for long rows (the
  # reference, the exact path); the candidate lists of a GPU's stage 2 stay
  # one fusion, which measured no slower there (docs/performance.md, "RL
  # outputs and batch invariance").
  fence = jax.default_backend() == "cpu" or n > 2048
  step = 1
  while step < n:
    x = x + jnp.pad(x[:, :n - step], ((0, 0), (step, 0)))
    if fence:
      x = lax.optimization_barrier(x)
    step *= 2
  return x


@jax.named_scope("controls.nucleus_terms")
def nucleus_terms(ts):
  """``(s [B, N], Z [B])`` of top-p's mass over ``ts [B, N]`` (descending,
  ``-inf`` after the finite prefix the mass is measured over): ``s`` the
  prefix sums of ``e = exp(ts - ts[0])`` and ``Z`` their value at the last
  finite entry. Every step reads entries at or before that prefix's end
  only, so a list holding the prefix gives the same bits as the whole
  sorted row (a NaN in the row makes ``Z`` NaN, as a sum over the row
  would: nothing is then below p)."""
  e = jnp.exp(ts - ts[:, :1])
  s = prefix_sums(e)
  finite = jnp.sum(ts > -jnp.inf, axis=1)
  z = jnp.take_along_axis(s, jnp.maximum(finite - 1, 0)[:, None], axis=1)[:, 0]
  return s, jnp.where(jnp.any(jnp.isnan(e), axis=1), jnp.nan, z)


@jax.named_scope("controls.mass_before")
def mass_before(s, z):
  """The probability mass ranked strictly before each entry: the prefix sum
  ``s [B, N]`` of the entry before it over ``z [B]`` (0 for the first).
  One scan serves ``Z`` and this mass (docs/design.md, "The nucleus edge,
  bit for bit")."""
  before = jnp.pad(s[:, :-1], ((0, 0), (1, 0)))
  return before / z[:, None]


def truncated_logprob(t_tok, lse_kept):
  """``t_tok - lse_kept``, NaN where the kept set is empty (``lse_kept`` is
  ``-inf``): a greedy row keeps its argmax token when truncation keeps
  nothing (a ``+inf`` logit with min-p, a traced invalid rule), and a
  log-probability of ``+inf`` in no distribution means nothing; rows with
  nothing to sample report NaN already."""
  return jnp.where(lse_kept == -jnp.inf, jnp.nan, t_tok - lse_kept)


@jax.named_scope("controls.keep_mask")
def keep_mask(t, c: Controls):
  """The truncation rules of the module docstring on materialized rows.

  Args:
    t: tempered transformed logits ``[B, V]`` (``-inf`` where not allowed).
    c: the controls.

  Returns:
    bool ``[B, V]``: ids that survive top-k, top-p and min-p.
  """
  keep = jnp.ones(t.shape, bool)
  v = t.shape[1]
  if c.top_k is None and c.top_p is None:
    desc = None
  else:
    desc = _sort_desc(t)          # one sort serves both rules
  if c.top_k is not None:
    k = c.top_k[:, None]
    kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, v - 1), axis=1)
    keep &= (k <= 0) | (t >= kth)
  if c.min_p is not None:
    m = jnp.max(t, axis=1, keepdims=True)
    keep_min = (c.min_p[:, None] <= 0) | (jnp.exp(t - m) >= c.min_p[:, None])
  if c.top_p is not None:
    # The top-k survivors sorted (ties by id), then -inf: the kept set of
    # top-k is a prefix of ``desc`` (every value >= kth), and so is min-p's
    # (every value with exp(t - max) >= m), which "vllm" also applies first.
    ts = desc
    if c.top_k is not None:
      ts = jnp.where((k <= 0) | (desc >= kth), desc, -jnp.inf)
    if c.min_p is not None and c.truncation_order == "vllm":
      ts = jnp.where((c.min_p[:, None] <= 0) | (jnp.exp(desc - m) >= c.min_p[:, None]),
                     ts, -jnp.inf)
    tk = jnp.where(keep, t, -jnp.inf)
    before = mass_before(*nucleus_terms(ts))
    n = jnp.maximum(jnp.sum((before < c.top_p[:, None]) & (ts > -jnp.inf), axis=1), 1)
    thr = jnp.take_along_axis(ts, (n - 1)[:, None], axis=1)
    keep &= (c.top_p[:, None] >= 1) | (tk >= thr)
  if c.min_p is not None:
    keep &= keep_min
  return keep


class SampleOutput(NamedTuple):
  """What :func:`flashsample_jax.sample` returns with ``return_logprobs=True``
  or ``top_logprobs=N``.

  Shapes are ``[B]`` (or ``[S, B]`` with ``num_samples=S``), the top-N fields
  ``[B, N]`` (per row, not per sample). Log-probabilities are of the tempered
  distribution (greedy rows: temperature 1) after penalties, ``NaN`` for rows
  with nothing to sample (token ``-1``). Fields that were not asked for are None:
  ``logprob``, ``logprob_truncated`` and ``logsumexp`` without
  ``return_logprobs=True``, the top-N ones without ``top_logprobs``.

  Attributes:
    tokens: int32 sampled ids (``-1`` where the row has nothing to sample:
      ``allowed_mask`` allows nothing, every logit is ``-inf``, or truncation
      keeps nothing; :func:`flashsample_jax.sample`, Returns).
    logprob: ``log softmax(t)[token]`` before truncation.
    logprob_truncated: the same after top-k/top-p/min-p (renormalized).
    logsumexp: ``logsumexp(t)`` of the row, before truncation.
    top_ids: int32 ``[B, N]``: the N most likely ids before truncation, most
      likely first, ties by lower id; ``-1`` past the allowed ids. None
      unless ``top_logprobs=N``.
    top_logprobs: f32 ``[B, N]``: their log-probabilities (``-inf`` where
      ``top_ids`` is ``-1``). None unless ``top_logprobs=N``.
    logprob_raw: ``log_softmax(raw)[token]``, ``raw`` the model's logits
      soft-capped, before bias, penalties, the mask and the temperature
      (vLLM's "raw_logprobs"). None unless ``return_raw_logprobs=True``.
    entropy: f32 ``[B]`` (per row, not per sample): the entropy of
      ``softmax(t)`` before truncation. None unless ``return_entropy=True``.
    entropy_truncated: f32 ``[B]``: the same over the kept set
      (renormalized). None unless ``return_entropy=True``.
    kept_ids: int32 ``[B, N]``: the row's kept set (the ids truncation keeps;
      with no rule on, every id of finite ``t``), most likely first, ties by
      lower id, ``-1`` past its end. None unless ``return_kept=N``.
    kept_count: int32 ``[B]``: the kept set's true size; larger than N
      means ``kept_ids`` lists only its N most likely (overflow, never a
      silent cut). None unless ``return_kept=N``.
  """

  tokens: Any
  logprob: Any
  logprob_truncated: Any
  logsumexp: Any
  top_ids: Any = None
  top_logprobs: Any = None
  logprob_raw: Any = None
  entropy: Any = None
  entropy_truncated: Any = None
  kept_ids: Any = None
  kept_count: Any = None

  def first_sample(self) -> "SampleOutput":
    """The output of sample 0 (``[S, B]`` fields to ``[B]``; per-row fields
    as they are)."""
    first = lambda a: None if a is None else a[0]
    return self._replace(tokens=first(self.tokens), logprob=first(self.logprob),
                         logprob_truncated=first(self.logprob_truncated),
                         logsumexp=first(self.logsumexp),
                         logprob_raw=first(self.logprob_raw))
