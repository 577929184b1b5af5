"""Per-row absmax quantization of an LM head to FP8 or int8.

:func:`quantize_weight` turns a float head into the ``(weight, weight_scale)``
pair that :func:`flashsample_jax.sample` takes: one f32 scale per vocabulary
row, ``scale[v] = max_d |W[v, d]| / qmax``, and ``W8[v] = W[v] / scale[v]``
rounded to the 8-bit type (nearest, ties to even; int8 values clipped to
``[-127, 127]``). Rows of zeros get scale 1. The product the sampler then
computes is ``f32(h @ W8.astype(bf16).T) * scale`` (docs/design.md,
"Quantized heads"): the quantization error is in ``W8 * scale - W``, never
in the sampling, which is exact for the quantized head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flashsample_jax import problem

__all__ = ["quantize_weight", "QUANT_DTYPES"]

# The accepted names of each 8-bit type and its largest finite magnitude.
QUANT_DTYPES = {
    "float8_e4m3fn": (jnp.float8_e4m3fn, 448.0),
    "float8_e5m2": (jnp.float8_e5m2, 57344.0),
    "int8": (jnp.int8, 127.0),
}
_ALIASES = {"fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
            "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2"}


def _dtype_name(dtype) -> str:
  """The key of :data:`QUANT_DTYPES` for ``dtype`` (a name, an alias such
  as ``"fp8"`` or a JAX/NumPy dtype)."""
  if isinstance(dtype, str):
    name = _ALIASES.get(dtype, dtype)
  else:
    try:
      name = jnp.dtype(dtype).name
    except TypeError:
      name = None
  if name not in QUANT_DTYPES:
    raise ValueError(f"dtype={dtype!r} must be one of {tuple(QUANT_DTYPES)} (or "
                     f"{tuple(_ALIASES)})")
  return name


def quantize_weight(weight, dtype="float8_e4m3fn", *, weight_layout="vd"):
  """Quantizes an LM head per vocabulary row (absmax).

  Args:
    weight: a float head, ``[V, D]`` (``weight_layout="vd"``) or ``[D, V]``
      (``"dv"``); kept in its layout (no transpose).
    dtype: ``"float8_e4m3fn"`` (alias ``"fp8"``), ``"float8_e5m2"``
      (``"fp8_e5m2"``) or ``"int8"``, or the JAX dtype.
    weight_layout: ``"vd"`` or ``"dv"``.

  Returns:
    ``(weight8, weight_scale)``: the 8-bit head in ``weight``'s layout and
    f32 ``[V]`` scales, for ``fs.sample(h, weight8, key,
    weight_scale=weight_scale, weight_layout=weight_layout)``.

  Raises:
    TypeError: ``weight`` is not a 2-D float array.
    ValueError: an unknown ``dtype`` or ``weight_layout``, an empty
      ``weight``, or (a concrete one) NaN or infinite entries.
  """
  name = _dtype_name(dtype)
  if weight_layout not in problem.WEIGHT_LAYOUTS:
    raise ValueError(f"{weight_layout=} must be one of {problem.WEIGHT_LAYOUTS}")
  if (not hasattr(weight, "dtype") or not jnp.issubdtype(weight.dtype, jnp.floating)
      or problem.is_quantized(weight.dtype)):
    raise TypeError(f"weight must be a float array (bf16, f16, f32), got "
                    f"{getattr(weight, 'dtype', type(weight).__name__)}")
  if weight.ndim != 2:
    raise TypeError(f"weight must be 2-D, got weight.shape={tuple(weight.shape)}")
  if 0 in weight.shape:
    raise ValueError(f"weight.shape={tuple(weight.shape)} has no entries to quantize "
                     "(V and D must be >= 1)")
  weight8, scale, finite = _quantize(weight, name=name, axis=1 if weight_layout == "vd" else 0)
  _check_finite_rows(finite)
  return weight8, scale


def _check_finite_rows(finite) -> None:
  """Refuses a concrete head with a NaN or infinite entry: its row's absmax
  scale would be NaN or infinite, or (int8) the entry silently 0. A traced
  head (``quantize_weight`` under ``jax.jit``) is not checked."""
  if isinstance(finite, jax.core.Tracer) or bool(jnp.all(finite)):
    return
  rows = np.flatnonzero(~np.asarray(finite))
  raise ValueError(f"weight has NaN or infinite entries in vocabulary row {int(rows[0])} "
                   f"({rows.size} rows in all): absmax quantization needs finite weights")


_F32_TINY = np.float32(np.finfo(np.float32).tiny)


@functools.partial(jax.jit, static_argnames=("name", "axis"))
def _quantize(weight, *, name: str, axis: int):
  target, qmax = QUANT_DTYPES[name]
  w = weight.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=axis)
  # At least the smallest normal float32: below it amax / qmax is flushed
  # to 0 on CPUs and GPUs, and the row would become 0 / 0 (NaN). Such a
  # row's entries then land at or below qmax, and its logits stay ~0.
  scale = jnp.where(amax > 0, jnp.maximum(amax / qmax, _F32_TINY), 1.0).astype(jnp.float32)
  x = w / jnp.expand_dims(scale, axis)
  if name == "int8":
    x = jnp.round(x)
  # Division can land a hair above qmax; e4m3fn has no infinity (it would
  # become NaN), so clip before the conversion.
  x = jnp.clip(x, -qmax, qmax)
  return x.astype(target), scale, jnp.all(jnp.isfinite(w), axis=axis)
