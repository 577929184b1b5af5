"""Stage 2's exact path: the fallback rows, and only they, are redone from
materialized logits; at most ``stage2.EXACT_ROWS`` of them as a compacted
batch of their own, more as the whole batch (one conditional either way)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import controls, problem, stage2
from tests.cases import B, CASES, H, KEYS, T, V, W

_SENTINEL = -7


LOGITS = jnp.dot(H, W.T, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("flagged, key, source", [
    (0, "scalar", "head"), (1, "per_row", "head"), (stage2.EXACT_ROWS, "scalar", "head"),
    (stage2.EXACT_ROWS + 1, "per_row", "head"), (B, "scalar", "head"),
    (1, "scalar", "logits"), (stage2.EXACT_ROWS, "per_row", "logits"),
    (stage2.EXACT_ROWS + 1, "scalar", "logits")])
def test_flagged_rows_and_only_they_are_redone(flagged, key, source):
  kw = dict(CASES["penalties_all"])                 # every per-row control field
  if source == "head":
    p = problem.prepare(H, W, KEYS[key], temperature=T)
  else:                                             # fs.sample_logits: rows of logits
    p = problem.prepare_logits(LOGITS, KEYS[key], temperature=T)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, num_samples=2,
                                return_logprobs=True, **kw)
  rows_flagged = np.random.default_rng(flagged).permutation(B)[:flagged]
  fallback = np.zeros(B, bool)
  fallback[rows_flagged] = True
  s, n = 2, kw["top_logprobs"]
  rows = stage2._Rows(tokens=jnp.full((s, B), _SENTINEL, jnp.int32),
                      t_tok=jnp.zeros((s, B)), lse_kept=jnp.zeros((s, B)),
                      lse_all=jnp.zeros((B,)),
                      top=(jnp.zeros((B, n)), jnp.full((B, n), _SENTINEL, jnp.int32)),
                      fallback=jnp.asarray(fallback))
  out = jax.jit(lambda p, c, rows: stage2._exact_path(p, c, rows, None))(p, c, rows)
  want = fs.reference.sample(H, W, KEYS[key], temperature=T, num_samples=2,
                             return_logprobs=True, **kw)
  tokens, top_ids = np.asarray(out.tokens), np.asarray(out.top[1])
  np.testing.assert_array_equal(tokens[:, fallback], np.asarray(want.tokens)[:, fallback])
  np.testing.assert_array_equal(top_ids[fallback], np.asarray(want.top_ids)[fallback])
  np.testing.assert_allclose(np.asarray(out.lse_all)[fallback],
                             np.asarray(want.logsumexp)[0, fallback], rtol=2e-5, atol=2e-5)
  assert (tokens[:, ~fallback] == _SENTINEL).all()
  assert (top_ids[~fallback] == _SENTINEL).all()
  assert (np.asarray(out.lse_all)[~fallback] == 0).all()
