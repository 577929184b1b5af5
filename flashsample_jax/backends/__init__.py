"""The backend registry: one small protocol, an ordered list of backends.

A backend turns a checked :class:`~flashsample_jax.problem.Problem` into
per-row results for the shared stage 2 (:mod:`flashsample_jax.stage2`):

* :meth:`SamplerBackend.check` raises ``NotImplementedError`` (with the
  reason) where it cannot run a call here;
* :meth:`SamplerBackend.prefers` says whether it is the one to pick for the
  call among those that can run it: ``backend="auto"`` takes the first of
  :data:`BACKENDS` that can run the call and prefers it, else the first
  that can run it (the measured routes are in each adapter);
* :meth:`SamplerBackend.candidates`: plain sampling, the best ``(score,
  id)`` of each row over the weight's rows;
* :meth:`SamplerBackend.controls_state`: sampling controls, a
  :class:`~pallas_kernels.state.ControlsState` per row;
* :meth:`SamplerBackend.samples_as_rows`: an optional fast path (draw
  several samples as rows of one plain pass);
* :meth:`SamplerBackend.fuses_penalties`: whether ``controls_state``
  applies the penalties itself (else the shared route scores the history
  ids from their weight rows, :func:`flashsample_jax.stage2.history_state`).

A new backend is one adapter module in this package and one entry in
``_REGISTRY``; the API names no backend, and the shared test suite and the
benchmarks iterate over :data:`BACKENDS`.
"""

from __future__ import annotations

import abc
import importlib
from typing import ClassVar, Literal, get_args

from flashsample_jax.controls import Controls
from flashsample_jax.problem import Problem
from pallas_kernels.state import ControlsState

__all__ = ["Backend", "BACKENDS", "SamplerBackend", "get", "resolve", "check_name",
           "rows_per_pass"]

# Every backend name, in the order ``backend="auto"`` tries them.
Backend = Literal["mosaic", "triton", "dense", "xla"]
BACKENDS: tuple[str, ...] = get_args(Backend)

# name -> "module:class" of its adapter (imported on first use, so a machine
# without a backend's toolchain never imports it).
_REGISTRY = {
    "mosaic": "flashsample_jax.backends.mosaic:MosaicBackend",
    "triton": "flashsample_jax.backends.triton:TritonBackend",
    "dense": "flashsample_jax.backends.xla:DenseBackend",
    "xla": "flashsample_jax.backends.xla:XlaBackend",
}
assert tuple(_REGISTRY) == BACKENDS


class SamplerBackend(abc.ABC):
  """What a backend implements. Instances are hashable (frozen dataclasses):
  they are static arguments of the jitted sampler."""

  name: ClassVar[str]

  @abc.abstractmethod
  def check(self, p: Problem, c: Controls) -> None:
    """Raises ``NotImplementedError`` (saying why) if this backend cannot run
    ``p`` with controls ``c`` on this device."""

  @abc.abstractmethod
  def candidates(self, p: Problem, *, vocab_offset=0):
    """Best ``(score f32 [B], global id int32 [B])`` over ``p.weight``'s rows.

    Sampled rows score ``l / T + gumbel``, greedy rows ``l``, ``-inf`` for
    ids at or above ``p.vocab_size``; the best by the tie rule
    (:mod:`pallas_kernels.rules`). ``vocab_offset``: the global id of the
    weight's first row (an int, or a traced int32 inside ``shard_map``).
    """

  @abc.abstractmethod
  def controls_state(self, p: Problem, c: Controls, *, vocab_offset=0) -> ControlsState:
    """The :class:`~pallas_kernels.state.ControlsState` of ``p``'s rows over
    ``p.weight``'s rows, with ``c``'s transforms applied and with candidate
    lists when ``c`` truncates."""

  def prefers(self, p: Problem, c: Controls) -> bool:
    """Whether ``auto`` should pick this backend for a call it can run
    (False where another backend measured faster)."""
    del p, c
    return True

  def fuses_penalties(self, p: Problem, c: Controls) -> bool:
    """Whether :meth:`controls_state` applies ``c``'s penalties per element
    (asked only when ``c.penalizes``). If False, the pass runs without the
    history ids (:func:`flashsample_jax.stage2.pass_controls`) and stage 2
    scores them from their own weight rows."""
    del p, c
    return False

  def exact_top(self, p: Problem, c: Controls):
    """None, or a function ``flags bool [B] -> (vals, ids)`` that returns
    the exact ``c.top_logprobs`` largest tempered logits of the flagged rows
    (:func:`flashsample_jax.stage2.finish`'s ``exact_top``) by work skipped
    inside kernels when no row is flagged. None: stage 2 puts its exact
    path behind an XLA conditional. Asked only outside ``shard_map``'s
    vocabulary sharding."""
    del p, c
    return None

  def rl_outputs(self) -> bool:
    """Whether :meth:`controls_state` fills the state fields of the RL
    outputs (entropy terms, raw log-sum-exp, finite counts, the given ids'
    ``t`` for :func:`flashsample_jax.score_tokens`:
    :attr:`~flashsample_jax.controls.Controls.rl_outputs`). Where not,
    :func:`resolve` refuses such calls (``auto`` then takes a backend that
    does)."""
    return False

  def raw_top_lists(self) -> bool:
    """Whether :meth:`controls_state` keeps lists of the raw logits
    (``raw_vals``/``raw_ids``/``raw_bound``: ``top_logprobs_mode="raw"``)."""
    return False

  def samples_as_rows(self, p: Problem, c: Controls) -> bool:
    """Whether to draw ``c.samples`` samples as rows of one plain pass
    (:func:`flashsample_jax.stage2.samples_as_rows`); asked only when
    ``c.samples_only``."""
    del p, c
    return False


def rows_per_pass(backend: SamplerBackend, p: Problem, c: Controls) -> int:
  """Rows one pass of ``backend``'s kernel serves for this call: B, or S x B
  when several samples are not drawn as rows of one plain pass."""
  as_rows = c.samples_only and backend.samples_as_rows(p, c)
  return p.batch * (1 if as_rows else c.samples)


def _check(impl: SamplerBackend, p: Problem, c: Controls) -> None:
  """``impl.check`` and the checks every backend shares."""
  impl.check(p, c)
  if c.rl_outputs and not impl.rl_outputs():
    raise NotImplementedError(
        f"the {impl.name} backend does not yet compute entropies, raw "
        "log-probabilities, kept sets or scores (return_entropy, "
        "return_raw_logprobs, return_kept, score_tokens); the xla and dense "
        "backends do")
  if c.raw_top and not impl.raw_top_lists():
    raise NotImplementedError(
        f"the {impl.name} backend does not yet list the raw logits "
        "(top_logprobs_mode='raw'); the xla and dense backends do")


def _load(name: str) -> type[SamplerBackend]:
  module, cls = _REGISTRY[name].split(":")
  return getattr(importlib.import_module(module), cls)


def get(name: str) -> SamplerBackend:
  """The default instance of backend ``name`` (one of :data:`BACKENDS`)."""
  check_name(name)
  if name == "auto":
    raise ValueError("get() needs a backend name, not 'auto'")
  return _load(name)()


def for_logits() -> SamplerBackend:
  """The backend that samples logits the caller already has (layout
  "logits", :func:`flashsample_jax.sample_logits`): the dense route, the
  streaming backend over one chunk (the logits are in memory already, so
  chunks would only add merges); the kernels compute logits, not read them."""
  return get("dense")


def check_name(backend) -> None:
  """ValueError unless ``backend`` is ``"auto"``, a name of
  :data:`BACKENDS` or a :class:`SamplerBackend` instance."""
  if isinstance(backend, SamplerBackend):
    return
  if not isinstance(backend, str) or backend not in ("auto", *BACKENDS):
    raise ValueError(f"{backend=} must be 'auto', one of {BACKENDS} or a "
                     "flashsample_jax.backends.SamplerBackend")


def resolve(backend, p: Problem, c: Controls) -> SamplerBackend:
  """The backend that will run ``p``: ``backend`` itself (a name or an
  instance; ``NotImplementedError`` if it cannot), or ``"auto"``'s pick:
  the first of :data:`BACKENDS` that can run the call and prefers it, else
  the first that can run it."""
  check_name(backend)
  if backend != "auto":
    impl = backend if isinstance(backend, SamplerBackend) else get(backend)
    _check(impl, p, c)
    return impl
  reasons, able = [], []
  for name in BACKENDS:
    impl = get(name)
    try:
      _check(impl, p, c)
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
      continue
    if impl.prefers(p, c):
      return impl
    able.append(impl)
  if able:
    return able[0]
  raise NotImplementedError("no backend can run this call: " + "; ".join(reasons))
