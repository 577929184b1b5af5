"""Test inputs shared by every backend's tests, the benchmarks and notebooks.

Exact inputs: small-integer ``H`` and ``W`` (exact in bf16/f16, every partial
sum exact in f32) and power-of-two temperatures, so every backend computes
bit-identical logits and scores; tokens must then equal the reference's on
100% of rows (docs/design.md, "The exactness contract").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

POW2_TEMPERATURES = (0.25, 0.5, 1.0, 2.0, 4.0)


def exact_inputs(batch, dim, vocab, *, dtype=jnp.bfloat16, layout="vd", seed=0,
                 scale=3):
  """Integer-valued ``hidden [B, D]`` and ``weight`` in ``layout``."""
  r = np.random.default_rng(seed)
  h = r.integers(-scale, scale + 1, (batch, dim))
  w = r.integers(-scale, scale + 1, (vocab, dim))
  if layout == "dv":
    w = w.T
  return jnp.asarray(h, dtype), jnp.asarray(np.ascontiguousarray(w), dtype)


def random_inputs(batch, dim, vocab, *, dtype=jnp.bfloat16, layout="vd", seed=0,
                  logit_std=3.0):
  """Gaussian inputs whose logits have standard deviation ``logit_std``."""
  r = np.random.default_rng(seed)
  h = r.standard_normal((batch, dim))
  w = r.standard_normal((vocab, dim)) * (logit_std / np.sqrt(dim))
  if layout == "dv":
    w = w.T
  return jnp.asarray(h, dtype), jnp.asarray(np.ascontiguousarray(w), dtype)


def pow2_temperatures(batch, *, greedy_every=0, seed=0):
  """A ``[B]`` array of power-of-two temperatures, every k-th row greedy."""
  r = np.random.default_rng(seed)
  t = r.choice(POW2_TEMPERATURES, batch).astype(np.float32)
  if greedy_every:
    t[::greedy_every] = 0.0
  return jnp.asarray(t)


def row_keys(batch, seed=0):
  """``[B]`` typed keys, one per row."""
  return jax.random.split(jax.random.key(seed), batch)
