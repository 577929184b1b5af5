"""Public entry point: :func:`sample`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from flashsample_jax import _validate, controls as _controls, xla_backend

# Every backend name, in the order ``backend="auto"`` tries them (measured on
# an H200 with mosaic v3: the kernel is the faster of the two at every B up
# to 256; benchmarks/PERF_LOG.md). Tests and benchmarks iterate over it.
Backend = Literal["mosaic", "xla"]
BACKENDS: tuple[str, ...] = get_args(Backend)


def _mosaic_module():
  # Imported lazily: the kernel module pulls in Pallas Mosaic GPU, which a
  # CPU-only user of the xla backend never needs to import.
  from pallas_kernels import mosaic_sm90
  return mosaic_sm90


def _mosaic_controls_module():
  from pallas_kernels import mosaic_controls
  return mosaic_controls


def _check_supported(name: str, p: _validate.Problem,
                     c: _controls.Controls | None = None) -> None:
  """Raises NotImplementedError if backend ``name`` cannot run ``p`` here."""
  if name == "mosaic":
    if c is not None and c.active:
      _mosaic_controls_module().check_supported(p, c)
    else:
      _mosaic_module().check_supported(p)
  elif name != "xla":
    raise AssertionError(name)  # internal: names come from BACKENDS


def _candidates(name: str, p: _validate.Problem, *, vocab_offset=0):
  if name == "mosaic":
    return _mosaic_module().candidates(p, vocab_offset=vocab_offset)
  return xla_backend.candidates(p, vocab_offset=vocab_offset)


# ``num_samples`` alone (temperature only, no truncation, transforms or
# log-probs) on the mosaic backend: the S samples of B rows become S * B
# rows of one plain launch while they fit the fast kernels (N <= 128): row
# ``s * B + b`` is sample ``s`` of row ``b``, with its own noise counters
# (DESIGN.md section 1), so the tokens are the same. The controls kernel
# pads B to 64 rows and evaluates every sample's noise for each (H200, S,
# B=1, S=4: 606 us, twice XLA's 302; PERF_LOG).
SAMPLES_AS_ROWS_MAX = 128


def _samples_as_rows(p: _validate.Problem, c: _controls.Controls, *,
                     vocab_offset, vocab_axes, global_batch: int):
  """Tokens ``[S, B]`` of a samples-only call from one plain launch."""
  s, b = c.samples, p.batch
  hi, lo = xla_backend._sample_counters(p, s, global_batch)      # [B, S]
  by_sample = lambda a: a.T.reshape(s * b)                       # row s * B + b
  repeat = lambda a: jnp.tile(a, s)
  q = dataclasses.replace(
      p, hidden=jnp.tile(p.hidden, (s, 1)), k0=repeat(p.k0), k1=repeat(p.k1),
      ctr_hi=by_sample(hi), ctr_lo=by_sample(lo),
      temperature=repeat(p.temperature))
  score, token = _candidates("mosaic", q, vocab_offset=vocab_offset)
  if vocab_axes:
    from flashsample_jax import sharding
    score, token = sharding.combine_over_axis(score, token, vocab_axes)
  return token.reshape(s, b)


def resolve_backend(backend: str, p: _validate.Problem,
                    c: _controls.Controls | None = None) -> str:
  """The backend that will run ``p``: ``backend`` itself, or auto's pick."""
  _validate.check_backend_name(backend, BACKENDS)
  if backend != "auto":
    _check_supported(backend, p, c)
    return backend
  for name in BACKENDS:
    try:
      _check_supported(name, p, c)
    except NotImplementedError:
      continue
    return name
  raise AssertionError("the xla backend supports every valid problem")


def _problem(hidden, weight, key, temperature, ctl, *, weight_layout, vocab_size,
             num_samples, return_logprobs, vocab_axes=None, batch_axes=None):
  """Validated ``(Problem, Controls)``; with mesh axes, this shard's part."""
  from flashsample_jax import sharding
  p = sharding.shard_problem(hidden, weight, key, temperature,
                             weight_layout=weight_layout, vocab_size=vocab_size,
                             vocab_axes=vocab_axes, batch_axes=batch_axes)
  c = _controls.prepare_controls(
      batch=p.batch, vocab_size=p.vocab_size, rows=p.weight_rows * p.vocab_shards,
      num_samples=num_samples, return_logprobs=return_logprobs, **ctl)
  return p, c


def which_backend(hidden, weight, key, *, backend="auto", temperature=1.0,
                  weight_layout="vd", vocab_size=None, vocab_axis=None,
                  batch_axis=None, num_samples=None, return_logprobs=False,
                  **controls):
  """The backend :func:`sample` would run these arguments on, here.

  Args: as :func:`sample` (controls and mesh axes included).

  Returns:
    A name from :data:`BACKENDS`.

  Raises:
    What :func:`sample` raises for these arguments.
  """
  from flashsample_jax import sharding
  vocab_axes, batch_axes = sharding.check_axes(vocab_axis, batch_axis)
  p, c = _problem(hidden, weight, key, temperature, controls,
                  weight_layout=weight_layout, vocab_size=vocab_size,
                  num_samples=num_samples, return_logprobs=return_logprobs,
                  vocab_axes=vocab_axes, batch_axes=batch_axes)
  return resolve_backend(backend, p, c)


@functools.partial(
    jax.jit, static_argnames=("weight_layout", "vocab_size", "backend",
                              "num_samples", "return_logprobs", "vocab_axes",
                              "batch_axes"))
def _sample(hidden, weight, key, temperature, ctl, *, weight_layout, vocab_size,
            backend, num_samples, return_logprobs, vocab_axes, batch_axes):
  from flashsample_jax import sharding
  p, c = _problem(hidden, weight, key, temperature, ctl, weight_layout=weight_layout,
                  vocab_size=vocab_size, num_samples=num_samples,
                  return_logprobs=return_logprobs, vocab_axes=vocab_axes,
                  batch_axes=batch_axes)
  offset = sharding.vocab_offset(p, vocab_axes)
  if not c.active:
    score, token = _candidates(backend, p, vocab_offset=offset)
    if vocab_axes:
      score, token = sharding.combine_over_axis(score, token, vocab_axes)
    return token
  global_batch = p.batch * sharding.axes_size(batch_axes)
  samples_only = not (c.truncates or c.transforms or c.return_logprobs)
  if (backend == "mosaic" and samples_only
      and p.batch * c.samples <= SAMPLES_AS_ROWS_MAX):
    return _samples_as_rows(p, c, vocab_offset=offset, vocab_axes=vocab_axes,
                            global_batch=global_batch)
  if backend == "mosaic":
    # The kernel's per-warpgroup state; truncation is then decided as for
    # the xla backend (xla_backend.finish_controls).
    st = _mosaic_controls_module().controls_state(
        p, c, vocab_offset=offset, global_batch=global_batch)
    tokens, out, _ = xla_backend.finish_controls(
        p, c, st, axis=vocab_axes, global_batch=global_batch)
  else:
    tokens, out, _ = xla_backend.sample_with_controls(
        p, c, vocab_offset=offset, axis=vocab_axes, global_batch=global_batch)
  if c.allowed_mask is not None:
    empty = _controls.none_allowed(c.allowed_mask, p.vocab_size)[None]
    tokens = jnp.where(empty, -1, tokens)
    if out is not None:
      nan = lambda a: jnp.where(empty, jnp.nan, a)
      out = _controls.SampleOutput(tokens, nan(out.logprob),
                                   nan(out.logprob_truncated), out.logsumexp)
  if out is not None:
    return out if num_samples is not None else jax.tree.map(lambda a: a[0], out)
  return tokens if num_samples is not None else tokens[0]


def sample(hidden, weight, key, *, temperature=1.0, weight_layout="vd",
           vocab_size=None, backend="auto", vocab_axis=None, batch_axis=None,
           top_k=None, top_p=None, min_p=None, logit_bias=None,
           allowed_mask=None, softcap=None, num_samples=None,
           return_logprobs=False):
  """Samples one token per row from ``softmax(hidden @ W.T / T)``.

  Never writes the ``[B, V]`` logits to device memory. Returns exactly the
  tokens of :func:`flashsample_jax.reference.sample`, i.e. of
  ``jax.random.categorical(key, logits / T)`` (per-row keys: vmapped), for
  the same key.

  Args:
    hidden: ``[B, D]`` bf16, f16 or f32 hidden states; cast to ``weight``'s
      dtype before the product.
    weight: the LM head, ``[V, D]`` for ``weight_layout="vd"`` (tied
      embeddings, PyTorch checkpoints) or ``[D, V]`` for ``"dv"`` (a Flax
      ``nnx.Linear`` kernel). Never transposed in memory.
    key: a typed threefry key (``jax.random.key``): a scalar key gives one
      stream for the batch, a ``[B]`` key array one stream per row. Raw
      ``uint32[2]`` / ``uint32[B, 2]`` key data is accepted too.
    temperature: a float or a ``[B]`` array. ``0`` makes that row greedy
      (argmax of the logits, lowest id on ties); rows may mix.
    weight_layout: ``"vd"`` or ``"dv"``, see ``weight``.
    vocab_size: the logical vocabulary when ``weight`` has padding rows;
      ids ``>= vocab_size`` are never returned. Default: all rows. With
      ``vocab_axis``, the GLOBAL vocabulary (default: shards x local rows).
    backend: ``"auto"`` or one of :data:`BACKENDS`.
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
    logit_bias: f32 ``[vocab_size]`` added to the (soft-capped) logits.
    allowed_mask: uint32/int32 ``[B, ceil(vocab_size / 32)]`` bitmask, bit
      ``v % 32`` of word ``v // 32`` allows id ``v`` (grammar-constrained
      decoding). A row that allows no id returns ``-1``.
    softcap: ``c`` for logit soft-capping ``c * tanh(l / c)`` (Gemma 2).
    num_samples: S samples per row from one pass over W: tokens ``[S, B]``
      equal to ``jax.random.categorical(key, l, shape=(S, B))``.
    return_logprobs: also return log-probabilities (see Returns).

  Returns:
    int32 token ids ``[B]`` (``[S, B]`` with ``num_samples``). With
    ``return_logprobs=True``, a :class:`flashsample_jax.SampleOutput`
    ``(tokens, logprob, logprob_truncated, logsumexp)``.

  Raises:
    TypeError: a wrong type or dtype (non-float hidden/weight, a non-key key).
    ValueError: mismatched shapes, an unknown backend or layout, a
      ``vocab_size`` out of range, a negative or NaN concrete temperature,
      a ``vocab_axis``/``batch_axis`` that is not an axis of the enclosing
      ``shard_map`` (or both naming one axis).
    NotImplementedError: the named backend cannot run these arguments on this
      device (``"auto"`` then picks another).
  """
  from flashsample_jax import sharding
  ctl = dict(top_k=top_k, top_p=top_p, min_p=min_p, logit_bias=logit_bias,
             allowed_mask=allowed_mask, softcap=softcap)
  vocab_axes, batch_axes = sharding.check_axes(vocab_axis, batch_axis)
  p, c = _problem(hidden, weight, key, temperature, ctl, weight_layout=weight_layout,
                  vocab_size=vocab_size, num_samples=num_samples,
                  return_logprobs=return_logprobs, vocab_axes=vocab_axes,
                  batch_axes=batch_axes)
  name = resolve_backend(backend, p, c)
  if p.batch == 0:
    shape = (0,) if num_samples is None else (num_samples, 0)
    tokens = jnp.zeros(shape, jnp.int32)
    if return_logprobs:
      empty = jnp.zeros(shape, jnp.float32)
      return _controls.SampleOutput(tokens, empty, empty, empty)
    return tokens
  if isinstance(temperature, (int, float)):
    temperature = jnp.float32(temperature)
  return _sample(hidden, weight, key, temperature, ctl, weight_layout=weight_layout,
                 vocab_size=vocab_size, backend=name, num_samples=num_samples,
                 return_logprobs=return_logprobs, vocab_axes=vocab_axes,
                 batch_axes=batch_axes)
