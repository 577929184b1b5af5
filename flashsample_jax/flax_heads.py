"""Sampling straight from a Flax LM head, without writing the logits.

A Flax model ends in one of three heads; each maps to a weight layout of
:func:`flashsample_jax.sample` that reads the stored parameter as it is (no
transpose, no cast, no copy of ``W`` in device memory):

* ``nnx.Linear(D, V, use_bias=False)``: ``kernel [D, V]``, layout ``"dv"``;
* ``nnx.Embed(V, D)`` as a tied head (``embed.attend``): ``embedding [V, D]``,
  layout ``"vd"``;
* a Linen ``nn.Dense`` head's params ``{"kernel": [D, V]}``: ``"dv"``;
* a Linen ``nn.Embed``'s params ``{"embedding": [V, D]}``: ``"vd"``.

Example::

  from flax import nnx
  from flashsample_jax import flax_heads

  head = nnx.Linear(2048, 151936, use_bias=False, param_dtype=jnp.bfloat16,
                    rngs=nnx.Rngs(0))
  tokens = flax_heads.sample_from_head(head, hidden, key, temperature=0.7)
  # == jax.random.categorical(key, flax_heads.logits(head, hidden) / 0.7)
  #    (f32 logits), without writing the [B, V] logits.

What differs from calling the module:

* The product is ``hidden`` cast to the parameter's dtype times the stored
  parameter, accumulated in f32 (the package's contract, DESIGN.md section 1).
  The module's ``dtype``/``precision``/``promote_dtype`` are not applied:
  casting ``W`` to another dtype would write a converted copy of the head to
  device memory, which is what this package exists to avoid. Store the head in
  the dtype you want it read in (``param_dtype=jnp.bfloat16``).
* A head's bias ``[V]`` becomes ``sample()``'s ``logit_bias`` (added in f32 to
  the f32 logits); a ``logit_bias`` passed by the caller is added to it first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flashsample_jax import api


def _array(x) -> jax.Array:
  """The array inside an nnx ``Variable``, a boxed Linen param, or ``x``."""
  if isinstance(x, nnx.Variable):
    return x[...]
  if hasattr(x, "unbox"):  # flax.linen Partitioned / LogicallyPartitioned
    return x.unbox()
  if hasattr(x, "value") and not hasattr(x, "shape"):  # nnx VariableState
    return x.value
  return x


def head_bias(head) -> jax.Array | None:
  """The head's bias ``[V]`` (``nnx.Linear(use_bias=True)``, Linen ``bias``), or None."""
  if isinstance(head, nnx.Linear):
    return None if head.bias is None else _array(head.bias)
  if isinstance(head, Mapping):
    params = head["params"] if set(head) == {"params"} else head
    bias = params.get("bias")
    return None if bias is None else _array(bias)
  return None


def head_weight(head) -> tuple[jax.Array, str]:
  """The LM head's weight as stored, and its ``weight_layout``.

  Args:
    head: an ``nnx.Linear`` (kernel ``[D, V]``, layout ``"dv"``), an
      ``nnx.Embed`` used as a tied head (embedding ``[V, D]``, ``"vd"``), or a
      Linen parameter dict ``{"kernel": [D, V]}`` / ``{"embedding": [V, D]}``
      (also wrapped as ``{"params": {...}}``; boxed values are unboxed).

  Returns:
    ``(weight, weight_layout)``, ``weight`` being the stored array itself.

  Raises:
    TypeError: ``head`` is none of the above.
    ValueError: a parameter dict has both or neither of ``kernel`` and
      ``embedding``.
  """
  if isinstance(head, nnx.Linear):
    return _array(head.kernel), "dv"
  if isinstance(head, nnx.Embed):
    return _array(head.embedding), "vd"
  if isinstance(head, Mapping):
    params = head
    if set(params) == {"params"}:
      params = params["params"]
    has_kernel, has_embedding = "kernel" in params, "embedding" in params
    if has_kernel == has_embedding:
      raise ValueError(
          "a Linen head's params must hold exactly one of 'kernel' [D, V] "
          f"(nn.Dense) and 'embedding' [V, D] (nn.Embed); got keys {sorted(params)}")
    if has_kernel:
      return _array(params["kernel"]), "dv"
    return _array(params["embedding"]), "vd"
  raise TypeError(
      "head must be an nnx.Linear, an nnx.Embed or a Linen parameter dict "
      f"({{'kernel': ...}} or {{'embedding': ...}}), got {type(head).__name__}")


def _flatten_rows(hidden, key, kwargs: dict[str, Any]):
  """Reshapes ``hidden [..., D]`` and its per-row arguments to ``[B, ...]``.

  ``jax.random.categorical`` on ``[..., V]`` logits draws the noise of element
  ``(i, j, v)`` at linear index ``(i * n_j + j) * V + v``, the same as on the
  flattened ``[B, V]`` logits, so flattening keeps the tokens exact.
  """
  lead = hidden.shape[:-1]
  if hidden.ndim <= 2:
    return hidden, key, kwargs, None
  hidden = hidden.reshape(-1, hidden.shape[-1])
  if hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape == lead:
      key = key.reshape(-1)
  elif hasattr(key, "shape") and key.shape == (*lead, 2):  # raw per-row key data
    key = key.reshape(-1, 2)
  t = kwargs.get("temperature")
  if hasattr(t, "shape") and t.shape == lead:
    kwargs = {**kwargs, "temperature": t.reshape(-1)}
  return hidden, key, kwargs, lead


def sample_from_head(head, hidden, key, **kwargs) -> jax.Array:
  """Samples from ``softmax(head(hidden) / T)`` without the logits.

  Equals ``jax.random.categorical(key, logits / T)`` for the f32 logits of
  ``hidden`` (cast to the head's dtype) against the stored head parameter.

  Args:
    head: see :func:`head_weight`.
    hidden: ``[B, D]`` or ``[..., D]`` hidden states; leading dimensions are
      flattened (exactly, see :func:`_flatten_rows`) and restored on the
      tokens.
    key: a typed key; a scalar key, or one key per row (shape ``[B]`` or
      ``hidden.shape[:-1]``).
    **kwargs: passed to :func:`flashsample_jax.sample` (``temperature``,
      ``vocab_size``, ``backend``, ...). ``temperature`` may also have shape
      ``hidden.shape[:-1]``. ``weight_layout`` comes from the head.

  Returns:
    int32 token ids of shape ``hidden.shape[:-1]``.

  Raises:
    TypeError: ``weight_layout`` was passed, or ``head`` is not a head.
    Anything :func:`flashsample_jax.sample` raises for bad arguments.
  """
  if "weight_layout" in kwargs:
    raise TypeError(
        "weight_layout is set by the head (nnx.Linear/kernel: 'dv', "
        "nnx.Embed/embedding: 'vd'); do not pass it")
  weight, layout = head_weight(head)
  if not hasattr(hidden, "ndim") or hidden.ndim < 2:
    raise ValueError(
        f"hidden must have shape [B, D] or [..., D], got "
        f"{getattr(hidden, 'shape', type(hidden).__name__)}")
  hidden2, key, kwargs, lead = _flatten_rows(hidden, key, kwargs)
  bias = head_bias(head)
  if bias is not None:
    extra = kwargs.get("logit_bias")
    bias = bias.astype(jnp.float32)
    kwargs = {**kwargs, "logit_bias": bias if extra is None else bias + extra}
  tokens = api.sample(hidden2, weight, key, weight_layout=layout, **kwargs)
  return tokens if lead is None else tokens.reshape(lead)


def sample_from_linear(head: nnx.Linear, hidden, key, **kwargs) -> jax.Array:
  """:func:`sample_from_head` for an ``nnx.Linear`` head (kernel ``[D, V]``)."""
  if not isinstance(head, nnx.Linear):
    raise TypeError(f"head must be an nnx.Linear, got {type(head).__name__}")
  return sample_from_head(head, hidden, key, **kwargs)


def sample_from_embed(embed: nnx.Embed, hidden, key, **kwargs) -> jax.Array:
  """:func:`sample_from_head` for tied embeddings: ``embed.attend`` logits."""
  if not isinstance(embed, nnx.Embed):
    raise TypeError(f"embed must be an nnx.Embed, got {type(embed).__name__}")
  return sample_from_head(embed, hidden, key, **kwargs)


def sample_from_params(params: Mapping, hidden, key, **kwargs) -> jax.Array:
  """:func:`sample_from_head` for a Linen head's parameter dict."""
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a Linen parameter dict, got {type(params).__name__}")
  return sample_from_head(params, hidden, key, **kwargs)


def logits(head, hidden) -> jax.Array:
  """The f32 logits ``[..., V]`` that :func:`sample_from_head` samples from.

  Materializes them: for checking and for comparison baselines only.
  """
  weight, layout = head_weight(head)
  contract = 1 if layout == "vd" else 0
  l = jax.lax.dot_general(
      jnp.asarray(hidden).astype(weight.dtype), weight,
      (((hidden.ndim - 1,), (contract,)), ((), ())),
      preferred_element_type=jnp.float32)
  bias = head_bias(head)
  return l if bias is None else l + bias.astype(jnp.float32)
