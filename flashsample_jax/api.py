"""Public entry point: :func:`sample`.

The flow of one call: the arguments are checked once
(:func:`flashsample_jax.problem.prepare`,
:func:`flashsample_jax.controls.prepare_controls`), the backend is resolved
from the registry (:mod:`flashsample_jax.backends`), and the jitted
:func:`run` sends the problem through the backend and the shared stage 2
(:mod:`flashsample_jax.stage2`). This module names no backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flashsample_jax import backends, controls as _controls, mesh, problem, stage2
from flashsample_jax.backends import BACKENDS, Backend  # noqa: F401  (re-exported)
from flashsample_jax.params import CONTROL_NAMES, SamplingParams

__all__ = ["sample", "sample_logits", "which_backend", "run", "BACKENDS", "Backend",
           "STATIC_ARGNAMES", "SamplingParams"]

# The options of :func:`sample` that must be static under ``jax.jit``:
# ``jax.jit(fs.sample, static_argnames=fs.STATIC_ARGNAMES)``.
STATIC_ARGNAMES = ("weight_layout", "vocab_size", "backend", "vocab_axis",
                   "batch_axis", "num_samples", "return_logprobs", "top_logprobs",
                   "truncation_order", "return_entropy", "return_raw_logprobs",
                   "return_kept", "top_logprobs_mode")

# The keyword defaults of the controls (SamplingParams' fields): with
# ``params``, every control keyword must still be its default.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def settings(params, given: dict) -> dict:
  """The controls of a call: ``params``' fields, or the keywords ``given``
  (those not in ``given`` hold their defaults).

  Raises:
    TypeError: ``params`` is not a :class:`SamplingParams`, or keywords were
      passed beside it.
  """
  if params is None:
    return given
  if not isinstance(params, SamplingParams):
    raise TypeError(f"params must be a flashsample_jax.SamplingParams or None, got "
                    f"{type(params).__name__} (controls as keywords go after key: "
                    f"sample(hidden, weight, key, temperature=...))")
  mixed = [k for k in CONTROL_NAMES if not _is_default(given.get(k, _DEFAULTS[k]), _DEFAULTS[k])]
  if mixed:
    raise TypeError(f"pass the controls either in params or as keywords, not both: "
                    f"got params and {mixed} (params.replace(...) changes a field)")
  return params.as_kwargs()


def _given(arguments: dict) -> dict:
  """The control keywords among a function's ``locals()`` (taken first thing)."""
  return {k: arguments[k] for k in CONTROL_NAMES}


def _is_default(value, default) -> bool:
  """Whether a keyword holds its default: the same Python value (arrays are
  never a default: they have no truth value)."""
  if value is default:
    return True
  return (type(value) is type(default) and isinstance(value, (bool, int, float, str))
          and value == default)


def prepare_call(hidden, weight, key, *, weight_layout, vocab_size, weight_scale,
                 axes: mesh.MeshAxes, controls: dict):
  """The checked ``(Problem, Controls)`` of this call (this shard's part
  inside ``shard_map``); ``controls``: :func:`settings`."""
  controls = dict(controls)
  p = problem.prepare(hidden, weight, key, temperature=controls.pop("temperature"),
                      weight_layout=weight_layout, vocab_size=vocab_size,
                      vocab_shards=axes.vocab_shards(),
                      batch_shard=axes.batch_shard(), weight_scale=weight_scale)
  axes.check_weight(p.weight, p.layout, p.weight_scale)
  c = _controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size,
                                 rows=p.total_rows, **controls)
  return p, c


def which_backend(hidden, weight, key, params=None, *, backend="auto", temperature=1.0,
                  weight_layout="vd", vocab_size=None, weight_scale=None, vocab_axis=None,
                  batch_axis=None, top_k=None, top_p=None, min_p=None, logit_bias=None,
                  allowed_mask=None, softcap=None, repetition_penalty=None,
                  presence_penalty=None, frequency_penalty=None, prompt_ids=None,
                  output_ids=None, num_samples=None, return_logprobs=False,
                  top_logprobs=0, truncation_order="hf", return_entropy=False,
                  return_raw_logprobs=False, return_kept=0,
                  top_logprobs_mode="processed"):
  """The name of the backend :func:`sample` would run these arguments on.

  Args: as :func:`sample` (controls and mesh axes included).

  Returns:
    A name from :data:`BACKENDS`.

  Raises:
    What :func:`sample` raises for these arguments.
  """
  ctl = settings(params, _given(locals()))
  p, c = prepare_call(hidden, weight, key, weight_layout=weight_layout,
                      vocab_size=vocab_size, weight_scale=weight_scale,
                      axes=mesh.MeshAxes.of(vocab_axis, batch_axis), controls=ctl)
  return backends.resolve(backend, p, c).name


@functools.partial(jax.jit, static_argnames=("backend", "axes"))
def run(p: problem.Problem, c: _controls.Controls, *,
        backend: backends.SamplerBackend, axes: mesh.MeshAxes = mesh.MeshAxes()):
  """Samples a checked problem on a resolved backend (what :func:`sample`
  does once its arguments are checked). Inside ``shard_map`` when ``axes``
  name mesh axes; ``p`` is then this shard's part.

  Returns:
    As :func:`sample`.
  """
  offset = axes.vocab_offset(p.weight_rows)
  if not c.active:
    score, token = backend.candidates(p, vocab_offset=offset)
    if axes.vocab:
      score, token = mesh.combine_over_axis(score, token, axes.vocab)
    return token
  if c.samples_only and backend.samples_as_rows(p, c):
    score, token = backend.candidates(stage2.samples_as_rows(p, c.samples),
                                      vocab_offset=offset)
    if axes.vocab:
      score, token = mesh.combine_over_axis(score, token, axes.vocab)
    return token.reshape(c.samples, p.batch)
  # Where every row truncates, the pass draws no noise (Controls.for_pass).
  st = stage2.per_sample(pass_state(p, c.for_pass(), backend, offset), c.samples)
  exact_top = None if axes.vocab else backend.exact_top(p, c)
  tokens, out, _ = stage2.finish(p, c, st, axis=axes.vocab, exact_top=exact_top)
  if out is not None:
    return out if c.num_samples is not None else out.first_sample()
  return tokens if c.num_samples is not None else tokens[0]


def pass_state(p: problem.Problem, c: _controls.Controls,
               backend: backends.SamplerBackend, offset):
  """The :class:`~pallas_kernels.state.ControlsState` of one pass of
  ``backend`` over this shard's rows (``offset``: their first global id)
  with controls ``c``, the penalized history ids included."""
  if c.penalizes and not backend.fuses_penalties(p, c):
    # The fused pass skips the history ids (their logits change); their
    # penalized scores come from their own weight rows, then one merge.
    hist = stage2.history(c)
    return stage2.state_combine(c, stage2.candidate_count(p, c))(
        backend.controls_state(p, stage2.pass_controls(c, hist, p.vocab_size),
                               vocab_offset=offset),
        stage2.history_state(p, c, hist, vocab_offset=offset))
  return backend.controls_state(p, c, vocab_offset=offset)


def sample(hidden, weight, key, params=None, *, temperature=1.0, weight_layout="vd",
           vocab_size=None, weight_scale=None, backend="auto", vocab_axis=None,
           batch_axis=None,
           top_k=None, top_p=None, min_p=None, logit_bias=None,
           allowed_mask=None, softcap=None, repetition_penalty=None,
           presence_penalty=None, frequency_penalty=None, prompt_ids=None,
           output_ids=None, num_samples=None, return_logprobs=False,
           top_logprobs=0, truncation_order="hf", return_entropy=False,
           return_raw_logprobs=False, return_kept=0, top_logprobs_mode="processed"):
  """Samples one token per row from ``softmax(hidden @ W.T / T)``.

  Never writes the ``[B, V]`` logits to device memory. Returns exactly the
  tokens of :func:`flashsample_jax.reference.sample`, i.e. of
  ``jax.random.categorical(key, logits / T)`` (per-row keys: vmapped), for
  the same key.

  Args:
    hidden: ``[B, D]`` bf16, f16 or f32 hidden states; cast to ``weight``'s
      dtype before the product (to bf16 for a quantized weight, f16 when
      ``hidden`` is f16).
    weight: the LM head, ``[V, D]`` for ``weight_layout="vd"`` (tied
      embeddings, PyTorch checkpoints) or ``[D, V]`` for ``"dv"`` (a Flax
      ``nnx.Linear`` kernel). Never transposed in memory. bf16, f16, f32,
      or quantized: float8_e4m3fn, float8_e5m2 or int8 with ``weight_scale``.
    key: a typed threefry key (``jax.random.key``): a scalar key gives one
      stream for the batch, a ``[B]`` key array one stream per row. Raw
      ``uint32[2]`` / ``uint32[B, 2]`` key data is accepted too.
    params: a :class:`flashsample_jax.SamplingParams` holding the controls
      (``temperature`` and the arguments from ``top_k`` on) instead of the
      keywords; then none of those keywords may be passed.
    temperature: a float or a ``[B]`` array. ``0`` makes that row greedy
      (argmax of the logits, lowest id on ties); rows may mix.
    weight_layout: ``"vd"`` or ``"dv"``, see ``weight``.
    vocab_size: the logical vocabulary when ``weight`` has padding rows;
      ids ``>= vocab_size`` are never returned. Default: all rows. With
      ``vocab_axis``, the GLOBAL vocabulary (default: shards x local rows).
    weight_scale: for a quantized ``weight`` only (and then required): f32
      ``[V]`` (one scale per vocabulary row; with ``vocab_axis``, this
      shard's rows) or a scalar (per tensor). The logits are
      ``f32(hidden.astype(c) @ weight.astype(c).T) * weight_scale`` with f32
      accumulation, ``c`` bf16 (f16 for f16 ``hidden``): 8-bit values
      convert to ``c`` exactly, so the tokens are those of
      ``jax.random.categorical`` on those logits.
    backend: ``"auto"``, one of :data:`BACKENDS`, or a
      :class:`flashsample_jax.backends.SamplerBackend` instance (e.g. a
      ``MosaicBackend(interpret=True)`` for tests on a CPU).
    vocab_axis: inside ``jax.shard_map`` only: the mesh axis name (or tuple
      of names) the vocabulary is sharded over, ``weight`` being this
      shard's contiguous slice (shard ``i`` of ``n`` holds global ids
      ``i * rows ... (i + 1) * rows - 1``). Each shard scores its slice with
      global ids and noise counters, then one all-gather of O(B) bytes over
      the axis combines the candidates (O(B x 128) with truncation controls;
      see :mod:`flashsample_jax.sharding`).
      Every shard returns the same tokens, equal to the unsharded call's.
    batch_axis: inside ``jax.shard_map`` only: the mesh axis name(s) the
      batch is sharded over, ``hidden`` (and per-row keys, a ``[B]``
      temperature) being this shard's rows. A scalar key then keys row ``b``
      by its GLOBAL index (shard index x local rows + ``b``), so tokens do
      not change with the data-parallel degree.
    top_k: int or int ``[B]``: keep the k largest tempered logits (ties at
      the k-th value kept); 0 = off. Exact rules: :mod:`flashsample_jax.controls`.
    top_p: float or ``[B]`` in (0, 1]: nucleus after top-k; 1 = off.
    min_p: float or ``[B]`` in [0, 1]: keep ids with probability >= min_p x
      the row's top probability; 0 = off.
    truncation_order: ``"hf"`` (top-p's mass over what top-k kept: Hugging
      Face's) or ``"vllm"`` (over what top-k and min-p kept: vLLM V1 applies
      min-p first and renormalizes). Differs only with both top-p and min-p.
    logit_bias: f32 ``[vocab_size]`` added to the (soft-capped) logits.
    allowed_mask: uint32/int32 ``[B, ceil(vocab_size / 32)]`` bitmask, bit
      ``v % 32`` of word ``v // 32`` allows id ``v`` (grammar-constrained
      decoding). A row that allows no id returns ``-1`` (see Returns).
    softcap: ``c`` for logit soft-capping ``c * tanh(l / c)`` (Gemma 2).
    repetition_penalty: float or ``[B]`` > 0 (1 = off): the logit ``x`` of
      an id in ``prompt_ids`` or ``output_ids`` becomes ``x / r`` if
      ``x > 0``, else ``x * r`` (vLLM's semantics; after soft-cap and bias,
      before the mask and the temperature).
    presence_penalty: float or ``[B]`` (0 = off): subtracted from the logit
      of every id that occurs in ``output_ids``.
    frequency_penalty: float or ``[B]`` (0 = off): times the number of
      occurrences in ``output_ids``, subtracted from the logit.
    prompt_ids, output_ids: int ``[B, P]`` / ``[B, O]``: each row's prompt
      and generated ids, padded with ``-1`` (ids may repeat). The mosaic
      kernel reads them as a few bits per id beside the allowed mask; the
      other backends skip them in the pass and score them from their own
      weight rows (``B x (P + O)`` rows read on top of it). Concrete ids outside
      ``[-1, vocab_size)`` raise ``ValueError``; traced ones are ignored, as
      the reference ignores them.
    num_samples: S samples per row from one pass over W: tokens ``[S, B]``
      equal to ``jax.random.categorical(key, l, shape=(S, B))``.
    return_logprobs: also return log-probabilities (see Returns).
    top_logprobs: N (a Python int, 0 = off, at most 128): also return each
      row's N most likely ids before truncation and their log-probabilities
      (the OpenAI API's ``top_logprobs``), from the same pass over W.
    return_entropy: also return each row's entropy before and after
      truncation (``entropy``, ``entropy_truncated``; RL monitoring).
    return_raw_logprobs: also return ``logprob_raw``, each token's
      log-probability under the raw logits (soft-capped; before bias,
      penalties, the mask and the temperature).
    top_logprobs_mode: ``"processed"`` (default: the top N of the
      distribution sampled) or ``"raw"`` (of the raw logits, soft-capped,
      before bias, penalties, the mask and the temperature; vLLM's
      "raw_logprobs").
    return_kept: N (a Python int, 0 = off, at most 1024): also return each
      row's kept set, its N most likely ids (``kept_ids``) and its true size
      (``kept_count``), exactly the set the token was drawn from (README,
      "Determinism and RL").

  Returns:
    int32 token ids ``[B]`` (``[S, B]`` with ``num_samples``). With
    ``return_logprobs=True``, ``top_logprobs > 0`` or an RL output
    (``return_entropy``, ``return_raw_logprobs``, ``return_kept``), a
    :class:`flashsample_jax.SampleOutput` ``(tokens, logprob,
    logprob_truncated, logsumexp, top_ids, top_logprobs, logprob_raw,
    entropy, entropy_truncated, kept_ids, kept_count)`` (the fields not
    asked for are None).

    No token possible: with any control (the arguments from ``top_k`` on,
    ``num_samples`` aside), a row with nothing to sample returns ``-1`` on
    every backend and in the reference, whatever emptied it: ``allowed_mask``
    allows no id, every logit is ``-inf`` after soft-cap, ``logit_bias``,
    penalties and the mask, or (sampled rows) truncation keeps no id (e.g.
    ``min_p`` on a row with a ``+inf`` logit). Its ``logprob`` and
    ``logprob_truncated`` are NaN, ``logsumexp`` is ``logsumexp(t)``
    (``-inf`` when every logit is ``-inf``), and ``top_ids`` /
    ``top_logprobs`` are ``-1`` / NaN where every logit is ``-inf``. Plain
    sampling (``temperature``, ``num_samples`` only) returns
    ``jax.random.categorical``'s token, id 0 for a row of ``-inf`` logits
    (only non-finite ``hidden``/``weight`` values or an overflowing product
    make one).

  Raises:
    TypeError: a wrong type or dtype (non-float hidden/weight, a non-key key),
      a traced static option, ``params`` beside control keywords.
    ValueError: mismatched shapes, an unknown backend or layout, a
      ``vocab_size`` out of range, a concrete control out of its range, a
      ``vocab_axis``/``batch_axis`` that is not an axis of the enclosing
      ``shard_map`` (or both naming one axis).
    NotImplementedError: the named backend cannot run these arguments on this
      device (``"auto"`` then picks another).

  Traced controls cannot be range-checked when the call is traced; while
  traced checks are on (:func:`flashsample_jax.traced_checks`) each carries
  a ``jax.experimental.checkify`` check instead, a no-op unless the call is
  wrapped in ``checkify.checkify`` (README, "Invalid values").
  """
  axes = mesh.MeshAxes.of(vocab_axis, batch_axis)
  ctl = settings(params, _given(locals()))
  p, c = prepare_call(hidden, weight, key, weight_layout=weight_layout,
                      vocab_size=vocab_size, weight_scale=weight_scale, axes=axes,
                      controls=ctl)
  impl = backends.resolve(backend, p, c)
  if p.batch == 0:
    return empty_result(c)
  return run(p, c, backend=impl, axes=axes)


def sample_logits(logits, key, params=None, *, temperature=1.0, vocab_size=None,
                  top_k=None, top_p=None, min_p=None, logit_bias=None,
                  allowed_mask=None, softcap=None, repetition_penalty=None,
                  presence_penalty=None, frequency_penalty=None, prompt_ids=None,
                  output_ids=None, num_samples=None, return_logprobs=False,
                  top_logprobs=0, truncation_order="hf", return_entropy=False,
                  return_raw_logprobs=False, return_kept=0,
                  top_logprobs_mode="processed"):
  """:func:`sample` for logits that are already materialized.

  The same controls, the same exact semantics and the same outputs as
  :func:`sample` with ``hidden @ weight.T`` replaced by ``logits`` (cast to
  f32): the tokens equal ``jax.random.categorical(key, kept / T)``
  (:func:`flashsample_jax.reference.sample_logits`), and ``-1`` where a
  row has nothing to sample with any control or output asked for (as
  :func:`sample`'s Returns say; plain sampling of a row of ``-inf`` logits
  returns ``jax.random.categorical``'s id 0, as the reference does). The
  package's stage 2 runs over the logits as
  one chunk (the ``dense`` route), so one sampler serves fused and
  materialized logits alike.

  Args:
    logits: bf16, f16 or f32 ``[B, V]``.
    key, params, temperature and the controls: as :func:`sample`.
    vocab_size: the logical vocabulary when ``logits`` has padding columns
      (ids ``>= vocab_size`` are never returned). Default: ``V``.

  Returns:
    As :func:`sample`.

  Raises:
    As :func:`sample`, naming ``logits``.
  """
  ctl = dict(settings(params, _given(locals())))
  p = problem.prepare_logits(logits, key, temperature=ctl.pop("temperature"),
                             vocab_size=vocab_size)
  c = _controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size,
                                 rows=p.weight_rows, **ctl)
  if p.batch == 0:
    return empty_result(c)
  return run(p, c, backend=backends.for_logits())


def empty_result(c: _controls.Controls):
  """What :func:`sample` returns for a batch of 0 rows."""
  shape = (0,) if c.num_samples is None else (c.num_samples, 0)
  tokens = jnp.zeros(shape, jnp.int32)
  if c.returns_output:
    empty = jnp.zeros(shape, jnp.float32) if c.return_logprobs else None
    out = _controls.SampleOutput(tokens, empty, empty, empty)
    if c.top_logprobs:
      out = out._replace(top_ids=jnp.zeros((0, c.top_logprobs), jnp.int32),
                         top_logprobs=jnp.zeros((0, c.top_logprobs), jnp.float32))
    if c.return_raw_logprobs:
      out = out._replace(logprob_raw=jnp.zeros(shape, jnp.float32))
    if c.return_entropy:
      out = out._replace(entropy=jnp.zeros((0,), jnp.float32),
                         entropy_truncated=jnp.zeros((0,), jnp.float32))
    if c.return_kept:
      out = out._replace(kept_ids=jnp.zeros((0, c.return_kept), jnp.int32),
                         kept_count=jnp.zeros((0,), jnp.int32))
    return out
  return tokens
