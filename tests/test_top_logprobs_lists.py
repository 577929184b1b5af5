"""``top_logprobs=N`` up to the maximum stays on the candidate lists (issue
#42, defect 10).

The N-th listed value is certified only where it lies above every unlisted
value; with lists of exactly N entries it is their last and never is, and
every row took the exact materialized path (on an H200 at N = 128, B = 64:
all rows, 14x the time of N = 120). The lists now hold N + a few at every N.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import controls, problem, stage2
from flashsample_jax.backends.xla import XlaBackend

B, D, V = 8, 64, 4096
HID = jax.random.normal(jax.random.key(1), (B, D), jnp.bfloat16)
WEIGHT = (jax.random.normal(jax.random.key(2), (V, D)) * 0.2).astype(jnp.bfloat16)
KEY = jax.random.key(0)


@pytest.mark.parametrize("truncation", [{}, {"top_k": 50, "top_p": 0.9}],
                         ids=["plain", "top_k_top_p"])
@pytest.mark.parametrize("n", [120, 121, 127, controls.TOP_LOGPROBS_MAX])
def test_top_n_up_to_the_maximum_is_certified_on_the_lists(n, truncation):
  backend = XlaBackend(chunk=1024)           # four chunks: merged lists
  p = problem.prepare(HID, WEIGHT, KEY)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, top_logprobs=n,
                                **truncation)
  assert stage2.candidate_count(p, c) >= n + 1
  finish = jax.jit(lambda p, c: stage2.finish(p, c, backend.controls_state(p, c)))
  _, out, fallback = finish(p, c)
  assert not np.asarray(fallback).any()
  want = fs.reference.sample(HID, WEIGHT, KEY, top_logprobs=n, **truncation)
  np.testing.assert_array_equal(out.tokens[0], want.tokens)         # sample 0
  np.testing.assert_array_equal(out.top_ids, want.top_ids)
  np.testing.assert_allclose(out.top_logprobs, want.top_logprobs, rtol=2e-5, atol=2e-5)
