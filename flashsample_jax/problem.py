"""The problem every backend solves, checked once per call.

:func:`prepare` turns the user's arguments into a :class:`Problem`: the
canonical per-row form every backend consumes. Checks on shapes, dtypes and
static values raise ``TypeError``/``ValueError`` naming the argument; checks
on *values* raise only when the value is concrete. A traced temperature
cannot be inspected when the call is traced: while traced checks are on
(:mod:`flashsample_jax.checks`) it gets a ``checkify.debug_check`` instead
(:func:`check_normal`), which reports an invalid value only where the caller
wraps the call in ``checkify.checkify``; unchecked, it behaves as the
README's "Invalid values" say. A ``Problem`` is a pytree (arrays as leaves,
the static facts as its structure), so a checked problem passes into
``jax.jit`` and ``shard_map`` without being checked again.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashsample_jax import checks, noise

WeightLayout = Literal["vd", "dv"]
WEIGHT_LAYOUTS: tuple[str, ...] = ("vd", "dv")
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Quantized heads (docs/design.md, "Quantized heads"): 8-bit weights whose
# conversion to bf16 (or f16) is exact, with f32 scales per vocabulary row
# or per tensor.
QUANTIZED_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8)


def is_quantized(dtype) -> bool:
  """Whether ``dtype`` is one of :data:`QUANTIZED_DTYPES`."""
  return jnp.dtype(dtype) in [jnp.dtype(d) for d in QUANTIZED_DTYPES]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Problem:
  """Checked arguments in the one form every backend consumes.

  Noise is described per row: element ``(b, v)`` (``v`` a global vocabulary
  id) of sample ``s`` gets Gumbel noise from key words ``(k0[b], k1[b])`` at
  the 64-bit counter ``(ctr_hi[b], ctr_lo[b]) + s * sample_stride + v``. A
  scalar key gives every row the same key words and base counter
  ``b * vocab_size`` (``b`` the global row) and a stride of
  ``global_batch * vocab_size``; per-row keys give base 0 and stride
  ``vocab_size``: the counters of ``jax.random.categorical(key, t, shape=(S,
  B))`` (docs/design.md, "The exactness contract"), reduced to two ``[B]``
  arrays and a number, so kernels need not know which key mode was chosen.

  Attributes:
    hidden: ``[B, D]``, cast to ``weight.dtype``.
    weight: ``[V, D]`` (layout "vd") or ``[D, V]`` (layout "dv"), untouched;
      one shard's rows when the vocabulary is sharded.
    k0, k1: uint32 ``[B]`` key words.
    ctr_hi, ctr_lo: uint32 ``[B]`` base counters of sample 0.
    temperature: float32 ``[B]``; 0 marks a greedy row.
    key_data: the key's raw data, uint32 ``[2]`` or ``[B, 2]``: stage 2's
      exact path takes the key words from it inside its conditional (a
      branch's operands are copied into it on every call).
    weight_scale: None (a float head), or for a quantized ``weight`` the f32
      scale: shape ``()`` (per tensor) or ``[weight_rows]`` (per vocabulary
      row of this weight); the logits are ``f32(hidden @ W.T) * scale``
      (:func:`logits`). ``hidden`` is then bf16 (f16 if the caller's was).
    layout: "vd" or "dv" (static).
    vocab_size: the global logical vocabulary; ids ``>= vocab_size`` are
      never returned (static).
    per_row_keys: whether the user passed one key per row (static).
    vocab_shards: how many vocabulary shards the logical vocabulary is split
      into (1 unless ``weight`` is one shard of a vocabulary-parallel head;
      static).
    sample_stride: counter distance between consecutive samples (static).
    uniform_temperature: whether ``temperature`` is one traced value
      broadcast over the rows (static): stage 2's exact path then rebuilds
      it inside its conditional from its first entry (:func:`in_branch`).
    row_base: for a scalar key whose counters are constants of the program
      (a Python batch-shard index), the global row of local row 0, else
      None (static): the exact path rebuilds the counters inside its
      conditional (:func:`in_branch`).
  """

  hidden: jax.Array
  weight: jax.Array
  k0: jax.Array
  k1: jax.Array
  ctr_hi: jax.Array
  ctr_lo: jax.Array
  temperature: jax.Array
  key_data: jax.Array
  layout: str = dataclasses.field(metadata=dict(static=True))
  vocab_size: int = dataclasses.field(metadata=dict(static=True))
  per_row_keys: bool = dataclasses.field(metadata=dict(static=True))
  vocab_shards: int = dataclasses.field(default=1, metadata=dict(static=True))
  sample_stride: int = dataclasses.field(default=0, metadata=dict(static=True))
  weight_scale: jax.Array | None = None
  uniform_temperature: bool = dataclasses.field(default=False, metadata=dict(static=True))
  row_base: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def batch(self) -> int:
    return self.hidden.shape[0]

  @property
  def hidden_dim(self) -> int:
    return self.hidden.shape[1]

  @property
  def weight_rows(self) -> int:
    """Rows of the vocabulary held by ``weight`` (padding included)."""
    return self.weight.shape[0 if self.layout == "vd" else 1]

  @property
  def total_rows(self) -> int:
    """Weight rows of every vocabulary shard together."""
    return self.weight_rows * self.vocab_shards

  @property
  def quantized(self) -> bool:
    """Whether the weight is quantized (``weight_scale`` is set)."""
    return self.weight_scale is not None

  def scale_of(self, rows):
    """The scale of the weight's local rows ``rows`` (an int array, any
    shape): a gather of the per-row scales, or the per-tensor scale (f32
    ``()``), or None for a float head."""
    s = self.weight_scale
    if s is None or s.ndim == 0:
      return s
    return jnp.take(s, rows, axis=0)

  def scale_slice(self, start: int, width: int):
    """The scale of local rows ``start .. start + width - 1`` (``start`` an
    int or a traced int): ``[width]``, the per-tensor ``()`` or None."""
    s = self.weight_scale
    if s is None or s.ndim == 0:
      return s
    return lax.dynamic_slice_in_dim(s, start, width)

  def counters(self, samples: int, *, rows_first: bool = False):
    """Base counters ``(hi, lo)`` uint32 of samples ``0..S-1``: ``[S, B]``
    (``[B, S]`` with ``rows_first``)."""
    hi, lo = self.ctr_hi, self.ctr_lo
    if rows_first:
      hi, lo = hi[:, None], lo[:, None]
    else:
      hi, lo = hi[None], lo[None]
    if samples == 1:
      return hi, lo
    steps = np.arange(samples, dtype=np.uint64) * np.uint64(self.sample_stride)
    s_hi = (steps >> np.uint64(32)).astype(np.uint32)
    s_lo = (steps & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    if not rows_first:
      s_hi, s_lo = s_hi[:, None], s_lo[:, None]
    s_hi, s_lo = jnp.asarray(s_hi), jnp.asarray(s_lo)
    new_lo = lo + s_lo
    return hi + s_hi + (new_lo < s_lo).astype(jnp.uint32), new_lo


def logits(hidden, weight, layout: str, scale=None) -> jax.Array:
  """f32 logits ``[B, Vc]`` of ``hidden [B, D]`` against a weight slice
  (``[Vc, D]`` for "vd", ``[D, Vc]`` for "dv"): f32 accumulation, the
  package's definition of the logits. A quantized slice is converted to
  ``hidden``'s dtype (exact) and the f32 product multiplied by ``scale``
  (``[Vc]`` or ``()``; one f32 rounding). Layout "logits"
  (:func:`prepare_logits`): the slice ``[B, Vc]`` is the logits."""
  if layout == "logits":
    return weight.astype(jnp.float32)
  contract = 1 if layout == "vd" else 0
  l = lax.dot_general(hidden, weight.astype(hidden.dtype),
                      (((1,), (contract,)), ((), ())),
                      preferred_element_type=jnp.float32)
  return scaled(l, scale)


def scaled(product, scale):
  """The logits of an f32 product ``[B, Vc]``: times ``scale`` (``[Vc]``,
  ``()`` or None for none), one f32 rounding (:func:`logits`)."""
  return product if scale is None else product * scale


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def checked_float_array(name: str, x, *, quantized_ok: bool = False) -> jax.Array:
  """``x`` as a 2-D array of a float dtype (or an 8-bit one where
  ``quantized_ok``), or the TypeError / ValueError naming ``name`` that
  :func:`prepare` raises for ``hidden`` and ``weight``."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
  allowed = _FLOAT_DTYPES + (QUANTIZED_DTYPES if quantized_ok else ())
  if x.dtype not in [jnp.dtype(d) for d in allowed]:
    names = ", ".join(jnp.dtype(d).name for d in allowed)
    hint = (" (a quantized head also takes weight_scale)" if quantized_ok else "")
    raise TypeError(f"{name}.dtype={x.dtype} must be one of {names}{hint}")
  if x.ndim != 2:
    raise ValueError(f"{name} must be 2-D, got {name}.shape={tuple(x.shape)}")
  return jnp.asarray(x)


def key_data(key, batch: int, rows_of: str = "hidden"):
  """Checks ``key``; returns its raw data (uint32 ``[2]`` or ``[B, 2]``) and
  whether it holds one key per row (of ``rows_of``, the argument the errors
  name)."""
  if isinstance(key, (int, np.integer)) or not hasattr(key, "dtype"):
    raise TypeError(
        "key must be a JAX key from jax.random.key (or raw uint32 key data "
        f"from jax.random.PRNGKey), got {type(key).__name__}")
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    impl = str(jax.random.key_impl(key))
    if impl != "threefry2x32":
      raise ValueError(
          f"key uses the PRNG implementation {impl!r}; only 'threefry2x32' "
          "(JAX's default) is supported")
    if key.ndim not in (0, 1):
      raise ValueError(
          f"key must be a scalar key or have shape [B]={batch}, got "
          f"key.shape={tuple(key.shape)}")
    data = jax.random.key_data(key)
    per_row = key.ndim == 1
  else:
    if key.dtype != jnp.uint32:
      raise TypeError(
          f"key.dtype={key.dtype}: raw key data must be uint32 (shape [2] or "
          "[B, 2]); prefer a typed key from jax.random.key")
    if key.ndim not in (1, 2) or key.shape[-1] != 2:
      raise ValueError(
          f"raw key data must have shape [2] or [B, 2], got "
          f"key.shape={tuple(key.shape)}")
    data = jnp.asarray(key)
    per_row = key.ndim == 2
  if per_row and data.shape[0] != batch:
    raise ValueError(
        f"per-row keys need one key per row of {rows_of}: key has "
        f"{data.shape[0]} keys, {rows_of} has B={batch} rows")
  return data, per_row


def key_words(data, batch: int):
  """``(k0, k1)`` uint32 ``[B]``: the key words of every row, from raw key
  data ``[2]`` (one key for the batch) or ``[B, 2]`` (one per row)."""
  if data.ndim == 2:
    return data[:, 0], data[:, 1]
  return (jnp.broadcast_to(data[0], (batch,)), jnp.broadcast_to(data[1], (batch,)))


def static_hint(name: str) -> str:
  """What to say when an option that is a Python value (api.STATIC_ARGNAMES
  lists ``sample``'s) arrives traced, e.g. under ``jax.jit(fs.sample)``:
  for any entry point (``sample_logits``, ``verify_drafts``, ...)."""
  return (f"pass it as a static argument, e.g. jax.jit(f, static_argnames=({name!r},)) "
          "(for fs.sample: static_argnames=fs.STATIC_ARGNAMES), or close over it")


def static_arg_error(name: str, value, want: str) -> TypeError:
  """The TypeError for an option of :func:`flashsample_jax.sample` that must
  be a Python value (``want``, e.g. "a bool"); says how to make it static
  when ``value`` is traced."""
  if isinstance(value, jax.core.Tracer):
    return TypeError(f"{name}={value!r} must be {want}, static under jax.jit, but "
                     f"is traced: {static_hint(name)}")
  return TypeError(f"{name}={value!r} must be {want}")


# Values the kernels' arithmetic covers for a temperature or a repetition
# penalty ``r``: normal f32 values whose reciprocals are normal too. The
# kernels multiply by ``1 / T`` and ``1 / r`` computed by XLA (docs/design.md,
# "Division"); GPUs flush subnormals to zero, so a subnormal ``T`` makes
# ``1 / T`` inf (XLA:CPU even compares it equal to 0: the row turns greedy
# where ``categorical(key, l / T)`` samples), and ``T >= 2**126`` has a
# subnormal reciprocal, flushed to 0.
NORMAL_MIN = 2.0**-126     # the smallest normal f32
NORMAL_BOUND = 2.0**126    # the smallest f32 whose reciprocal is subnormal
NORMAL_RANGE = "a normal float32 in [2**-126, 2**126) (about [1.2e-38, 8.5e37))"
_NORMAL_WHY = ("the kernels multiply by its reciprocal, and accelerators flush "
               "subnormal values and reciprocals to 0")


def _normal_bits_ok(bits, zero_ok: bool):
  """Whether float32 values given as their uint32 ``bits`` (NumPy or JAX) are
  in ``[NORMAL_MIN, NORMAL_BOUND)`` (or +-0 with ``zero_ok``). On the bits,
  not on floats: XLA:CPU and GPUs compare a subnormal equal to 0."""
  exponent = (bits >> 23) & 0xFF
  ok = ((bits >> 31) == 0) & (exponent >= 1) & (exponent < 253)   # 2**126: 253
  if zero_ok:
    ok = ok | ((bits & 0x7FFFFFFF) == 0)
  return ok


def check_normal(name: str, value, *, zero: str | None = None) -> None:
  """Refuses values outside :data:`NORMAL_RANGE` (and 0 unless ``zero`` says
  what 0 means, e.g. "greedy").

  A concrete ``value`` (a number or an array, any shape) raises
  ``ValueError`` naming the first bad entry; a Python or float64 value that
  is not 0 but rounds to a float32 0 is refused too. A traced one gets a
  :func:`flashsample_jax.checks.debug_check`: nothing unless traced checks
  are on, then a no-op unless the caller wraps the call in
  ``checkify.checkify`` (the README's "Invalid values" say what unchecked
  traced values do).

  Raises:
    ValueError: a concrete value out of range.
  """
  accepted = (f"0 ({zero}) or {NORMAL_RANGE}" if zero is not None else NORMAL_RANGE)
  if _is_concrete(value):
    raw = np.asarray(value)
    wide = raw.astype(np.float64)
    with np.errstate(over="ignore"):            # 1e300 -> inf: refused below
      f32 = raw.astype(np.float32)
    bad = ~_normal_bits_ok(f32.reshape(-1).view(np.uint32), zero is not None)
    bad |= (wide.reshape(-1) != 0) & (f32.reshape(-1) == 0)        # rounds to 0
    if bad.any():
      shown = raw.reshape(-1)[int(np.argmax(bad))].item()
      _refuse_first(name, raw, bad, f"{accepted}{f': {_NORMAL_WHY}' if shown > 0 else ''}")
    return
  _traced_check(name, value, lambda x: _normal_bits_ok(
      lax.bitcast_convert_type(x, jnp.uint32), zero is not None), f"{accepted}: {_NORMAL_WHY}")


def _refuse_first(name: str, raw, bad, must: str) -> None:
  """``ValueError`` naming the first entry of ``raw`` (NumPy) where ``bad``
  (flat bool) holds, and how many are bad."""
  i = int(np.argmax(bad))
  where = name if raw.ndim == 0 else f"{name}[{i}]"
  rows = f"; {int(bad.sum())} of {bad.size} invalid" if bad.size > 1 else ""
  raise ValueError(f"{where}={raw.reshape(-1)[i].item()} must be {must}{rows}")


def _traced_check(name: str, value, ok_of, must: str) -> None:
  """A :func:`flashsample_jax.checks.debug_check` that ``ok_of(x)`` holds for
  every entry of the traced ``value`` (as f32), naming the first that fails."""
  x = jnp.asarray(value, jnp.float32).reshape(-1)
  ok = ok_of(x)
  i = jnp.argmin(ok)
  where = name if jnp.ndim(value) == 0 else f"{name}[{{i}}]"
  checks.debug_check(jnp.all(ok), f"{where}={{v}} must be {must}", i=i, v=x[i])


def temperature_rows(temperature, batch: int) -> jax.Array:
  """``temperature`` (a number, or a scalar or ``[B]`` array) checked and as
  f32 ``[batch]``; errors name it."""
  if isinstance(temperature, bool) or temperature is None:
    raise TypeError(f"temperature must be a float or a float array, got {temperature!r}")
  if isinstance(temperature, (int, float, np.integer, np.floating)):
    check_normal("temperature", temperature, zero="greedy")
    return jnp.full((batch,), float(temperature), dtype=jnp.float32)
  if not hasattr(temperature, "dtype"):
    raise TypeError(
        f"temperature must be a float or an array, got {type(temperature).__name__}")
  if not (jnp.issubdtype(temperature.dtype, jnp.floating)
          or jnp.issubdtype(temperature.dtype, jnp.integer)):
    raise TypeError(f"temperature.dtype={temperature.dtype} must be a float dtype")
  if temperature.ndim not in (0, 1) or (temperature.ndim == 1
                                        and temperature.shape != (batch,)):
    raise ValueError(
        f"temperature must be a scalar or have shape [B]=({batch},), got "
        f"temperature.shape={tuple(temperature.shape)}")
  check_normal("temperature", temperature, zero="greedy")
  return jnp.broadcast_to(jnp.asarray(temperature, dtype=jnp.float32), (batch,))


def _row_offset(row_offset) -> jax.Array:
  """``row_offset`` as a uint32 scalar; checks concrete values."""
  if isinstance(row_offset, bool):
    raise TypeError(f"row_offset={row_offset!r} must be an int or an integer scalar")
  if isinstance(row_offset, (int, np.integer)):
    if not 0 <= row_offset < 2**32:
      raise ValueError(f"{row_offset=} must be in [0, 2**32)")
    return jnp.uint32(row_offset)
  if (not hasattr(row_offset, "dtype") or row_offset.ndim != 0
      or not jnp.issubdtype(row_offset.dtype, jnp.integer)):
    raise TypeError(f"row_offset={row_offset!r} must be an int or an integer scalar")
  return jnp.asarray(row_offset).astype(jnp.uint32)


def _check_int(name: str, value, lo: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
    raise ValueError(f"{name}={value!r} must be a Python int >= {lo}")
  return int(value)


def prepare(hidden, weight, key, *, temperature=1.0, weight_layout="vd",
            vocab_size=None, vocab_shards=1, batch_shard=(0, 1),
            weight_scale=None) -> Problem:
  """Checks every argument and builds the canonical :class:`Problem`.

  ``vocab_shards`` and ``batch_shard`` serve mesh callers
  (``flashsample_jax.mesh``): ``weight`` then holds one of ``vocab_shards``
  equal vocabulary shards, ``vocab_size`` is the global logical vocabulary
  (default ``vocab_shards * weight_rows``), and ``hidden`` holds the rows of
  data-parallel shard ``batch_shard = (index, count)`` (index: an int or a
  traced int32 scalar): a scalar key counts rows across the whole batch.

  Raises:
    TypeError: an argument has the wrong type or dtype.
    ValueError: shapes disagree, or a static or concrete value is out of range.
  """
  if weight_layout not in WEIGHT_LAYOUTS:
    raise ValueError(f"{weight_layout=} must be one of {WEIGHT_LAYOUTS}")
  hidden = checked_float_array("hidden", hidden)
  weight = checked_float_array("weight", weight, quantized_ok=True)
  batch, dim = hidden.shape
  if weight_layout == "vd":
    rows, wdim = weight.shape
  else:
    wdim, rows = weight.shape
  if wdim != dim:
    want = "[V, D]" if weight_layout == "vd" else "[D, V]"
    other = "dv" if weight_layout == "vd" else "vd"
    hint = ""
    if rows == dim:    # the other layout fits: the usual slip is a Flax kernel
      hint = (f"; weight looks like {'[D, V]' if other == 'dv' else '[V, D]'}: pass "
              f"weight_layout={other!r}" + (
                  " (an nnx.Linear / Linen Dense kernel is [D, V])"
                  if other == "dv" else " (an embedding table is [V, D])"))
    raise ValueError(
        f"weight.shape={tuple(weight.shape)} ({want} for {weight_layout=}) does "
        f"not match hidden.shape={tuple(hidden.shape)}: D={dim} vs {wdim}{hint}")
  if dim == 0 or rows == 0:
    raise ValueError(
        f"hidden.shape={tuple(hidden.shape)} and weight.shape="
        f"{tuple(weight.shape)} need D >= 1 and V >= 1")
  vocab_shards = _check_int("vocab_shards", vocab_shards, 1)
  vocab_size = _vocab_size(vocab_size, rows * vocab_shards,
                           f"the rows of weight for {weight_layout=}"
                           + (f" times {vocab_shards} vocabulary shards"
                              if vocab_shards > 1 else ""))
  scale = checked_weight_scale(weight_scale, weight, rows)
  p = _problem(hidden.astype(compute_dtype(hidden.dtype, weight.dtype)), weight, key,
               temperature, layout=weight_layout, vocab_size=vocab_size,
               vocab_shards=vocab_shards, batch_shard=batch_shard)
  return dataclasses.replace(p, weight_scale=scale)


def compute_dtype(hidden_dtype, weight_dtype):
  """The dtype of the product's operands: the weight's for a float head;
  for a quantized one bf16, or f16 when ``hidden`` is f16 (8-bit values
  convert to either exactly)."""
  if not is_quantized(weight_dtype):
    return jnp.dtype(weight_dtype)
  if jnp.dtype(hidden_dtype) == jnp.dtype(jnp.float16):
    return jnp.dtype(jnp.float16)
  return jnp.dtype(jnp.bfloat16)


def checked_weight_scale(weight_scale, weight, rows: int):
  """The checked f32 scale of a quantized ``weight`` (``()`` or
  ``[rows]``), or None for a float head.

  Raises:
    TypeError: a quantized weight without a scale, a scale beside a float
      weight, or a scale that is not float32.
    ValueError: a scale of another shape.
  """
  quantized = is_quantized(weight.dtype)
  names = ", ".join(jnp.dtype(d).name for d in QUANTIZED_DTYPES)
  if weight_scale is None:
    if quantized:
      raise TypeError(
          f"weight.dtype={weight.dtype} is quantized and needs weight_scale: float32 "
          f"of shape [V]=({rows},) (one scale per vocabulary row) or a scalar "
          "(per tensor)")
    return None
  if not quantized:
    raise TypeError(
        f"weight_scale is for quantized weights ({names}); weight.dtype="
        f"{weight.dtype} is a float head: drop weight_scale (or fold it into weight)")
  if isinstance(weight_scale, bool):
    raise TypeError(f"weight_scale={weight_scale!r} must be a float or a float32 array")
  if isinstance(weight_scale, (int, float, np.integer, np.floating)):
    try:
      value = float(weight_scale)
    except OverflowError:
      raise ValueError(f"weight_scale={weight_scale!r} must be a finite float32") from None
    check_finite("weight_scale", value)
    return jnp.asarray(value, jnp.float32)
  if not hasattr(weight_scale, "dtype") or not hasattr(weight_scale, "shape"):
    raise TypeError(f"weight_scale must be a float or a float32 array, got "
                    f"{type(weight_scale).__name__}")
  if jnp.dtype(weight_scale.dtype) != jnp.dtype(jnp.float32):
    raise TypeError(
        f"weight_scale.dtype={weight_scale.dtype} must be float32 (the logits are "
        "f32(hidden @ W.T) * weight_scale in f32); cast it with .astype(jnp.float32)")
  if weight_scale.shape not in ((), (rows,)):
    raise ValueError(
        f"weight_scale.shape={tuple(weight_scale.shape)} must be () (per tensor) or "
        f"[V]=({rows},) (one scale per row of weight)")
  check_finite("weight_scale", weight_scale)
  return jnp.asarray(weight_scale)


def check_finite(name: str, value) -> None:
  """Refuses NaN and infinite float32 values (a Python number too large for
  float32 included). Concrete ``value``: ``ValueError`` naming the first bad
  entry. Traced: a :func:`flashsample_jax.checks.debug_check` (nothing
  unless traced checks are on, as :func:`check_normal`)."""
  if _is_concrete(value):
    if isinstance(value, jax.Array):
      with jax.ensure_compile_time_eval():      # a constant inside a trace too
        if bool(jnp.all(jnp.isfinite(value))):
          return                 # one flag from the device, not a [V] copy
    raw = np.asarray(value)
    with np.errstate(over="ignore"):            # 1e300 -> inf: refused below
      bad = ~np.isfinite(raw.astype(np.float32).reshape(-1))
    if bad.any():
      _refuse_first(name, raw, bad, "a finite float32")
    return
  _traced_check(name, value, jnp.isfinite, "a finite float32")


def prepare_logits(logits, key, *, temperature=1.0, vocab_size=None) -> Problem:
  """The :class:`Problem` of sampling from given logits ``[B, V]``
  (:func:`flashsample_jax.sample_logits`): layout ``"logits"``, whose
  "weight" is the logits themselves and whose :func:`logits` of a slice is
  that slice in f32 (``hidden`` is an empty ``[B, 0]`` placeholder). Only
  the xla backends run it.

  Raises:
    TypeError, ValueError: as :func:`prepare`, naming ``logits``.
  """
  logits = checked_float_array("logits", logits)
  batch, rows = logits.shape
  if rows == 0:
    raise ValueError(f"logits.shape={tuple(logits.shape)} needs V >= 1")
  vocab_size = _vocab_size(vocab_size, rows, "the columns of logits")
  return _problem(jnp.zeros((batch, 0), logits.dtype), logits, key, temperature,
                  layout="logits", vocab_size=vocab_size, vocab_shards=1,
                  batch_shard=(0, 1), rows_of="logits")


def _vocab_size(vocab_size, total_rows: int, rows_are: str) -> int:
  """The checked logical vocabulary (default: every row)."""
  if vocab_size is None:
    return total_rows
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
    raise static_arg_error("vocab_size", vocab_size, "a Python int or None")
  vocab_size = int(vocab_size)
  if not 1 <= vocab_size <= total_rows:
    raise ValueError(f"{vocab_size=} must be in [1, {total_rows}] ({rows_are})")
  if vocab_size >= 2**31:
    raise ValueError(f"{vocab_size=} must be < 2**31")
  return vocab_size


def _problem(hidden, weight, key, temperature, *, layout: str, vocab_size: int,
             vocab_shards: int, batch_shard, rows_of: str = "hidden") -> Problem:
  """The :class:`Problem` of checked arrays: the key, the temperature and
  each row's noise counters (the class docstring)."""
  batch = hidden.shape[0]
  shard_index, shard_count = batch_shard
  shard_count = _check_int("batch_shard count", shard_count, 1)
  data, per_row = key_data(key, batch, rows_of)
  k0, k1 = key_words(data, batch)
  temp = temperature_rows(temperature, batch)
  row_base = None
  global_batch = batch * shard_count
  if per_row:
    ctr_hi = jnp.zeros((batch,), jnp.uint32)
    ctr_lo = jnp.zeros((batch,), jnp.uint32)
    stride = vocab_size
  elif isinstance(shard_index, (int, np.integer)):
    # A Python offset: the counters are constants of the program.
    row_base = int(shard_index) * batch
    _row_offset(row_base)                                    # range check
    ctr_hi, ctr_lo = scalar_key_counters(batch, vocab_size, row_base)
    stride = global_batch * vocab_size
  else:
    rows_ids = (jnp.arange(batch, dtype=jnp.uint32)
                + _row_offset(shard_index * batch))
    ctr_hi, ctr_lo = noise.mul_u32_wide(rows_ids, np.uint32(vocab_size))
    stride = global_batch * vocab_size
  if not jax.config.jax_threefry_partitionable:
    raise NotImplementedError(
        "flashsample_jax reproduces jax.random with jax_threefry_partitionable="
        "True (the default since jax 0.5); it is False in this process")
  return Problem(
      hidden=hidden, weight=weight, k0=k0, k1=k1,
      ctr_hi=ctr_hi, ctr_lo=ctr_lo, temperature=temp, key_data=data,
      layout=layout, vocab_size=vocab_size, per_row_keys=per_row,
      vocab_shards=vocab_shards, sample_stride=stride,
      uniform_temperature=one_traced_value(temperature, temp), row_base=row_base)


def one_traced_value(given, per_row) -> bool:
  """Whether ``per_row`` (``[B]``, made from the argument ``given``) is one
  value broadcast over the rows inside a trace: a number or a 0-d array
  under ``jax.jit``. Outside a trace the ``[B]`` array is a program input
  already (nothing to rebuild)."""
  scalar = isinstance(given, (int, float, np.integer, np.floating)) or (
      getattr(given, "ndim", None) == 0)
  return scalar and isinstance(per_row, jax.core.Tracer)


def scalar_key_counters(batch: int, vocab_size: int, row_base: int):
  """``(ctr_hi, ctr_lo)`` uint32 ``[B]``: a scalar key's base counters of
  rows ``row_base ..`` (``row * vocab_size``, :class:`Problem`). NumPy, not
  jnp, so that they are constants of the program: no kernel computes them
  on every call."""
  rows_ids = (np.arange(batch, dtype=np.uint64) + np.uint64(row_base)) % np.uint64(2**32)
  ctr = rows_ids * np.uint64(vocab_size)                    # < 2**63: exact
  return (jnp.asarray((ctr >> np.uint64(32)).astype(np.uint32)),
          jnp.asarray((ctr & np.uint64(0xFFFFFFFF)).astype(np.uint32)))


def in_branch(p: Problem):
  """A function, for a conditional's branch to call, that returns ``p``
  with the per-row arrays that need no per-row input made again there: the
  key words from the key, the counters of a :attr:`Problem.row_base`, a
  uniform temperature from its first entry (taken here, outside). The
  branch then does not take those ``[B]`` arrays as operands, which XLA
  materializes, a small kernel each, on every call (docs/performance.md,
  "The exact path's conditional")."""
  first = p.temperature[0] if p.uniform_temperature else None

  def rebuild() -> Problem:
    k0, k1 = key_words(p.key_data, p.batch)
    q = dataclasses.replace(p, k0=k0, k1=k1)
    if first is not None:
      q = dataclasses.replace(q, temperature=jnp.broadcast_to(first, (p.batch,)))
    if p.row_base is not None:
      hi, lo = scalar_key_counters(p.batch, p.vocab_size, p.row_base)
      q = dataclasses.replace(q, ctr_hi=hi, ctr_lo=lo)
    return q

  return rebuild
