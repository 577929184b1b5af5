"""``SamplingParams``: the per-request sampling controls as one pytree.

A decode loop carries the controls of its requests from step to step; as a
frozen pytree (arrays as leaves, the options that shape the program as its
static part) they pass through ``jax.jit``, ``lax.scan`` and ``shard_map``
like any array, and :func:`flashsample_jax.sample` (or
:func:`flashsample_jax.sample_logits`) takes them in place of the keywords.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from flashsample_jax import controls, problem

__all__ = ["SamplingParams", "CONTROL_NAMES", "STATIC_NAMES"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """The sampling controls of :func:`flashsample_jax.sample`, as one value.

  Every field means what the keyword of the same name means there (shapes:
  a scalar applies to every row, ``[B]`` gives one value per row; ``None``
  is off). ``fs.sample(hidden, weight, key, params)`` equals
  ``fs.sample(hidden, weight, key, **params.as_kwargs())``.

  Leaves (arrays or numbers; change them per step without retracing):
    temperature: float or ``[B]``; 0 = greedy.
    top_k: int or int ``[B]``; 0 = off.
    top_p: float or ``[B]`` in (0, 1]; 1 = off.
    min_p: float or ``[B]`` in [0, 1]; 0 = off.
    logit_bias: f32 ``[V]``.
    allowed_mask: uint32 ``[B, ceil(V / 32)]`` bitmask.
    softcap: float scalar.
    repetition_penalty, presence_penalty, frequency_penalty: float or ``[B]``.
    prompt_ids, output_ids: int32 ``[B, P]`` / ``[B, O]``, padded with -1.

  Static (part of the tree structure; a change compiles a new program):
    num_samples: int or None.
    return_logprobs: bool.
    top_logprobs: int N (0 = off).
    truncation_order: ``"hf"`` or ``"vllm"``.
    return_entropy, return_raw_logprobs: bool.
    return_kept: int N (0 = off).
    top_logprobs_mode: ``"processed"`` or ``"raw"``.
  """

  temperature: Any = 1.0
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
  num_samples: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  return_logprobs: bool = dataclasses.field(default=False, metadata=dict(static=True))
  top_logprobs: int = dataclasses.field(default=0, metadata=dict(static=True))
  truncation_order: str = dataclasses.field(default="hf", metadata=dict(static=True))
  return_entropy: bool = dataclasses.field(default=False, metadata=dict(static=True))
  return_raw_logprobs: bool = dataclasses.field(default=False, metadata=dict(static=True))
  return_kept: int = dataclasses.field(default=0, metadata=dict(static=True))
  top_logprobs_mode: str = dataclasses.field(default="processed", metadata=dict(static=True))

  def as_kwargs(self) -> dict[str, Any]:
    """The keyword arguments of :func:`flashsample_jax.sample` these are."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def replace(self, **changes) -> "SamplingParams":
    """A copy with ``changes`` (field names as keywords)."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_generation_config(cls, config, *, batch: int | None = None,
                             **options) -> "SamplingParams":
    """The params of a Hugging Face-style generation config.

    Args:
      config: a mapping (e.g. ``generation_config.json`` loaded as a dict) or
        an object with attributes (``transformers.GenerationConfig``). Read:
        ``do_sample`` (False: greedy, temperature 0), ``temperature``,
        ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, and the
        OpenAI / vLLM names ``presence_penalty`` and ``frequency_penalty``.
        Keys that do not change a sampled token (``eos_token_id``,
        ``max_new_tokens``, ...) are ignored. A ``None`` value is off, and
        so is a key a mapping does not have: a dict is read as written, as
        vLLM reads ``generation_config.json`` (no ``do_sample``: sampling;
        no ``top_k``: no top-k), where ``transformers.GenerationConfig``
        fills in its own defaults (``do_sample=False``, ``top_k=50``). An
        object is read with the values it holds, its defaults included. The
        read settings are checked as :func:`flashsample_jax.sample` checks
        them, here, so a bad config fails where it is read.
      batch: broadcast every read scalar to a ``[batch]`` array, so that rows
        can be edited one by one and the params keep one shape as a
        ``lax.scan`` carry.
      **options: further fields (e.g. ``return_logprobs=True``,
        ``truncation_order="vllm"``, ``output_ids``).

    Raises:
      ValueError: a setting this package does not sample with at a value
        that changes the tokens (``typical_p``, ``epsilon_cutoff``,
        ``eta_cutoff``, ``num_beams > 1``, ``no_repeat_ngram_size``, ...);
        one that depends on the decoding step (``min_new_tokens``,
        ``min_length``, ``forced_bos_token_id``, ``forced_eos_token_id``,
        ``exponential_decay_length_penalty``: the caller applies those per
        step with ``allowed_mask`` or ``logit_bias``); a read setting out of
        range; or ``batch`` < 1.
      TypeError: ``config`` is neither a mapping nor an object, a setting's
        value has the wrong type (``do_sample`` not a bool, ``top_k`` not an
        int, a number given as a string), or an ``options`` name is not a
        field.
    """
    get = _reader(config)
    _refuse_unsupported(get)
    fields = _read_settings(get)
    if batch is not None and (isinstance(batch, bool)
                              or not isinstance(batch, (int, np.integer)) or batch < 1):
      raise ValueError(f"batch={batch!r} must be a Python int >= 1")
    _check_settings(fields, batch)
    if batch is not None:
      fields = {k: _broadcast(k, v, int(batch)) for k, v in fields.items()}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
      raise TypeError(f"unknown SamplingParams fields {unknown}; fields: {sorted(names)}")
    return cls(**{**fields, **options})


# The fields of SamplingParams, by kind (api.sample checks that keywords
# and params are not mixed).
STATIC_NAMES = ("num_samples", "return_logprobs", "top_logprobs", "truncation_order",
                "return_entropy", "return_raw_logprobs", "return_kept", "top_logprobs_mode")
CONTROL_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))

# What from_generation_config reads; the penalties other than repetition's
# are vLLM's / OpenAI's names (Hugging Face has none).
_READ = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
         "presence_penalty", "frequency_penalty")
# Ignored by Hugging Face when do_sample is False.
_SAMPLING_ONLY = ("top_k", "top_p", "min_p")
_INTS = ("top_k",)
# Settings that change the sampled tokens, and the values at which they do
# not (Hugging Face's defaults).
_UNSUPPORTED = {
    "typical_p": lambda v: v >= 1.0,
    "epsilon_cutoff": lambda v: v == 0.0,
    "eta_cutoff": lambda v: v == 0.0,
    "num_beams": lambda v: v == 1,
    "num_beam_groups": lambda v: v == 1,
    "penalty_alpha": lambda v: False,
    "no_repeat_ngram_size": lambda v: v == 0,
    "encoder_repetition_penalty": lambda v: v == 1.0,
    "encoder_no_repeat_ngram_size": lambda v: v == 0,
    "bad_words_ids": lambda v: not v,
    "sequence_bias": lambda v: not v,
    "force_words_ids": lambda v: not v,
    "suppress_tokens": lambda v: not v,
    "begin_suppress_tokens": lambda v: not v,
    "top_h": lambda v: False,
    "watermarking_config": lambda v: False,
    "guidance_scale": lambda v: v == 1.0,
}
# Settings that change the tokens at some decoding steps only (Hugging Face
# applies them from the generated length), and the values at which they are
# off. A sampler call has no step; the caller applies them per step.
_STEP_DEPENDENT = {
    "min_length": lambda v: v == 0,
    "min_new_tokens": lambda v: v == 0,
    "forced_bos_token_id": lambda v: False,
    "forced_eos_token_id": lambda v: False,
    "exponential_decay_length_penalty": lambda v: False,
}


def _refuse_unsupported(get) -> None:
  """A ValueError for each read setting that changes the tokens in a way this
  package does not sample with; a TypeError (naming it) for a value that is
  not a number, bool or list as the config's schema has it."""
  for table, why in ((_UNSUPPORTED, "changes sampling in a way flashsample_jax does not "
                      f"implement (supported: {', '.join(_READ)}); remove it or set it "
                      "to its default"),
                     (_STEP_DEPENDENT, "depends on the decoding step, which a sampler call "
                      "does not know; apply it per step with allowed_mask or logit_bias "
                      "and remove it from the config")):
    for name, off in table.items():
      value = get(name)
      if value is None:
        continue
      if isinstance(value, (str, bytes)):
        raise TypeError(f"generation config {name}={value!r} must be a number or a "
                        f"list, not a string")
      if not off(value):
        raise ValueError(f"generation config {name}={value!r} {why}")


def _read_settings(get) -> dict:
  """The settings of :data:`_READ` that are set, as ``SamplingParams``
  fields: greedy (temperature 0, truncation dropped) when ``do_sample`` is
  False, as Hugging Face samples; ``top_k`` 0 is off."""
  do_sample = get("do_sample")
  if do_sample is not None and not isinstance(do_sample, (bool, np.bool_)):
    raise TypeError(f"generation config do_sample={do_sample!r} must be a bool")
  fields = {name: get(name) for name in _READ if name != "do_sample"}
  fields = {k: v for k, v in fields.items() if v is not None}
  if do_sample is not None and not do_sample:
    # Greedy: Hugging Face ignores every sampling setting then.
    fields = {k: v for k, v in fields.items() if k not in _SAMPLING_ONLY}
    fields["temperature"] = 0.0
  elif isinstance(fields.get("top_k"), (int, np.integer)) and fields["top_k"] == 0:
    del fields["top_k"]
  return fields


def _reader(config):
  """``name -> value or None`` over a mapping or an object's attributes."""
  if isinstance(config, Mapping):
    return config.get
  if config is None or isinstance(config, (str, bytes, int, float, list, tuple)):
    raise TypeError(f"config must be a mapping or a generation config object, "
                    f"got {type(config).__name__}")
  return lambda name: getattr(config, name, None)


def _check_settings(fields: dict, batch: int | None) -> None:
  """The read settings checked as :func:`flashsample_jax.sample` checks
  them: where the config is read, and before :func:`_broadcast` casts them
  to int32 / float32 (a temperature of 1e-50 would become 0, greedy; a
  ``top_k`` of 2.9, 2). Without ``batch``, a config's ``[B]`` arrays set B."""
  if batch is None:
    lengths = {np.shape(v)[0] for v in fields.values() if np.ndim(v) == 1}
    batch = lengths.pop() if len(lengths) == 1 else 1
  if fields.get("temperature") is not None:
    problem.temperature_rows(fields["temperature"], int(batch))
  controls.prepare_controls(batch=int(batch), vocab_size=1, rows=int(batch),
                            **{k: v for k, v in fields.items() if k != "temperature"})


def _broadcast(name: str, value, batch: int):
  """A scalar setting as a ``[batch]`` array (its own dtype: int32 for top_k)."""
  dtype = jnp.int32 if name in _INTS else jnp.float32
  return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))
