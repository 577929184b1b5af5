"""Distribution tests: sampled frequencies fit softmax(logits / T).

All rows share one hidden state and have their own key, so one call draws N
independent samples. Keys are fixed, so each test is deterministic; the
threshold p >= 1e-3 fails a biased sampler (e.g. noise reused across ids, a
temperature applied twice, an off-by-one id) with overwhelming probability at
these N while a correct sampler passes for all but 1 in 1000 key choices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import flashsample_jax as fs
from tests import inputs

P_MIN = 1e-3
N = 20000


def chi_square_p(tokens, probs, min_expected=5.0):
  """p-value of a chi-square fit; bins with small expectation are pooled."""
  probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
  counts = np.bincount(tokens, minlength=probs.size).astype(np.float64)
  expected = probs * tokens.size
  small = expected < min_expected
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return stats.chisquare(obs, exp / exp.sum() * obs.sum()).pvalue


def _probs(h, w, t, vocab_size):
  l = np.asarray(jnp.dot(h[:1].astype(jnp.float32), w.astype(jnp.float32).T))[0]
  l = l[:vocab_size].astype(np.float64) / t
  p = np.exp(l - l.max())
  return p / p.sum()


@pytest.mark.parametrize("backend", ["xla"])
@pytest.mark.parametrize("vocab, t", [(7, 1.0), (101, 0.5), (1000, 2.0), (333, 1.3)])
def test_chi_square_fit(backend, vocab, t):
  h, w = inputs.random_inputs(1, 64, vocab, dtype=jnp.float32, seed=vocab,
                              logit_std=1.5)
  h = jnp.broadcast_to(h, (N, 64))
  keys = inputs.row_keys(N, seed=vocab)
  tok = np.asarray(fs.sample(h, w, keys, temperature=t, backend=backend))
  p = chi_square_p(tok, _probs(h, w, t, vocab))
  assert p >= P_MIN, f"chi-square p={p:.2e} for V={vocab}, T={t}"


def test_chi_square_detects_a_biased_sampler():
  # The test has power: samples at the wrong temperature fail it.
  vocab, t = 101, 1.0
  h, w = inputs.random_inputs(1, 64, vocab, dtype=jnp.float32, seed=3, logit_std=1.5)
  h = jnp.broadcast_to(h, (N, 64))
  tok = np.asarray(fs.sample(h, w, inputs.row_keys(N), temperature=1.2))
  assert chi_square_p(tok, _probs(h, w, t, vocab)) < 1e-6


def test_scalar_key_rows_are_independent_samples():
  # One scalar key for the batch: rows get disjoint counters, so identical
  # rows still give independent samples with the right distribution.
  vocab = 50
  h, w = inputs.random_inputs(1, 64, vocab, dtype=jnp.float32, seed=4, logit_std=1.0)
  h = jnp.broadcast_to(h, (N, 64))
  tok = np.asarray(fs.sample(h, w, jax.random.key(0)))
  assert chi_square_p(tok, _probs(h, w, 1.0, vocab)) >= P_MIN


def test_padded_vocab_distribution():
  vocab = 90
  h, w = inputs.random_inputs(1, 64, 128, dtype=jnp.float32, seed=5, logit_std=1.0)
  h = jnp.broadcast_to(h, (N, 64))
  tok = np.asarray(fs.sample(h, w, inputs.row_keys(N), vocab_size=vocab))
  assert tok.max() < vocab
  assert chi_square_p(tok, _probs(h, w, 1.0, vocab)) >= P_MIN
