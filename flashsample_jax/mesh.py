"""Mesh axes: where a call sits in a vocabulary- and batch-sharded program.

Inside ``jax.shard_map``, :func:`flashsample_jax.sample` takes
``vocab_axis`` (``weight`` is this shard's contiguous slice of the
vocabulary) and ``batch_axis`` (``hidden`` holds this shard's rows). Each
shard scores its own rows with their GLOBAL vocabulary ids and noise
counters, then one collective combines the per-row candidates, so tokens
never depend on the number of shards (docs/design.md, "The exactness
contract").

The collective of plain sampling (:func:`combine_over_axis`): each shard
holds one candidate per row, an f32 score and an int32 id, 8 bytes. They are
packed into one ``int32 [B, 2]`` array (the score bitcast, so NaN payloads
and -0.0 survive) and all-gathered over the vocabulary axis into ``[n, B,
2]``, after which every device reduces the ``n`` candidates with the tie rule.
That is one collective of ``8 * n * B`` bytes per device, independent of V:
8 KiB at TP=4, B=256, against 128 MiB for an all-gather of bf16 ``[256,
128256]`` logits. Two dependent all-reduces (``pmax`` of the score, then
``pmin`` of the winning ids) move fewer bytes, but a decode-time collective
of a few KiB is latency-bound, so one beats two; a ``psum`` of one-hot
candidates moves twice the bytes. The gather uses ``to="invarying"``, so the
tokens are typed as replicated over the vocabulary axis and a ``shard_map``
with ``check_vma=True`` may leave that axis out of its ``out_specs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Union

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import rules

__all__ = ["AxisName", "MeshAxes", "combine_over_axis", "all_gather_invariant",
           "all_gather_tree"]

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
        "flashsample_jax.sample_sharded with global arrays and a mesh.") from None


def _index(axes: tuple[str, ...]):
  return lax.axis_index(axes if len(axes) > 1 else axes[0])


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """The mesh axes the vocabulary and the batch are sharded over (None: not
  sharded). Hashable, so it can be a static argument of ``jax.jit``."""

  vocab: tuple[str, ...] | None = None
  batch: tuple[str, ...] | None = None

  @classmethod
  def of(cls, vocab_axis=None, batch_axis=None) -> "MeshAxes":
    """Checks the user's ``vocab_axis``/``batch_axis`` (names, disjoint)."""
    vocab = _axes("vocab_axis", vocab_axis)
    batch = _axes("batch_axis", batch_axis)
    if vocab and batch and set(vocab) & set(batch):
      raise ValueError(
          f"vocab_axis={vocab!r} and batch_axis={batch!r} share the axes "
          f"{sorted(set(vocab) & set(batch))}; the vocabulary and the batch "
          "must be sharded over different mesh axes")
    return cls(vocab, batch)

  def vocab_shards(self) -> int:
    """Shards of the vocabulary in the enclosing ``shard_map`` (1 unsharded)."""
    return _bound_size("vocab_axis", self.vocab) if self.vocab else 1

  def batch_shard(self):
    """``(index, count)`` of this data-parallel shard (``(0, 1)`` unsharded;
    the index traced inside ``shard_map``)."""
    if not self.batch:
      return 0, 1
    size = _bound_size("batch_axis", self.batch)   # ValueError if unbound
    return _index(self.batch), size

  def check_weight(self, weight, weight_layout: str = "vd", weight_scale=None) -> None:
    """Refuses a ``weight`` (or a per-row ``weight_scale``) that is not
    sharded over the vocabulary axes.

    With ``vocab_axis`` each shard's ``weight`` must be its own slice of the
    vocabulary: a head replicated over the axis (``in_specs`` ``P()`` for
    it, or an array closed over) would be read as ``n`` slices of an ``n``
    times larger vocabulary, and ids up to ``n * V - 1`` come back. A
    ``[V]`` scale replicated beside a sharded head would scale every
    shard's rows by the first shard's scales. JAX's varying-manual-axes
    types tell: inside a ``shard_map`` with ``check_vma=True`` (its default)
    a value sharded over an axis is typed as varying over it. Under
    ``check_vma=False`` no value carries that information, and a replicated
    head cannot be told from a sharded one: the caller's ``in_specs`` are
    then trusted. Axes of size 1 are not checked (replicated and sharded are
    the same there); a scalar scale is one value for every shard. Nor can
    the types tell the order of the axes: a scale sharded ``P(("b", "a"))``
    beside a head sharded ``P(("a", "b"))`` varies over the same axes and
    passes, though each shard then holds another shard's scales; the
    ``in_specs`` must give both the same entry (README, "Vocabulary-parallel
    sampling").

    Raises:
      ValueError: ``weight`` or a ``[V]`` ``weight_scale`` is typed as
        replicated over a vocabulary axis of size > 1.
    """
    if not self.vocab or not _varying_axes(_index(self.vocab)):
      return                         # check_vma=False: no variance is tracked
    shown = self.vocab[0] if len(self.vocab) == 1 else self.vocab
    spec = (f"P({shown!r}, None)" if weight_layout == "vd"
            else f"P(None, {shown!r})")
    varying, missing = self._not_varying(weight)
    if missing:
      raise ValueError(
          f"weight is replicated over vocab_axis={shown!r} (weight of shape "
          f"{tuple(weight.shape)} varies over {sorted(varying) or 'no mesh axis'}, "
          f"not over {list(missing)}), but with vocab_axis each shard's weight must "
          "be its own contiguous slice of the vocabulary, or ids beyond the "
          "vocabulary come back. Shard the head over the axis (in_specs "
          f"{spec} for {weight_layout=}), or drop vocab_axis to sample from the "
          "whole head on every shard.")
    if weight_scale is None or jnp.ndim(weight_scale) == 0:
      return
    varying, missing = self._not_varying(weight_scale)
    if missing:
      raise ValueError(
          f"weight_scale is replicated over vocab_axis={shown!r} (weight_scale of "
          f"shape {tuple(weight_scale.shape)} varies over "
          f"{sorted(varying) or 'no mesh axis'}, not over {list(missing)}), but each "
          "shard's weight rows need their own scales. Shard it like the head "
          f"(in_specs P({shown!r})), or pass a scalar scale.")

  def _not_varying(self, x):
    """``(axes x varies over, vocabulary axes of size > 1 it does not)``."""
    varying = _varying_axes(x)
    missing = tuple(a for a in self.vocab if a not in varying)
    if missing and int(lax.axis_size(missing)) == 1:
      missing = ()
    return varying, missing

  def vocab_offset(self, weight_rows: int):
    """Global vocabulary id of this shard's first weight row (0 unsharded)."""
    return _index(self.vocab) * weight_rows if self.vocab else 0


def _varying_axes(x) -> frozenset:
  """Mesh axes ``x`` is typed as varying over (empty without check_vma)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)   # jax >= 0.10
  if mat is not None and hasattr(mat, "varying"):
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def all_gather_invariant(x, axes: tuple[str, ...]):
  """``all_gather`` of ``x`` over mesh ``axes`` into a new leading axis.

  Inside ``shard_map``; the result is typed as replicated over ``axes``
  (``to="invarying"``), so ``out_specs`` may leave them out. With
  ``check_vma=True`` a value not yet varying over an axis is first cast to
  varying (all_gather needs that); ``check_vma=False`` tracks no variance.
  """
  vma = _varying_axes(x)
  missing = tuple(a for a in axes if a not in vma)
  if vma and missing:
    x = lax.pcast(x, missing, to="varying")
  return lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=0, to="invarying")


def all_gather_tree(tree, axes: tuple[str, ...]):
  """:func:`all_gather_invariant` of every leaf of ``tree``, as one collective.

  The leaves (32-bit: f32, int32, uint32) are bit-cast to int32 and packed
  into one vector, gathered once and unpacked: a small exchange costs a
  collective's launch and latency, not its bytes, so a state of many leaves
  should pay that once, not once per leaf. Bit casts are exact, so the
  result equals the leaf-by-leaf gather. Other dtypes: leaf by leaf.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if any(jnp.dtype(a.dtype).itemsize != 4 for a in leaves):
    return jax.tree.map(lambda a: all_gather_invariant(a, axes), tree)
  flat = [lax.bitcast_convert_type(a, jnp.int32).reshape(-1)
          if a.dtype != jnp.int32 else a.reshape(-1) for a in leaves]
  gathered = all_gather_invariant(jnp.concatenate(flat), axes)        # [n, total]
  out, start = [], 0
  for a in leaves:
    part = gathered[:, start:start + a.size].reshape((-1, *a.shape))
    start += a.size
    out.append(part if a.dtype == jnp.int32 else lax.bitcast_convert_type(part, a.dtype))
  return jax.tree.unflatten(treedef, out)


def combine_over_axis(score, index, axis_name: AxisName):
  """Combines per-shard ``(score, id)`` candidates across a mesh axis.

  Call inside ``shard_map``. One all-gather of ``8 * B`` bytes per shard,
  then a local reduction by the tie rule, so every shard gets the same
  result.

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
  gathered = all_gather_invariant(packed, axes)                # [n, B, 2]
  scores = lax.bitcast_convert_type(gathered[..., 0], jnp.float32)
  return rules.first_best(scores, gathered[..., 1], 0)
