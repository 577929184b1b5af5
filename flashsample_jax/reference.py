"""The checker: materializes the logits and calls ``jax.random.categorical``.

This is not a backend; it is what every backend is tested against, written
with nothing of this package but argument checking, so a bug in the noise or
streaming code cannot hide in it. It holds the full ``[B, V]`` logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashsample_jax import _validate


def transformed_logits(p: _validate.Problem) -> jax.Array:
  """Untempered f32 logits ``[B, vocab_size]`` (DESIGN.md section 1 order)."""
  contract = 1 if p.layout == "vd" else 0
  l = jax.lax.dot_general(p.hidden, p.weight, (((1,), (contract,)), ((), ())),
                          preferred_element_type=jnp.float32)
  return l[:, :p.vocab_size]


@jax.jit(static_argnames=("weight_layout", "vocab_size", "backend"))
def _sample(hidden, weight, key, temperature, *, weight_layout, vocab_size, backend):
  del backend
  p = _validate.prepare(hidden, weight, key, temperature=temperature,
                        weight_layout=weight_layout, vocab_size=vocab_size)
  l = transformed_logits(p)
  t = p.temperature[:, None]
  lt = l / jnp.where(t == 0, 1.0, t)
  if p.per_row_keys:
    sampled = jax.vmap(jax.random.categorical)(p.key, lt)
  else:
    sampled = jax.random.categorical(p.key, lt)
  greedy = jnp.argmax(l, axis=-1)
  return jnp.where(p.temperature == 0, greedy, sampled).astype(jnp.int32)


def sample(hidden, weight, key, *, temperature=1.0, weight_layout="vd",
           vocab_size=None, backend="auto"):
  """Reference sampler with the signature of :func:`flashsample_jax.sample`.

  Computes ``l = hidden @ W.T`` in f32, keeps the first ``vocab_size``
  columns, and returns ``jax.random.categorical(key, l / T)`` per row
  (``jax.vmap``-ed over per-row keys), or ``argmax(l)`` where ``T == 0``.

  Args: as :func:`flashsample_jax.sample`; ``backend`` is checked and ignored.

  Returns:
    int32 token ids ``[B]``.
  """
  from flashsample_jax.api import BACKENDS
  _validate.check_backend_name(backend, BACKENDS)
  # Check eagerly, outside jit, so concrete values are inspected.
  _validate.prepare(hidden, weight, key, temperature=temperature,
                    weight_layout=weight_layout, vocab_size=vocab_size)
  if isinstance(temperature, (int, float)):
    temperature = jnp.float32(temperature)
  return _sample(hidden, weight, key, temperature, weight_layout=weight_layout,
                 vocab_size=vocab_size, backend=backend)
