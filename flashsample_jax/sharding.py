"""Vocabulary-parallel (and data-parallel) sampling on a device mesh.

Two ways in:

* Inside your own ``jax.shard_map``: call ``sample(hidden, weight, key,
  vocab_axis="tp")`` with ``weight`` the local vocabulary shard. Each shard
  scores its own rows with their GLOBAL vocabulary ids and noise counters
  (shard index x local rows + local id), then one collective of O(B) bytes
  combines the per-row ``(score, id)`` candidates (with sampling controls,
  the per-row streaming states: O(B x 128) bytes, and the rare uncertified
  rows gather the full logits); every shard returns the same tokens. Add ``batch_axis="dp"`` when ``hidden`` (and per-row keys and
  a ``[B]`` temperature) are the local rows of a batch-sharded decode step.
* Without ``shard_map``: :func:`sample_sharded` takes the global arrays and
  a ``Mesh`` and wraps the above in a ``shard_map`` for you.

Tokens never depend on the number of shards, on the data-parallel degree, or
on the backend: they equal single-device :func:`flashsample_jax.sample` and
:func:`flashsample_jax.reference.sample` for the same key (DESIGN.md
section 1: noise is keyed by global coordinates).

The collective. Each shard holds one candidate per row: f32 score and int32
id, 8 bytes. They are packed into one ``int32 [B, 2]`` array (the score
bitcast, so NaN payloads and -0.0 survive) and all-gathered over the vocab
axis into ``[n, B, 2]``, after which every device reduces the ``n``
candidates locally with :func:`flashsample_jax._core.reduce_candidates`
(NaN beats numbers, ties go to the lowest id). That is one collective moving
``8 * n * B`` bytes per device, independent of V: 8 KiB at TP=4, B=256,
against 128 MiB for an all-gather of bf16 ``[256, 128256]`` logits.
Alternatives considered: ``pmax`` of the score then ``pmin`` of the
winning ids moves fewer bytes (``8 * B``) but needs two dependent all-reduces,
and a decode-time collective of a few KiB is latency-bound, so one collective
beats two; a ``psum`` of one-hot-placed candidates works too but moves about
twice the bytes of the all-gather. The gather uses ``to="invarying"`` so the
tokens are typed as replicated over the vocab axis: a ``shard_map`` with
``check_vma=True`` may leave that axis out of its ``out_specs``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from flashsample_jax import _core, _validate

__all__ = ["AxisName", "sample_sharded", "combine_over_axis"]

# A mesh axis name or a tuple of them (the shard index is then the
# row-major linear index over those axes, as in ``PartitionSpec(("a", "b"))``).
AxisName = Union[str, tuple[str, ...]]


def _axes(name: str, value) -> tuple[str, ...] | None:
  """``value`` as a tuple of axis names (None stays None); checks types."""
  if value is None:
    return None
  if isinstance(value, str):
    return (value,)
  if (isinstance(value, Sequence) and len(value) > 0
      and all(isinstance(a, str) for a in value)):
    axes = tuple(value)
    if len(set(axes)) != len(axes):
      raise ValueError(f"{name}={value!r} names an axis twice")
    return axes
  raise ValueError(
      f"{name}={value!r} must be a mesh axis name (str) or a non-empty tuple "
      "of names")


def _check_disjoint(vocab_axes, batch_axes) -> None:
  if vocab_axes and batch_axes and set(vocab_axes) & set(batch_axes):
    raise ValueError(
        f"vocab_axis={vocab_axes!r} and batch_axis={batch_axes!r} share the "
        f"axes {sorted(set(vocab_axes) & set(batch_axes))}; the vocabulary "
        "and the batch must be sharded over different mesh axes")


def _bound_size(name: str, axes: tuple[str, ...]) -> int:
  """Size of ``axes`` in the enclosing ``shard_map``; ValueError if unbound."""
  try:
    return int(lax.axis_size(axes))
  except NameError as e:
    shown = axes[0] if len(axes) == 1 else axes
    raise ValueError(
        f"{name}={shown!r} is not an axis of the enclosing shard_map ({e}). "
        f"Pass {name} only inside jax.shard_map over a mesh with that axis "
        "(weight being the local shard), or call "
        "flashsample_jax.sharding.sample_sharded with global arrays and a "
        "mesh.") from None


def _shard_index(axes: tuple[str, ...]):
  return lax.axis_index(axes if len(axes) > 1 else axes[0])


def combine_over_axis(score, index, axis_name: AxisName):
  """Combines per-shard ``(score, id)`` candidates across a mesh axis.

  Call inside ``shard_map``. One all-gather of ``8 * B`` bytes per shard,
  then a local reduce with the backends' rule (NaN beats numbers, the larger
  score wins, ties go to the lowest id), so every shard gets the same result.

  Args:
    score: f32 ``[B]`` best score of this shard's rows.
    index: int32 ``[B]`` global id of that score.
    axis_name: the mesh axis (or tuple of axes) the vocabulary is sharded on.

  Returns:
    ``(score f32 [B], index int32 [B])``, the best over every shard,
    replicated over ``axis_name``.
  """
  axes = _axes("axis_name", axis_name)
  packed = jnp.stack(
      [lax.bitcast_convert_type(score.astype(jnp.float32), jnp.int32),
       index.astype(jnp.int32)], axis=-1)                       # [B, 2]
  gathered = _core.all_gather_invariant(packed, axes)          # [n, B, 2]
  scores = lax.bitcast_convert_type(gathered[..., 0], jnp.float32)
  return _core.reduce_candidates(scores, gathered[..., 1], axis=0)


def check_axes(vocab_axis, batch_axis):
  """``(vocab_axes, batch_axes)`` as tuples of names (or None); checks them."""
  vocab_axes = _axes("vocab_axis", vocab_axis)
  batch_axes = _axes("batch_axis", batch_axis)
  _check_disjoint(vocab_axes, batch_axes)
  return vocab_axes, batch_axes


def axes_size(axes) -> int:
  """Size of the bound mesh ``axes`` (1 for None)."""
  return _bound_size("axis", axes) if axes else 1


def vocab_offset(p: _validate.Problem, vocab_axes):
  """Global vocabulary id of this shard's first weight row (0 unsharded)."""
  return _shard_index(vocab_axes) * p.weight_rows if vocab_axes else 0


def shard_problem(hidden, weight, key, temperature, *, weight_layout, vocab_size,
                  vocab_axes, batch_axes) -> _validate.Problem:
  """The validated problem of this shard (the whole problem without axes)."""
  shards = _bound_size("vocab_axis", vocab_axes) if vocab_axes else 1
  row_offset = 0
  if batch_axes:
    _bound_size("batch_axis", batch_axes)
    row_offset = _shard_index(batch_axes) * hidden.shape[0]
  return _validate.prepare(hidden, weight, key, temperature=temperature,
                           weight_layout=weight_layout, vocab_size=vocab_size,
                           vocab_shards=shards, row_offset=row_offset)


# -- the convenience path: global arrays and a mesh ---------------------------


def _mesh_axes_checked(mesh, name: str, axes: tuple[str, ...] | None) -> int:
  if axes is None:
    return 1
  unknown = [a for a in axes if a not in mesh.axis_names]
  if unknown:
    shown = axes[0] if len(axes) == 1 else axes
    raise ValueError(
        f"{name}={shown!r}: {unknown} not among the mesh's axis names "
        f"{tuple(mesh.axis_names)}")
  size = 1
  for a in axes:
    size *= mesh.shape[a]
  return size


def _placer(mesh, used_axes: tuple[str, ...]):
  """Returns ``place(x, spec)`` that puts ``x`` in ``NamedSharding(mesh, spec)``.

  Explicit mesh axes need ``jax.sharding.reshard`` (``shard_map`` refuses
  mismatched inputs); Auto axes take a sharding constraint. Either is a no-op
  when ``x`` is already laid out so, as it should be for the weight.
  """
  types = {mesh.axis_types[mesh.axis_names.index(a)] for a in used_axes}
  if types == {AxisType.Explicit}:
    return lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec))
  if AxisType.Explicit in types:
    raise ValueError(
        f"the mesh axes {used_axes} mix Explicit and Auto axis types "
        f"({mesh.axis_types}); use axes of one type")
  return lambda x, spec: lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _spec(axes: tuple[str, ...] | None):
  if axes is None:
    return None
  return axes if len(axes) > 1 else axes[0]


def _control_spec(name: str, value, bspec):
  """How a control array is laid out over the mesh (None: not an array)."""
  if not hasattr(value, "ndim"):
    return None
  if name == "allowed_mask":
    return P(bspec, None)
  if name in ("top_k", "top_p", "min_p") and value.ndim == 1:
    return P(bspec)
  return P()


@functools.partial(
    jax.jit, static_argnames=("mesh", "weight_layout", "vocab_size", "backend",
                              "vocab_axes", "batch_axes", "statics"))
def _sample_sharded(hidden, weight, key, temperature, arrays, *, mesh, weight_layout,
                    vocab_size, backend, vocab_axes, batch_axes, statics):
  from flashsample_jax import api
  bspec, vspec = _spec(batch_axes), _spec(vocab_axes)
  w_spec = P(vspec, None) if weight_layout == "vd" else P(None, vspec)
  h_spec = P(bspec, None)
  k_spec = P(bspec) if _per_row_key(key) else P()
  t_spec = P(bspec) if temperature.ndim == 1 else P()
  a_spec = {n: _control_spec(n, a, bspec) for n, a in arrays.items()}
  place = _placer(mesh, (vocab_axes or ()) + (batch_axes or ()))
  args = (place(hidden, h_spec), place(weight, w_spec), place(key, k_spec),
          place(temperature, t_spec),
          {n: place(a, a_spec[n]) for n, a in arrays.items()})
  kw = dict(statics)
  s = kw.get("num_samples")
  tok_spec = P(bspec) if s is None else P(None, bspec)
  out_spec = tok_spec
  if kw.get("return_logprobs"):
    from flashsample_jax.controls import SampleOutput
    out_spec = SampleOutput(tok_spec, tok_spec, tok_spec, tok_spec)

  def per_shard(h, w, k, t, arrays):
    return api.sample(h, w, k, temperature=t, weight_layout=weight_layout,
                      vocab_size=vocab_size, backend=backend,
                      vocab_axis=vocab_axes, batch_axis=batch_axes, **arrays, **kw)

  # check_vma=False: the xla backend is vma-clean (tested with
  # check_vma=True inside a user's shard_map), but a pallas_call's outputs
  # carry no variance typing. Replication of the tokens over the vocab axis
  # holds by construction (every shard reduces the same gathered
  # candidates), and tests check it.
  return jax.shard_map(per_shard, mesh=mesh,
                       in_specs=(h_spec, w_spec, k_spec, t_spec, a_spec),
                       out_specs=out_spec, check_vma=False)(*args)


def _per_row_key(key) -> bool:
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim == 1
  return key.ndim == 2


def sample_sharded(hidden, weight, key, *, mesh, vocab_axis: AxisName,
                   batch_axis: AxisName | None = None, temperature=1.0,
                   weight_layout="vd", vocab_size=None, backend="auto",
                   **controls):
  """:func:`flashsample_jax.sample` over a vocabulary-sharded LM head.

  For callers that do not write ``shard_map``: pass the GLOBAL arrays (jitted
  or not) and the mesh. ``weight`` should already be sharded over the
  vocabulary (``NamedSharding(mesh, P(vocab_axis, None))`` for layout "vd",
  ``P(None, vocab_axis)`` for "dv"); then nothing of size ``V`` moves between
  devices, only one O(B) all-gather of candidates (see the module docstring).
  Arrays laid out otherwise are resharded to that layout first (correct, but
  the weight then moves). ``hidden``, per-row keys and a ``[B]`` temperature
  are split over ``batch_axis`` (replicated if it is None).

  Tokens equal single-device :func:`flashsample_jax.sample` and the reference
  for the same key, whatever the mesh shape.

  Args:
    hidden: ``[B, D]`` hidden states (global).
    weight: ``[V, D]`` (layout "vd") or ``[D, V]`` ("dv"), global; ``V``
      must be divisible by the size of ``vocab_axis`` (pad the head and pass
      ``vocab_size``).
    key: as in :func:`flashsample_jax.sample`; a ``[B]`` key array is split
      with the batch.
    mesh: the ``jax.sharding.Mesh`` (Auto or Explicit axes).
    vocab_axis: the mesh axis name (or tuple of names) ``weight``'s
      vocabulary dimension is sharded over.
    batch_axis: optional mesh axis name(s) for the batch (data parallel); ``B``
      must be divisible by its size.
    temperature: a float or a ``[B]`` array; ``0`` makes a row greedy.
    weight_layout: ``"vd"`` or ``"dv"``.
    vocab_size: the global logical vocabulary when ``weight`` has padding
      rows. Default: ``V``.
    backend: ``"auto"`` or one of :data:`flashsample_jax.BACKENDS`; runs on
      each shard.
    **controls: the sampling controls of :func:`flashsample_jax.sample`
      (``top_k``, ``top_p``, ``min_p``, ``logit_bias``, ``allowed_mask``,
      ``softcap``, ``num_samples``, ``return_logprobs``); per-row ones are
      split with the batch.

  Returns:
    As :func:`flashsample_jax.sample`: int32 token ids ``[B]`` (``[S, B]``,
    or a ``SampleOutput``), sharded over ``batch_axis`` and replicated over
    ``vocab_axis``.

  Raises:
    TypeError: a wrong type or dtype.
    ValueError: an axis name not in ``mesh``, overlapping axes, ``V`` or
      ``B`` not divisible by the axis sizes, and everything
      :func:`flashsample_jax.sample` rejects.
  """
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  vocab_axes = _axes("vocab_axis", vocab_axis)
  if vocab_axes is None:
    raise ValueError("vocab_axis=None: sample_sharded needs the mesh axis the "
                     "vocabulary is sharded over")
  batch_axes = _axes("batch_axis", batch_axis)
  _check_disjoint(vocab_axes, batch_axes)
  n_vocab = _mesh_axes_checked(mesh, "vocab_axis", vocab_axes)
  n_batch = _mesh_axes_checked(mesh, "batch_axis", batch_axes)
  # Global checks first, for messages about the user's own arrays.
  p = _validate.prepare(hidden, weight, key, temperature=temperature,
                        weight_layout=weight_layout, vocab_size=vocab_size)
  _validate.check_backend_name(backend, _backend_names())
  from flashsample_jax import controls as _controls
  _controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size,
                             rows=p.weight_rows, **controls)
  if p.weight_rows % n_vocab:
    dim = 0 if weight_layout == "vd" else 1
    raise ValueError(
        f"weight.shape={tuple(weight.shape)}: V={p.weight_rows} (axis {dim} for "
        f"{weight_layout=}) must be divisible by the size {n_vocab} of "
        f"vocab_axis={vocab_axis!r}; pad the head to a multiple and pass "
        "vocab_size")
  if p.batch % n_batch:
    raise ValueError(
        f"hidden.shape={tuple(hidden.shape)}: B={p.batch} must be divisible by "
        f"the size {n_batch} of batch_axis={batch_axis!r}")
  if p.batch == 0:
    from flashsample_jax import api
    return api.sample(hidden, weight, key, temperature=temperature,
                      weight_layout=weight_layout, vocab_size=vocab_size,
                      backend=backend, **controls)
  if isinstance(temperature, (int, float)):
    temperature = jnp.float32(temperature)
  temperature = jnp.asarray(temperature)
  arrays = {n: v for n, v in controls.items() if hasattr(v, "ndim")}
  statics = tuple(sorted((n, v) for n, v in controls.items()
                         if n not in arrays and v is not None))
  return _sample_sharded(hidden, weight, key, temperature, arrays, mesh=mesh,
                         weight_layout=weight_layout, vocab_size=p.vocab_size,
                         backend=backend, vocab_axes=vocab_axes,
                         batch_axes=batch_axes, statics=statics)


def _backend_names() -> tuple[str, ...]:
  from flashsample_jax.api import BACKENDS
  return BACKENDS
