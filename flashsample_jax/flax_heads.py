"""Sampling straight from a Flax LM head, without writing the logits.

Needs Flax: ``pip install "flashsample-jax[flax]"`` (the ``flax`` extra).

A Flax model ends in one of these heads; each maps to a weight layout of
:func:`flashsample_jax.sample` that reads the stored parameter as it is (no
transpose, no cast, no copy of ``W`` in device memory):

* ``nnx.Linear(D, V)``: ``kernel [D, V]``, layout ``"dv"`` (``bias [V]``
  if it has one);
* ``nnx.Embed(V, D)`` as a tied head (``embed.attend``): ``embedding [V, D]``,
  layout ``"vd"``;
* a Linen ``nn.Dense`` head's params ``{"kernel": [D, V]}`` (and ``"bias"``):
  ``"dv"``;
* a Linen ``nn.Embed``'s params ``{"embedding": [V, D]}``: ``"vd"``.

Only heads whose logits are exactly ``hidden @ kernel (+ bias)`` (or
``hidden @ embedding.T``) are accepted; anything else raises rather than
sample from a different distribution. That is why the module checks are on
the exact class, not ``isinstance``: a subclass such as ``nnx.LoRALinear``
adds ``x @ lora_a @ lora_b`` to the output, which the stored kernel does not
hold. Refused, with what to do instead:

* subclasses of ``nnx.Linear`` / ``nnx.Embed`` (``nnx.LoRALinear``, a
  quantized or custom ``__call__``): merge the extra weights into one
  ``[D, V]`` / ``[V, D]`` array (for LoRA: ``kernel + lora_a @ lora_b``) and
  call :func:`flashsample_jax.sample` on it;
* an ``nnx.Linear`` whose ``dot_general`` or ``promote_dtype`` is not Flax's
  default (quantized or otherwise custom products);
* parameter dicts with keys other than ``kernel`` (+ ``bias``) or
  ``embedding`` (LoRA's ``lora_a``/``lora_b``, quantization scales, ...).

A Linen dict holds no code, so a ``nn.Dense`` built with a custom
``dot_general`` cannot be told apart from a plain one by its params: pass
such a head's params only if its product is the plain one.

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
  parameter, accumulated in f32 (the package's exactness contract, README
  "The exactness guarantee"). The module's ``dtype``, ``precision`` and
  ``preferred_element_type`` are not applied: they change only how the same
  product is rounded, and casting ``W`` to another dtype would write a
  converted copy of the head to device memory, which is what this package
  exists to avoid. Store the head in the dtype you want it read in
  (``param_dtype=jnp.bfloat16``).
* A head's bias ``[V]`` becomes ``sample()``'s ``logit_bias`` (added in f32 to
  the f32 logits); a ``logit_bias`` passed by the caller is added to it first.

Quantized heads in two lines (docs/design.md, "Quantized heads"):
:func:`quantize_head` stores any supported head per-row absmax quantized to
FP8 or int8 (a :class:`QuantizedHead`: half the bytes of bf16 to read per
decode step), and :func:`sample_from_head` samples from it::

  qhead = flax_heads.quantize_head(head, "fp8")
  tokens = flax_heads.sample_from_head(qhead, hidden, key, temperature=0.7)

The quantized head is stored ``[V, D]`` whatever the original's layout
(``layout="vd"``, the Mosaic kernels' fastest 8-bit path), unless asked
otherwise.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flashsample_jax import api, problem
from flashsample_jax.controls import SampleOutput
from flashsample_jax.params import SamplingParams
from flashsample_jax.quantize import quantize_weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedHead:
  """An LM head quantized per vocabulary row (:func:`quantize_head`).

  A pytree (arrays as leaves, the layout static): it passes through
  ``jax.jit`` and can be stored beside a model's parameters.

  Attributes:
    weight: the 8-bit head in ``layout``.
    scale: f32 ``[V]``, one scale per vocabulary row.
    bias: the original head's bias ``[V]`` in f32, or None.
    layout: ``"vd"`` or ``"dv"``.
  """

  weight: jax.Array
  scale: jax.Array
  bias: jax.Array | None
  layout: str = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    # The layout only: the array fields may be any leaves under tree
    # transforms; sample() and logits() check them.
    if self.layout not in problem.WEIGHT_LAYOUTS:
      raise ValueError(f"layout={self.layout!r} must be one of {problem.WEIGHT_LAYOUTS}")


def quantize_head(head, dtype="float8_e4m3fn", layout: str = "vd") -> QuantizedHead:
  """Quantizes a Flax LM head per vocabulary row (absmax) to FP8 or int8.

  Args:
    head: any head :func:`head_weight` accepts (``nnx.Linear``, ``nnx.Embed``,
      a Linen parameter dict).
    dtype: ``"float8_e4m3fn"`` (alias ``"fp8"``), ``"float8_e5m2"`` or
      ``"int8"`` (:func:`flashsample_jax.quantize_weight`).
    layout: how the 8-bit head is stored, ``"vd"`` (``[V, D]``, the default)
      or ``"dv"`` (``[D, V]``), whatever the original's layout (an
      ``nnx.Linear``'s kernel is ``[D, V]``). The quantized head is a new
      array either way; ``"vd"`` is the one the Mosaic kernels read on
      their fastest 8-bit path, their register path up to B = 128
      (docs/performance.md, "Quantized heads at B = 17-128"). The values and scales are
      the same in both.

  Returns:
    A :class:`QuantizedHead` for :func:`sample_from_head` and :func:`logits`.

  Raises:
    ValueError: ``layout`` is not ``"vd"`` or ``"dv"``.
    What :func:`head_weight` and :func:`flashsample_jax.quantize_weight` raise.
  """
  if layout not in problem.WEIGHT_LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {problem.WEIGHT_LAYOUTS}")
  weight, stored, bias = _head_parts(head)
  w8, scale = quantize_weight(weight, dtype, weight_layout=stored)
  if layout != stored:
    # Transposed after quantizing: per-row scales do not depend on the
    # layout, and the copy moves 8-bit values, not the original's.
    w8 = w8.T
  return QuantizedHead(w8, scale, None if bias is None else bias.astype(jnp.float32),
                       layout)


def _array(x) -> jax.Array:
  """The array inside an nnx ``Variable``, a boxed Linen param, or ``x``."""
  if isinstance(x, nnx.Variable):
    return x[...]
  if hasattr(x, "unbox"):  # flax.linen Partitioned / LogicallyPartitioned
    return x.unbox()
  if hasattr(x, "value") and not hasattr(x, "shape"):  # nnx VariableState
    return x.value
  return x


# Flax's own defaults: an nnx.Linear built with anything else computes a
# product other than ``hidden @ kernel`` (e.g. a quantized dot_general).
_LINEAR_DEFAULTS = {
    name: inspect.signature(nnx.Linear.__init__).parameters[name].default
    for name in ("dot_general", "promote_dtype")}
_EMBED_DEFAULTS = {
    "promote_dtype": inspect.signature(nnx.Embed.__init__).parameters["promote_dtype"].default}

_MERGE_HINT = (
    "sample from the weight the head effectively multiplies by instead: "
    "fs.sample(hidden, W, key, weight_layout='dv') with W [D, V] (for LoRA, "
    "merge it first: kernel + lora_a @ lora_b; for a quantized product, the "
    "dequantized kernel), or weight_layout='vd' for W [V, D]")


def _check_defaults(head, defaults: dict[str, Any]) -> None:
  for name, default in defaults.items():
    value = getattr(head, name, default)
    if value is not default:
      raise ValueError(
          f"head.{name}={value!r} is not Flax's default for {type(head).__name__}: "
          "the head's logits are then not hidden @ its stored parameter, and "
          f"sampling from that parameter would draw other tokens; {_MERGE_HINT}")


def _linen_params(head: Mapping) -> Mapping:
  """The parameter dict of a Linen head, unwrapping ``{"params": ...}``."""
  params = head
  if set(params) == {"params"}:
    params = params["params"]
  if not isinstance(params, Mapping):
    raise TypeError(f"head['params'] must be a parameter dict, got {type(params).__name__}")
  keys = set(params)
  if keys not in ({"kernel"}, {"kernel", "bias"}, {"embedding"}):
    raise ValueError(
        "a Linen head's params must be exactly {'kernel' [D, V]} or {'kernel', "
        "'bias' [V]} (nn.Dense) or {'embedding' [V, D]} (nn.Embed); got keys "
        f"{sorted(keys)}. Other parameters (LoRA's lora_a/lora_b, quantization "
        "scales, a second collection) change the logits, so sampling from the "
        f"kernel alone would draw other tokens; {_MERGE_HINT}")
  return params


def _head_parts(head) -> tuple[jax.Array, str, jax.Array | None]:
  """``(weight, weight_layout, bias or None)`` of a supported head; see the module doc."""
  if isinstance(head, QuantizedHead):
    weight, layout, bias = head.weight, head.layout, head.bias
  else:
    weight, layout, bias = _stored_parts(head)
    if hasattr(weight, "dtype") and problem.is_quantized(weight.dtype):
      # Its scales live elsewhere: sampled without them, or with a guessed
      # 1, the logits would be another distribution's.
      raise TypeError(
          f"the head's stored parameter is {weight.dtype}: an 8-bit head samples with "
          "its per-row scales; wrap it as QuantizedHead(weight, scale, bias, layout) "
          "(or quantize the float head with quantize_head)")
  # Checked here, not left to sample(): its message would name logit_bias,
  # an argument the caller never passed.
  if bias is not None and getattr(weight, "ndim", None) == 2:
    rows = weight.shape[1 if layout == "dv" else 0]
    if tuple(getattr(bias, "shape", ())) != (rows,):
      raise ValueError(
          f"the head's bias has shape {getattr(bias, 'shape', None)}; a head with "
          f"weight.shape={tuple(getattr(weight, 'shape', ()))} ({layout!r}) needs "
          f"a bias of shape [V]=({rows},)")
  return weight, layout, bias


def _stored_parts(head) -> tuple[jax.Array, str, jax.Array | None]:
  # Exact classes: a subclass may compute anything in __call__ (nnx.LoRALinear
  # adds x @ lora_a @ lora_b), and the stored kernel would not show it.
  if type(head) is nnx.Linear:
    _check_defaults(head, _LINEAR_DEFAULTS)
    bias = None if head.bias is None else _array(head.bias)
    return _array(head.kernel), "dv", bias
  if type(head) is nnx.Embed:
    _check_defaults(head, _EMBED_DEFAULTS)
    return _array(head.embedding), "vd", None
  if isinstance(head, (nnx.Linear, nnx.Embed)):
    base = "nnx.Linear" if isinstance(head, nnx.Linear) else "nnx.Embed"
    raise TypeError(
        f"head is a {type(head).__name__}, a subclass of {base}: only {base} "
        "itself is accepted, because a subclass's logits need not be hidden @ "
        f"the stored parameter (nnx.LoRALinear adds x @ lora_a @ lora_b); {_MERGE_HINT}")
  if isinstance(head, Mapping):
    params = _linen_params(head)
    if "kernel" in params:
      bias = params.get("bias")
      return _array(params["kernel"]), "dv", None if bias is None else _array(bias)
    return _array(params["embedding"]), "vd", None
  raise TypeError(
      "head must be an nnx.Linear, an nnx.Embed or a Linen parameter dict "
      f"({{'kernel': ...}} or {{'embedding': ...}}), got {type(head).__name__}")


def head_bias(head) -> jax.Array | None:
  """The head's bias ``[V]`` (``nnx.Linear(use_bias=True)``, Linen ``bias``), or None.

  Raises:
    What :func:`head_weight` raises.
  """
  return _head_parts(head)[2]


def head_weight(head) -> tuple[jax.Array, str]:
  """The LM head's weight as stored, and its ``weight_layout``.

  Args:
    head: an ``nnx.Linear`` (kernel ``[D, V]``, layout ``"dv"``), an
      ``nnx.Embed`` used as a tied head (embedding ``[V, D]``, ``"vd"``), or a
      Linen parameter dict ``{"kernel": [D, V]}`` (optionally with ``"bias"``)
      / ``{"embedding": [V, D]}`` (also wrapped as ``{"params": {...}}``;
      boxed values are unboxed). Exactly these classes, with Flax's default
      ``dot_general`` and ``promote_dtype``: see the module docstring.

  Returns:
    ``(weight, weight_layout)``, ``weight`` being the stored array itself.

  Raises:
    TypeError: ``head`` is none of the above, e.g. a subclass such as
      ``nnx.LoRALinear``.
    ValueError: a parameter dict has other keys than those above, or the
      module has a custom ``dot_general`` / ``promote_dtype``.
  """
  weight, layout, _ = _head_parts(head)
  return weight, layout


# The per-row arguments of :func:`flashsample_jax.sample`, each with the
# number of dimensions it has after the row's: ``[B]`` controls, the ``[B, n]``
# histories and the ``[B, W]`` allowed mask.
_PER_ROW = {"temperature": 0, "top_k": 0, "top_p": 0, "min_p": 0,
            "repetition_penalty": 0, "presence_penalty": 0, "frequency_penalty": 0,
            "allowed_mask": 1, "prompt_ids": 1, "output_ids": 1}


def _flat_shape(name: str, shape: tuple, lead: tuple, trailing: int,
                tail: str = "n") -> tuple | None:
  """The ``[B, ...]`` shape of a per-row argument of shape ``shape`` given for
  rows ``lead``, or None to leave it as it is (a scalar, or already ``[B,
  ...]``); ValueError for shapes that fit neither, with the user's shapes."""
  rows = math.prod(lead)
  if shape[:len(lead)] == lead and len(shape) == len(lead) + trailing:
    return (rows, *shape[len(lead):])
  if len(shape) == 1 + trailing and shape[0] == rows:
    return None
  if trailing == 0 and shape == ():
    return None
  if trailing == 0:
    want = f"a scalar, hidden.shape[:-1]={lead} or the flattened [B]=({rows},)"
  else:
    want = (f"[*hidden.shape[:-1], {tail}]=({', '.join(map(str, lead))}, {tail}) "
            f"or the flattened [B, {tail}]=({rows}, {tail})")
  raise ValueError(f"{name}.shape={shape} must be {want} for hidden with "
                   f"leading dimensions {lead}")


def _flatten_key(key, lead: tuple):
  """A key given per row of ``lead`` (typed keys of shape ``lead``, raw key
  data ``[*lead, 2]``) as ``[B]`` keys; scalar and ``[B]`` keys as they are."""
  if not hasattr(key, "shape") or not hasattr(key, "dtype"):
    return key                                   # sample() says what is wrong
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    flat = _flat_shape("key", tuple(key.shape), lead, 0)
    return key if flat is None else key.reshape(flat)
  if key.ndim < 2 or key.shape[-1] != 2:
    return key                                   # one raw key, or sample()'s error
  flat = _flat_shape("key", tuple(key.shape), lead, 1, tail="2")
  return key if flat is None else key.reshape(flat)


def _flatten_rows(hidden, key, kwargs: dict[str, Any]):
  """Reshapes ``hidden [..., D]`` and its per-row arguments to ``[B, ...]``.

  ``jax.random.categorical`` on ``[..., V]`` logits draws the noise of element
  ``(i, j, v)`` at linear index ``(i * n_j + j) * V + v``, the same as on the
  flattened ``[B, V]`` logits, so flattening keeps the tokens exact. Every
  per-row argument (the key, ``temperature``, the ``[B]`` controls, the
  histories and the allowed mask) may be shaped like the leading dimensions
  (``[..., n]`` for the histories and the mask) or already flattened.

  Returns:
    ``(hidden [B, D], key, kwargs, lead)``, ``lead`` None for a 2-D hidden.
  """
  if hidden.ndim <= 2:
    return hidden, key, kwargs, None
  lead = tuple(hidden.shape[:-1])
  hidden = hidden.reshape(math.prod(lead), hidden.shape[-1])
  key = _flatten_key(key, lead)
  kwargs = dict(kwargs)
  for name, trailing in _PER_ROW.items():
    x = kwargs.get(name)
    if x is None or not hasattr(x, "shape"):
      continue                                   # Python numbers: one per call
    flat = _flat_shape(name, tuple(x.shape), lead, trailing)
    if flat is not None:
      kwargs[name] = x.reshape(flat)
  return hidden, key, kwargs, lead


def _restore_rows(out, lead: tuple):
  """:func:`flashsample_jax.sample`'s result for ``[B]`` rows reshaped to the
  leading dimensions ``lead``: tokens ``[B]`` -> ``lead``, ``[S, B]`` ->
  ``[S, *lead]``, and in a ``SampleOutput`` every field (the top-N ones
  ``[B, N]`` -> ``[*lead, N]``)."""
  rows_last = lambda a: None if a is None else a.reshape(*a.shape[:-1], *lead)
  if not isinstance(out, SampleOutput):
    return rows_last(out)
  rows_first = lambda a: None if a is None else a.reshape(*lead, *a.shape[1:])
  return out._replace(**{
      name: (rows_first if name in _LISTS_PER_ROW else rows_last)(getattr(out, name))
      for name in out._fields})


# SampleOutput's fields that are lists per row, [B, N]; every other field is
# [B] or [S, B] (one per sample), its rows last.
_LISTS_PER_ROW = ("top_ids", "top_logprobs", "kept_ids")


def _params_as_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
  """``kwargs`` with its ``params`` (a :class:`flashsample_jax.SamplingParams`)
  spelled out as control keywords, refused beside control keywords as
  :func:`flashsample_jax.sample` refuses them: the head's bias and the
  per-row reshapes then apply to its fields as to keywords (with ``params``
  passed on, the bias was a keyword beside it, which sample refuses)."""
  if kwargs.get("params") is None:
    return {k: v for k, v in kwargs.items() if k != "params"}
  rest = dict(kwargs)
  params = rest.pop("params")
  given = {f.name: rest.pop(f.name, f.default) for f in dataclasses.fields(SamplingParams)}
  return {**rest, **api.settings(params, given)}


def sample_from_head(head, hidden, key, **kwargs) -> jax.Array | SampleOutput:
  """Samples from ``softmax(head(hidden) / T)`` without the logits.

  Equals ``jax.random.categorical(key, logits / T)`` for the f32 logits of
  ``hidden`` (cast to the head's dtype) against the stored head parameter
  (:func:`logits`).

  Args:
    head: see :func:`head_weight`, or a :class:`QuantizedHead`.
    hidden: ``[B, D]`` or ``[..., D]`` hidden states; leading dimensions are
      flattened (exactly, see :func:`_flatten_rows`) and restored on every
      output.
    key: a typed key (or raw key data); a scalar key, or one key per row
      (shape ``[B]`` or ``hidden.shape[:-1]``).
    **kwargs: passed to :func:`flashsample_jax.sample` (``temperature``,
      ``vocab_size``, ``backend``, the controls, ...). Per-row arguments
      (``temperature``, ``top_k``, ``top_p``, ``min_p``, the penalties) may
      also have shape ``hidden.shape[:-1]``, and ``prompt_ids``,
      ``output_ids`` and ``allowed_mask`` ``[*hidden.shape[:-1], n]``.
      ``params`` (a :class:`flashsample_jax.SamplingParams`) works as its
      fields given as keywords. ``weight_layout`` comes from the head.

  Returns:
    What :func:`flashsample_jax.sample` returns, with the rows restored to
    ``hidden.shape[:-1]``: int32 token ids of that shape (``[S, ...]`` with
    ``num_samples=S``), or a :class:`flashsample_jax.SampleOutput` whose
    per-token fields have the tokens' shape and whose top-N fields have
    shape ``[..., N]``.

  Raises:
    TypeError: ``weight_layout`` was passed, or ``head`` is not a supported
      head (:func:`head_weight`).
    ValueError: a head whose logits are not ``hidden @`` its stored
      parameter (:func:`head_weight`), a bias that is not ``[V]``, or a
      per-row argument shaped neither per row nor like ``hidden``'s leading
      dimensions.
    Anything :func:`flashsample_jax.sample` raises for bad arguments.
  """
  for name in ("weight_layout", "weight_scale"):
    if name in kwargs:
      raise TypeError(
          f"{name} is set by the head (nnx.Linear/kernel: 'dv', nnx.Embed/embedding: "
          "'vd'; a QuantizedHead holds its scales); do not pass it")
  weight, layout, bias = _head_parts(head)
  if isinstance(head, QuantizedHead):
    kwargs = {**kwargs, "weight_scale": head.scale}
  if not hasattr(hidden, "ndim") or hidden.ndim < 2:
    raise ValueError(
        f"hidden must have shape [B, D] or [..., D], got "
        f"{getattr(hidden, 'shape', type(hidden).__name__)}")
  kwargs = _params_as_keywords(kwargs)
  hidden2, key, kwargs, lead = _flatten_rows(hidden, key, kwargs)
  if bias is not None:
    kwargs = {**kwargs, "logit_bias": _with_callers_bias(bias, kwargs.get("logit_bias"))}
  out = api.sample(hidden2, weight, key, weight_layout=layout, **kwargs)
  return out if lead is None else _restore_rows(out, lead)


def _with_callers_bias(bias: jax.Array, extra) -> jax.Array:
  """The head's bias ``[V]`` in f32 plus a caller's ``logit_bias``, which
  must be a float ``[n]`` array with ``n`` at most V (``vocab_size`` ids;
  :func:`flashsample_jax.sample` checks ``n``): a scalar or a ``[B, V]``
  array would broadcast in the sum and pass sample's check as a new bias."""
  bias = bias.astype(jnp.float32)
  if extra is None:
    return bias
  if not hasattr(extra, "dtype") or not jnp.issubdtype(extra.dtype, jnp.floating):
    raise TypeError(f"logit_bias must be a float array [V], got "
                    f"{getattr(extra, 'dtype', type(extra).__name__)}")
  if extra.ndim != 1 or extra.shape[0] > bias.shape[0]:
    raise ValueError(f"logit_bias.shape={tuple(extra.shape)} must be [V] (V <= the head's "
                     f"{bias.shape[0]} rows), as the head's bias adds to it")
  return bias[:extra.shape[0]] + extra


def sample_from_linear(head: nnx.Linear, hidden, key, **kwargs) -> jax.Array | SampleOutput:
  """:func:`sample_from_head` for an ``nnx.Linear`` head (kernel ``[D, V]``)."""
  if not isinstance(head, nnx.Linear):
    raise TypeError(f"head must be an nnx.Linear, got {type(head).__name__}")
  return sample_from_head(head, hidden, key, **kwargs)


def sample_from_embed(embed: nnx.Embed, hidden, key, **kwargs) -> jax.Array | SampleOutput:
  """:func:`sample_from_head` for tied embeddings: ``embed.attend`` logits."""
  if not isinstance(embed, nnx.Embed):
    raise TypeError(f"embed must be an nnx.Embed, got {type(embed).__name__}")
  return sample_from_head(embed, hidden, key, **kwargs)


def sample_from_params(params: Mapping, hidden, key, **kwargs) -> jax.Array | SampleOutput:
  """:func:`sample_from_head` for a Linen head's parameter dict."""
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a Linen parameter dict, got {type(params).__name__}")
  return sample_from_head(params, hidden, key, **kwargs)


def logits(head, hidden) -> jax.Array:
  """The f32 logits ``[..., V]`` that :func:`sample_from_head` samples from.

  Materializes them: for checking and for comparison baselines only. A
  :class:`QuantizedHead`'s are ``f32(hidden @ W8.T) * scale`` with ``W8``
  and ``hidden`` in bf16 (f16 for f16 ``hidden``).
  """
  weight, layout, bias = _head_parts(head)
  hidden = jnp.asarray(hidden)
  if not jnp.issubdtype(hidden.dtype, jnp.floating) or problem.is_quantized(hidden.dtype):
    raise TypeError(f"hidden.dtype={hidden.dtype} must be a float dtype (bf16, f16, f32), "
                    "as sample_from_head takes")
  # The checks sample() applies to the weight and its scale (a hand-built
  # QuantizedHead's too): logits() must refuse what sampling refuses.
  weight = problem.checked_float_array("weight", weight, quantized_ok=True)
  contract = 1 if layout == "vd" else 0
  scale = problem.checked_weight_scale(
      head.scale if isinstance(head, QuantizedHead) else None, weight,
      weight.shape[1 - contract])
  c = problem.compute_dtype(hidden.dtype, weight.dtype)
  if hidden.ndim < 1 or hidden.shape[-1] != weight.shape[contract]:
    raise ValueError(f"hidden.shape={tuple(hidden.shape)} must end in the head's "
                     f"D={weight.shape[contract]}")
  l = jax.lax.dot_general(
      hidden.astype(c), weight.astype(c),
      (((hidden.ndim - 1,), (contract,)), ((), ())),
      preferred_element_type=jnp.float32)
  if scale is not None:
    l = l * scale
  return l if bias is None else l + bias.astype(jnp.float32)
