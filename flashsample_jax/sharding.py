"""Vocabulary-parallel sampling from global arrays: :func:`sample_sharded`.

For callers that do not write ``shard_map`` themselves: pass the global
arrays and a mesh, and this wraps :func:`flashsample_jax.api.run` in a
``shard_map`` (inside your own ``shard_map``, call
:func:`flashsample_jax.sample` with ``vocab_axis``/``batch_axis`` instead;
:mod:`flashsample_jax.mesh` describes the collective). The arguments are
checked once, on the global arrays; each shard then receives its part of the
checked problem. Tokens never depend on the number of shards, on the
data-parallel degree, or on the backend: they equal single-device
:func:`flashsample_jax.sample` and :func:`flashsample_jax.reference.sample`
for the same key.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from flashsample_jax import api, backends, controls as _controls, mesh as _mesh, problem
from flashsample_jax.params import CONTROL_NAMES
from flashsample_jax.mesh import AxisName, combine_over_axis  # noqa: F401  (re-exported)

__all__ = ["AxisName", "sample_sharded", "combine_over_axis"]


def _mesh_axes_size(mesh, name: str, axes: tuple[str, ...] | None) -> int:
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


def _problem_specs(p: problem.Problem, axes: _mesh.MeshAxes) -> problem.Problem:
  """``p``'s structure with the PartitionSpec of each array: rows split over
  the batch axes, the weight's vocabulary over the vocabulary axes."""
  bspec, vspec = _spec(axes.batch), _spec(axes.vocab)
  row = P(bspec)
  return dataclasses.replace(
      p, hidden=P(bspec, None),
      weight=P(vspec, None) if p.layout == "vd" else P(None, vspec),
      k0=row, k1=row, ctr_hi=row, ctr_lo=row, temperature=row,
      key_data=P(bspec, None) if p.per_row_keys else P(),
      weight_scale=(None if p.weight_scale is None else
                    P() if p.weight_scale.ndim == 0 else P(vspec)))


def _controls_specs(c: _controls.Controls, axes: _mesh.MeshAxes) -> _controls.Controls:
  """``c``'s structure with the PartitionSpec of each array: per-row
  controls split over the batch axes, the bias and soft-cap replicated."""
  bspec = _spec(axes.batch)
  row = lambda x: None if x is None else P(bspec)
  return dataclasses.replace(
      c, top_k=row(c.top_k), top_p=row(c.top_p), min_p=row(c.min_p),
      logit_bias=None if c.logit_bias is None else P(),
      allowed_mask=None if c.allowed_mask is None else P(bspec, None),
      softcap=None if c.softcap is None else P(),
      repetition_penalty=row(c.repetition_penalty),
      presence_penalty=row(c.presence_penalty),
      frequency_penalty=row(c.frequency_penalty),
      prompt_ids=None if c.prompt_ids is None else P(bspec, None),
      output_ids=None if c.output_ids is None else P(bspec, None))


@functools.partial(jax.jit, static_argnames=("mesh", "backend", "axes"))
def _sample_sharded(p, c, *, mesh, backend, axes: _mesh.MeshAxes):
  p_spec, c_spec = _problem_specs(p, axes), _controls_specs(c, axes)
  place = _placer(mesh, (axes.vocab or ()) + (axes.batch or ()))
  p = jax.tree.map(place, p, p_spec)
  c = jax.tree.map(place, c, c_spec)
  bspec = _spec(axes.batch)
  tok_spec = P(bspec) if c.num_samples is None else P(None, bspec)
  out_spec = tok_spec
  if c.returns_output:
    top_spec = P(bspec, None) if c.top_logprobs else None
    lp_spec = tok_spec if c.return_logprobs else None
    kept_spec = P(bspec, None) if c.return_kept else None
    row_spec = P(bspec)
    out_spec = _controls.SampleOutput(
        tok_spec, lp_spec, lp_spec, lp_spec, top_spec, top_spec,
        logprob_raw=tok_spec if c.return_raw_logprobs else None,
        entropy=row_spec if c.return_entropy else None,
        entropy_truncated=row_spec if c.return_entropy else None,
        kept_ids=kept_spec, kept_count=row_spec if c.return_kept else None)
  n_vocab = _mesh_axes_size(mesh, "vocab_axis", axes.vocab)

  def per_shard(p, c):
    # Each batch shard holds its own rows' counters (split from the global
    # ones), not those from row_base 0 that prepare saw.
    row_base = None if axes.batch else p.row_base
    return api.run(dataclasses.replace(p, vocab_shards=n_vocab, row_base=row_base), c,
                   backend=backend, axes=axes)

  # check_vma=False: the xla backend is vma-clean (tested with
  # check_vma=True inside a user's shard_map), but a kernel call's outputs
  # carry no variance typing. Replication of the tokens over the vocab axis
  # holds by construction (every shard reduces the same gathered
  # candidates), and tests check it.
  return jax.shard_map(per_shard, mesh=mesh, in_specs=(p_spec, c_spec),
                       out_specs=out_spec, check_vma=False)(p, c)


def sample_sharded(hidden, weight, key, params=None, *, mesh, vocab_axis: AxisName,
                   batch_axis: AxisName | None = None, temperature=1.0,
                   weight_layout="vd", vocab_size=None, weight_scale=None,
                   backend="auto", **controls):
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
  for the same key, whatever the mesh shape. Checkified (traced checks on),
  the error comes back sharded over the mesh; on Explicit axes place it
  replicated (``jax.device_put`` to ``NamedSharding(mesh, P())``) before
  ``get`` or ``throw``, which otherwise fail inside JAX.

  Args:
    hidden: ``[B, D]`` hidden states (global).
    weight: ``[V, D]`` (layout "vd") or ``[D, V]`` ("dv"), global; ``V``
      must be divisible by the size of ``vocab_axis`` (pad the head and pass
      ``vocab_size``).
    key: as in :func:`flashsample_jax.sample`; a ``[B]`` key array is split
      with the batch.
    params: a :class:`flashsample_jax.SamplingParams` holding the controls
      (and the temperature), in place of the keywords, as in
      :func:`flashsample_jax.sample`.
    mesh: the ``jax.sharding.Mesh`` (Auto or Explicit axes), or its
      ``AbstractMesh`` while that mesh is set (``jax.set_mesh``).
    vocab_axis: the mesh axis name (or tuple of names) ``weight``'s
      vocabulary dimension is sharded over.
    batch_axis: optional mesh axis name(s) for the batch (data parallel); ``B``
      must be divisible by its size.
    temperature: a float or a ``[B]`` array; ``0`` makes a row greedy.
    weight_layout: ``"vd"`` or ``"dv"``.
    vocab_size: the global logical vocabulary when ``weight`` has padding
      rows. Default: ``V``.
    weight_scale: for a quantized ``weight``: f32 ``[V]`` (global; split
      with the vocabulary) or a scalar, as in :func:`flashsample_jax.sample`.
    backend: ``"auto"``, one of :data:`flashsample_jax.BACKENDS` or a
      backend instance; runs on each shard (``"auto"`` picks it for one
      shard's part of the head and batch, as :func:`flashsample_jax.sample`
      inside ``shard_map`` does).
    **controls: the sampling controls of :func:`flashsample_jax.sample`
      (``top_k``, ``top_p``, ``min_p``, ``logit_bias``, ``allowed_mask``,
      ``softcap``, the penalties and histories, ``num_samples``,
      ``return_logprobs``, ``top_logprobs``); per-row ones are
      split with the batch.

  Returns:
    As :func:`flashsample_jax.sample`: int32 token ids ``[B]`` (``[S, B]``,
    or a ``SampleOutput``), sharded over ``batch_axis`` and replicated over
    ``vocab_axis``.

  Raises:
    TypeError: a wrong type or dtype, a keyword that is no control, or
      controls given both in ``params`` and as keywords.
    ValueError: an axis name not in ``mesh``, overlapping axes, ``V`` or
      ``B`` not divisible by the axis sizes, an ``AbstractMesh`` that is not
      the one set, and everything :func:`flashsample_jax.sample` rejects.
  """
  _check_mesh(mesh)
  controls = _control_keywords(params, temperature, controls)
  temperature = controls.pop("temperature")
  axes = _mesh.MeshAxes.of(vocab_axis, batch_axis)
  if axes.vocab is None:
    raise ValueError("vocab_axis=None: sample_sharded needs the mesh axis the "
                     "vocabulary is sharded over")
  n_vocab = _mesh_axes_size(mesh, "vocab_axis", axes.vocab)
  n_batch = _mesh_axes_size(mesh, "batch_axis", axes.batch)
  # Checked once, on the global arrays: messages speak of the user's arrays.
  num_samples = controls.pop("num_samples", None)
  return_logprobs = controls.pop("return_logprobs", False)
  p = problem.prepare(hidden, weight, key, temperature=temperature,
                      weight_layout=weight_layout, vocab_size=vocab_size,
                      weight_scale=weight_scale)
  c = _controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size,
                                 rows=p.weight_rows, num_samples=num_samples,
                                 return_logprobs=return_logprobs, **controls)
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
    return api.empty_result(c)
  impl = backends.resolve(backend, _one_shard(p, n_vocab, n_batch), c)
  if isinstance(mesh, jax.sharding.Mesh):
    p, c = _on_mesh(p, c, mesh, axes)
  return _sample_sharded(p, c, mesh=mesh, backend=impl, axes=axes)


def _check_mesh(mesh) -> None:
  """A ``Mesh``, or an ``AbstractMesh`` that is the one set: ``shard_map``
  over an abstract mesh needs its devices from ``jax.set_mesh``."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    if jax.sharding.get_abstract_mesh() != mesh:
      raise ValueError(
          "mesh is an AbstractMesh that is not the one set: pass the "
          "jax.sharding.Mesh, or call inside `with jax.set_mesh(mesh):`")
    return
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")


def _control_keywords(params, temperature, controls: dict) -> dict:
  """The call's controls (the temperature among them) from ``params`` or the
  keywords, as :func:`flashsample_jax.sample` takes them."""
  unknown = sorted(set(controls) - set(CONTROL_NAMES))
  if unknown:
    raise TypeError(f"sample_sharded() got unexpected keyword arguments {unknown}; "
                    f"the controls are {list(CONTROL_NAMES)}")
  return dict(api.settings(params, {**controls, "temperature": temperature}))


def _one_shard(p: problem.Problem, n_vocab: int, n_batch: int) -> problem.Problem:
  """``p`` as one shard holds it, as shapes: its part of the head's rows and
  of the batch. The backend is chosen for what each shard runs (an 8-bit
  head's slice may be too short for a kernel that the whole head suits)."""
  def part(x, dim: int, n: int):
    if x is None or x.ndim <= dim:
      return x
    shape = list(x.shape)
    shape[dim] //= n
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
  vocab_dim = 0 if p.layout == "vd" else 1
  rows = {name: part(getattr(p, name), 0, n_batch)
          for name in ("hidden", "k0", "k1", "ctr_hi", "ctr_lo", "temperature")}
  if p.per_row_keys:
    rows["key_data"] = part(p.key_data, 0, n_batch)
  return dataclasses.replace(p, weight=part(p.weight, vocab_dim, n_vocab),
                             weight_scale=part(p.weight_scale, 0, n_vocab),
                             vocab_shards=n_vocab, **rows)


def _on_mesh(p, c, mesh, axes: _mesh.MeshAxes):
  """``p`` and ``c``'s concrete arrays that live on other devices than the
  mesh's, put in their layout on it (an array committed to one device fails
  the jitted call's sharding otherwise); traced ones are left to the caller's
  jit, and arrays already on the mesh to its sharding constraint."""
  devices = set(mesh.devices.flat)
  def put(x, spec):
    if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        and x.sharding.device_set != devices):
      return jax.device_put(x, NamedSharding(mesh, spec))
    return x
  return (jax.tree.map(put, p, _problem_specs(p, axes)),
          jax.tree.map(put, c, _controls_specs(c, axes)))
