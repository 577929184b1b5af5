"""The sampling-controls cases every backend is checked on (exact inputs).

``scale=1`` and ``T = 4 x`` powers of two: logits with std ~2, so truncation
matters and rows differ; every seventh row is greedy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests import inputs

B, D, V = 24, 64, 3001
H, W = inputs.exact_inputs(B, D, V, scale=1, seed=1)
T = inputs.pow2_temperatures(B, greedy_every=7, seed=1) * 4
KEYS = {"scalar": jax.random.key(3), "per_row": inputs.row_keys(B, seed=3)}
_R = np.random.default_rng(0)


def _mask(rows):
  return jnp.asarray(_R.integers(0, 2**32, (rows, -(-V // 32)), dtype=np.uint32))


CASES = {
    "top_k": dict(top_k=jnp.asarray(_R.integers(0, 60, B), jnp.int32)),
    "top_k_scalar": dict(top_k=20),
    "top_p": dict(top_p=jnp.asarray(_R.uniform(0.05, 1.0, B), jnp.float32)),
    "min_p": dict(min_p=jnp.asarray(_R.uniform(0.0, 0.5, B), jnp.float32)),
    "k_p_minp": dict(top_k=40, top_p=0.8, min_p=0.02),
    "bias": dict(logit_bias=jnp.asarray(_R.integers(-4, 5, V), jnp.float32)),
    "softcap": dict(softcap=3.0),
    "mask": dict(allowed_mask=_mask(B)),
    "all": dict(top_k=30, top_p=0.9, min_p=0.01, softcap=8.0,
                logit_bias=jnp.asarray(_R.integers(-2, 3, V), jnp.float32),
                allowed_mask=_mask(B)),
}


def _history(rows, width, hi, pad):
  """Ids in [0, hi) (repeats likely when ``hi`` is small), ``pad`` of each
  row's trailing entries -1."""
  ids = _R.integers(0, hi, (rows, width)).astype(np.int32)
  ids[:, width - pad:] = -1
  return jnp.asarray(ids)


# Penalties with exact arithmetic on the integer logits: powers of two for
# the repetition penalty, quarters for presence and frequency. Histories:
# prompts over the whole vocabulary, outputs over its first 80 ids (so ids
# repeat and rows share some); row 1 has no history at all.
_PROMPT = _history(B, 40, V, 7).at[1].set(-1)
_OUTPUT = _history(B, 24, 80, 5).at[1].set(-1)
PENALTIES = dict(
    repetition_penalty=jnp.asarray(_R.choice([0.5, 1.0, 2.0, 4.0], B), jnp.float32),
    presence_penalty=jnp.asarray(_R.choice([-0.5, 0.0, 0.25, 1.0], B), jnp.float32),
    frequency_penalty=jnp.asarray(_R.choice([0.0, 0.25, 0.5, 2.0], B), jnp.float32),
    prompt_ids=_PROMPT, output_ids=_OUTPUT)

CASES.update({
    "top_logprobs": dict(top_logprobs=20),
    "top_logprobs_truncated": dict(top_logprobs=5, top_k=30, top_p=0.9, min_p=0.01),
    "penalties": PENALTIES,
    "penalties_all": dict(CASES["all"], **PENALTIES, top_logprobs=8),
})


def only_one_allowed(rng):
  """``(ids [B], mask)``: a mask that allows one random id per row."""
  only = rng.integers(0, V, B)
  mask = np.zeros((B, -(-V // 32)), np.uint32)
  mask[np.arange(B), only // 32] = (1 << (only % 32)).astype(np.uint32)
  return only, jnp.asarray(mask)
