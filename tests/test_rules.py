"""The tie rule (pallas_kernels.rules) and the reductions built on it."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rules


def _fold(score, index, axis):
  """Reference: fold rules.combine over ``axis`` one candidate at a time."""
  s = np.moveaxis(np.asarray(score), axis, 0)
  i = np.moveaxis(np.asarray(index), axis, 0)
  pairs = [(jnp.asarray(a), jnp.asarray(b)) for a, b in zip(s, i)]
  return functools.reduce(rules.combine, pairs)


def _hard_scores(rng, axis):
  """Scores ``[37, 11]`` (reduced along ``axis``, transposed for axis 1):
  few distinct values, so many ties; NaN, -inf and +inf sprinkled in; one
  line of -inf and one of NaN."""
  shape = (37, 11) if axis == 0 else (11, 37)
  s = rng.integers(-3, 3, shape).astype(np.float32)
  s[rng.random(shape) < 0.05] = np.nan
  s[rng.random(shape) < 0.1] = -np.inf
  s[rng.random(shape) < 0.02] = np.inf
  for i, v in ((3, -np.inf), (5, np.nan)):
    s[(slice(None), i) if axis == 0 else (i, slice(None))] = v
  return s


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("seed", range(4))
def test_first_best_equals_folding_combine(axis, seed):
  rng = np.random.default_rng(seed)
  s = _hard_scores(rng, axis)
  idx = rng.permutation(s.size).reshape(s.shape).astype(np.int32)
  got = rules.first_best(jnp.asarray(s), jnp.asarray(idx), axis)
  want = _fold(s, idx, axis)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("seed", range(4))
def test_argbest_equals_first_best(axis, seed):
  # The one-reduction form against the two-reduction one, on the same
  # ties, NaN and infinities; the carry is the winner's (the max of the
  # carries where a (score, index) pair repeats, as in the controls' padded
  # lists).
  rng = np.random.default_rng(10 + seed)
  s = _hard_scores(rng, axis)
  idx = rng.integers(0, s.size // 2, s.shape).astype(np.int32)   # repeats
  carry = rng.normal(size=s.shape).astype(np.float32)
  best, tok, t = rules.argbest(jnp.asarray(s), jnp.asarray(idx), axis=axis,
                               carry=jnp.asarray(carry))
  want_s, want_i = rules.first_best(jnp.asarray(s), jnp.asarray(idx), axis)
  np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_i))
  np.testing.assert_array_equal(np.asarray(best), np.asarray(want_s))
  sm, im, cm = (np.moveaxis(a, axis, 0) for a in (s, idx, carry))
  ws = np.asarray(want_s)
  hit = (im == np.asarray(want_i)[None]) & ((sm == ws[None]) | (np.isnan(sm) & np.isnan(ws)[None]))
  np.testing.assert_array_equal(np.asarray(t), np.where(hit, cm, -np.inf).max(axis=0))


def test_first_best_mask_and_given_best():
  # Masked entries never give the index (INT_MAX when all are masked); a
  # precomputed max gives the same result as computing it.
  s = jnp.asarray([[1.0, 3.0, 3.0], [2.0, 2.0, -jnp.inf]])
  i = jnp.asarray([[7, 5, 9], [4, 1, 0]], jnp.int32)
  mask = jnp.asarray([[True, False, True], [False, False, False]])
  best, idx = rules.first_best(s, i, 1, mask=mask)
  np.testing.assert_array_equal(np.asarray(idx), [9, rules.INT_MAX])
  np.testing.assert_array_equal(np.asarray(best), [3.0, 2.0])
  got = rules.first_best(s, i, 1, best=jnp.max(s, axis=1))
  np.testing.assert_array_equal(np.asarray(got[1]), [5, 1])


def test_greedy_rule():
  # T == 0: the untempered logit, no noise; otherwise t + g.
  greedy, t_safe = rules.split_temperature(jnp.asarray([0.0, 0.5]))
  np.testing.assert_array_equal(np.asarray(greedy), [True, False])
  np.testing.assert_array_equal(np.asarray(t_safe), [1.0, 0.5])
  x = jnp.asarray([3.0, 3.0])
  got = rules.perturb(x, x / t_safe, jnp.asarray([10.0, 10.0]), greedy)
  np.testing.assert_array_equal(np.asarray(got), [3.0, 16.0])
