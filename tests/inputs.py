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

from flashsample_jax import problem

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


QUANTIZED_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8)


def quantized_scale(vocab, *, per_row=True, seed=0):
  """A power-of-two f32 scale (``[V]`` per row, else a scalar): products
  with integer logits stay exact."""
  r = np.random.default_rng(seed)
  if not per_row:
    return jnp.float32(2.0 ** r.integers(-2, 2))
  return jnp.asarray(2.0 ** r.integers(-2, 2, vocab), jnp.float32)


def quantized_inputs(batch, dim, vocab, *, dtype=jnp.float8_e4m3fn, layout="vd",
                     per_row=True, seed=0, hidden_dtype=jnp.bfloat16):
  """``(hidden, weight, weight_scale)`` with exact logits: integers in
  [-3, 3] (exact in e4m3, e5m2 and int8) and a power-of-two scale."""
  h, w = exact_inputs(batch, dim, vocab, layout=layout, seed=seed, dtype=jnp.float32)
  return (h.astype(hidden_dtype), w.astype(dtype),
          quantized_scale(vocab, per_row=per_row, seed=seed))


def random_inputs(batch, dim, vocab, *, dtype=jnp.bfloat16, layout="vd", seed=0,
                  logit_std=3.0):
  """Gaussian inputs whose logits have standard deviation ``logit_std``."""
  r = np.random.default_rng(seed)
  h = r.standard_normal((batch, dim))
  w = r.standard_normal((vocab, dim)) * (logit_std / np.sqrt(dim))
  if layout == "dv":
    w = w.T
  return jnp.asarray(h, dtype), jnp.asarray(np.ascontiguousarray(w), dtype)


def list_inputs(kind, batch, dim, vocab):
  """``(h, w)`` whose logits test candidate lists: ``"exact"`` (integer
  logits of std ~20, a few ties near the top), ``"ties"`` (integers in
  [-8, 8]: hundreds of ties at each row's largest value) or ``"random"``
  (bf16 Gaussian inputs)."""
  if kind == "random":
    h = jax.random.normal(jax.random.key(5), (batch, dim), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(6), (vocab, dim)) * 0.4).astype(jnp.bfloat16)
    return h, w
  return exact_inputs(batch, dim if kind == "exact" else 8, vocab, seed=4,
                      scale=3 if kind == "exact" else 1)


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


def edge_rows_problem(batch, dim, vocab, *, seed=0, vocab_size=None):
  """A plain-sampling problem on exact inputs with the rows a reduction can
  get wrong: row 0 greedy with a zero hidden row (every logit 0: the tie
  rule's lowest id), row 2 (B > 2) with a NaN hidden value, the others
  sampled at temperatures 0.4-2.0; the vocabulary cut 11 ids below the
  weight's rows (``vocab_size``)."""
  h, w = exact_inputs(batch, dim, vocab, seed=seed)
  h = h.at[0].set(0.0)
  if batch > 2:
    h = h.at[2, 5].set(jnp.nan)
  t = jnp.asarray(np.r_[0.0, np.linspace(0.4, 2.0, batch - 1)], jnp.float32)
  return problem.prepare(h, w, row_keys(batch, seed=batch), temperature=t,
                         vocab_size=vocab - 11 if vocab_size is None else vocab_size)
