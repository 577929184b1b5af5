"""Argument checking shared by every backend and the reference.

One function, :func:`prepare`, turns the user's arguments into a
:class:`Problem`: the canonical per-row form every backend consumes. Checks on
shapes, dtypes and static values raise ``TypeError``/``ValueError`` naming the
argument; checks on *values* run only when the value is concrete (a traced
temperature cannot be inspected; see the README for what invalid traced
values do).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from flashsample_jax import noise

WeightLayout = Literal["vd", "dv"]
WEIGHT_LAYOUTS: tuple[str, ...] = ("vd", "dv")
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Problem:
  """Validated arguments in the one form every backend consumes.

  Noise is described per row: element ``(b, v)`` (``v`` a global vocabulary
  id) gets Gumbel noise from key words ``(k0[b], k1[b])`` and 64-bit counter
  ``(ctr_hi[b], ctr_lo[b]) + v``. A scalar key gives every row the same key
  words and base counter ``b * vocab_size``; per-row keys give base 0. This is
  DESIGN.md section 1 reduced to two ``[B]`` arrays, so kernels need not know
  which key mode the user chose.

  Attributes:
    hidden: ``[B, D]``, cast to ``weight.dtype``.
    weight: ``[V, D]`` (layout "vd") or ``[D, V]`` (layout "dv"), untouched.
    k0, k1: uint32 ``[B]`` key words, ``key_words(key, B)``. A problem
      given to ``xla_backend.finish_controls`` must keep them so: its exact
      path splits them from ``key`` again inside its conditional branch.
    ctr_hi, ctr_lo: uint32 ``[B]`` base counters.
    temperature: float32 ``[B]``; 0 marks a greedy row.
    layout: "vd" or "dv".
    vocab_size: logical vocabulary; ids ``>= vocab_size`` are never returned.
    per_row_keys: whether the user passed one key per row.
    key: the user's key (typed or raw), kept for the reference.
    vocab_shards: how many vocabulary shards the logical vocabulary is split
      into (1 unless ``weight`` is one shard of a vocabulary-parallel head);
      ``vocab_size`` may then be up to ``vocab_shards * weight_rows``.
    row_offset: global index of ``hidden``'s first row (non-zero when the
      batch is sharded); a scalar key's base counters are
      ``(row_offset + b) * vocab_size``. An int or an int32 scalar array.
  """

  hidden: jax.Array
  weight: jax.Array
  k0: jax.Array
  k1: jax.Array
  ctr_hi: jax.Array
  ctr_lo: jax.Array
  temperature: jax.Array
  layout: str
  vocab_size: int
  per_row_keys: bool
  key: Any
  vocab_shards: int = 1
  row_offset: Any = 0

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


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_float_array(name: str, x) -> jax.Array:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
  if x.dtype not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise TypeError(
        f"{name}.dtype={x.dtype} must be one of bfloat16, float16, float32")
  if x.ndim != 2:
    raise ValueError(f"{name} must be 2-D, got {name}.shape={tuple(x.shape)}")
  return jnp.asarray(x)


def key_words(key, batch: int):
  """Returns (k0 [B], k1 [B], per_row) from a typed or raw threefry key."""
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
        f"per-row keys need one key per row of hidden: key has "
        f"{data.shape[0]} keys, hidden has B={batch} rows")
  if per_row:
    return data[:, 0], data[:, 1], True
  k0 = jnp.broadcast_to(data[0], (batch,))
  k1 = jnp.broadcast_to(data[1], (batch,))
  return k0, k1, False


def _temperature(temperature, batch: int) -> jax.Array:
  if isinstance(temperature, bool) or temperature is None:
    raise TypeError(f"temperature must be a float or a float array, got {temperature!r}")
  if isinstance(temperature, (int, float, np.integer, np.floating)):
    t = float(temperature)
    if math.isnan(t) or t < 0:
      raise ValueError(f"temperature={t} must be >= 0 (0 means greedy)")
    return jnp.full((batch,), t, dtype=jnp.float32)
  if not hasattr(temperature, "dtype"):
    raise TypeError(
        f"temperature must be a float or an array, got {type(temperature).__name__}")
  if not (jnp.issubdtype(temperature.dtype, jnp.floating)
          or jnp.issubdtype(temperature.dtype, jnp.integer)):
    raise TypeError(f"temperature.dtype={temperature.dtype} must be a float dtype")
  if temperature.ndim == 0:
    temperature = jnp.broadcast_to(temperature, (batch,))
  elif temperature.shape != (batch,):
    raise ValueError(
        f"temperature must be a scalar or have shape [B]=({batch},), got "
        f"temperature.shape={tuple(temperature.shape)}")
  if _is_concrete(temperature):
    t = np.asarray(temperature, dtype=np.float32)
    bad = np.isnan(t) | (t < 0)
    if bad.any():
      i = int(np.argmax(bad))
      raise ValueError(
          f"temperature[{i}]={t[i]} must be >= 0 (0 means greedy); "
          f"{int(bad.sum())} row(s) invalid")
  return jnp.asarray(temperature, dtype=jnp.float32)


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


def check_backend_name(backend, names: tuple[str, ...]) -> None:
  if not isinstance(backend, str) or backend not in ("auto", *names):
    raise ValueError(f"{backend=} must be 'auto' or one of {names}")


def prepare(hidden, weight, key, *, temperature=1.0, weight_layout="vd",
            vocab_size=None, vocab_shards=1, row_offset=0) -> Problem:
  """Checks every argument and builds the canonical :class:`Problem`.

  ``vocab_shards`` and ``row_offset`` serve vocabulary- and batch-sharded
  callers (``flashsample_jax.sharding``): ``weight`` then holds one of
  ``vocab_shards`` equal vocabulary shards, ``vocab_size`` is the global
  logical vocabulary (default ``vocab_shards * weight_rows``), and ``hidden``
  holds the rows ``row_offset ...`` of the global batch.

  Raises:
    TypeError: an argument has the wrong type or dtype.
    ValueError: shapes disagree, or a static or concrete value is out of range.
  """
  if weight_layout not in WEIGHT_LAYOUTS:
    raise ValueError(f"{weight_layout=} must be one of {WEIGHT_LAYOUTS}")
  hidden = _check_float_array("hidden", hidden)
  weight = _check_float_array("weight", weight)
  batch, dim = hidden.shape
  if weight_layout == "vd":
    rows, wdim = weight.shape
  else:
    wdim, rows = weight.shape
  if wdim != dim:
    want = "[V, D]" if weight_layout == "vd" else "[D, V]"
    raise ValueError(
        f"weight.shape={tuple(weight.shape)} ({want} for {weight_layout=}) does "
        f"not match hidden.shape={tuple(hidden.shape)}: D={dim} vs {wdim}")
  if dim == 0 or rows == 0:
    raise ValueError(
        f"hidden.shape={tuple(hidden.shape)} and weight.shape="
        f"{tuple(weight.shape)} need D >= 1 and V >= 1")
  if (isinstance(vocab_shards, bool) or not isinstance(vocab_shards, (int, np.integer))
      or vocab_shards < 1):
    raise ValueError(f"{vocab_shards=} must be a Python int >= 1")
  vocab_shards = int(vocab_shards)
  total_rows = rows * vocab_shards
  if vocab_size is None:
    vocab_size = total_rows
  elif isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
    raise TypeError(f"vocab_size={vocab_size!r} must be a Python int or None")
  vocab_size = int(vocab_size)
  if not 1 <= vocab_size <= total_rows:
    shards = f" times {vocab_shards} vocabulary shards" if vocab_shards > 1 else ""
    raise ValueError(
        f"{vocab_size=} must be in [1, {total_rows}] (the rows of weight for "
        f"{weight_layout=}{shards})")
  if vocab_size >= 2**31:
    raise ValueError(f"{vocab_size=} must be < 2**31")
  k0, k1, per_row = key_words(key, batch)
  temp = _temperature(temperature, batch)
  if per_row:
    ctr_hi = jnp.zeros((batch,), jnp.uint32)
    ctr_lo = jnp.zeros((batch,), jnp.uint32)
  elif not isinstance(row_offset, (int, np.integer)):
    rows_ids = jnp.arange(batch, dtype=jnp.uint32) + _row_offset(row_offset)
    ctr_hi, ctr_lo = noise.mul_u32_wide(rows_ids, np.uint32(vocab_size))
  else:
    # A Python offset makes the counters constants of the program (numpy,
    # not jnp, which traces under jit), so no kernel computes them on every
    # call: one launch and its gap less on a GPU.
    _row_offset(row_offset)                                  # range check
    rows_ids = (np.arange(batch, dtype=np.uint64) + np.uint64(row_offset)) % np.uint64(2**32)
    ctr = rows_ids * np.uint64(vocab_size)                  # < 2**63: exact
    ctr_hi = jnp.asarray((ctr >> np.uint64(32)).astype(np.uint32))
    ctr_lo = jnp.asarray((ctr & np.uint64(0xFFFFFFFF)).astype(np.uint32))
  if not jax.config.jax_threefry_partitionable:
    raise NotImplementedError(
        "flashsample_jax reproduces jax.random with jax_threefry_partitionable="
        "True (the default since jax 0.5); it is False in this process")
  return Problem(
      hidden=hidden.astype(weight.dtype), weight=weight, k0=k0, k1=k1,
      ctr_hi=ctr_hi, ctr_lo=ctr_lo, temperature=temp, layout=weight_layout,
      vocab_size=vocab_size, per_row_keys=per_row, key=key,
      vocab_shards=vocab_shards, row_offset=row_offset)
