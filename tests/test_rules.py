"""The tie rule (pallas_kernels.rules), the reductions built on it, and the
candidate lists' pairing (pallas_kernels.state)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rules, state


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


def _sorted_lists(rng, p, k, n, ids_from=50):
  """Lists ``[n, k, p]`` as the kernels write them: each descending, ties by
  lower id first, ids distinct per row; few distinct values (ties across
  and within lists) and some -inf padding."""
  vals = rng.integers(-3, 3, size=(n, k, p)).astype(np.float32)
  vals[rng.random((n, k, p)) < 0.2] = -np.inf
  ids = np.stack([rng.permutation(ids_from)[:p * k].reshape(k, p) for _ in range(n)])
  for j in range(n):
    for q in range(p):
      order = np.lexsort((ids[j, :, q], -vals[j, :, q]))
      vals[j, :, q], ids[j, :, q] = vals[j, order, q], ids[j, order, q]
  return vals, ids.astype(np.int32)


def _best_k(v, i, k):
  """The k first of (v, i) in the lists' order, and the largest value left."""
  order = np.lexsort((i, -v))
  rest = v[order[k:]]
  return v[order[:k]], i[order[:k]], (rest.max() if rest.size else -np.inf)


def test_pair_lists_keeps_the_top_of_each_pair():
  # Against a brute-force merge: for each pair of lists the K best of the
  # union (as a set), and losers whose largest is every value dropped.
  rng = np.random.default_rng(5)
  n, k, p = 9, 4, 6
  vals, ids = _sorted_lists(rng, p, k, n)
  got_v, got_i, lost = map(np.asarray, jax.jit(state.pair_lists)(jnp.asarray(vals),
                                                                  jnp.asarray(ids)))
  assert got_v.shape == lost.shape == (n, k, p // 2)
  for j in range(n):
    for c in range(p // 2):
      v, i, dropped = _best_k(np.r_[vals[j, :, 2 * c], vals[j, :, 2 * c + 1]],
                              np.r_[ids[j, :, 2 * c], ids[j, :, 2 * c + 1]], k)
      assert sorted(zip(-v, i)) == sorted(zip(-got_v[j, :, c], got_i[j, :, c])), (j, c)
      assert lost[j, :, c].max() == dropped


def test_pair_lists_needs_an_even_number_of_parts():
  with pytest.raises(ValueError, match="even"):
    state.pair_lists(jnp.zeros((1, 4, 3)), jnp.zeros((1, 4, 3), jnp.int32))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_sort_bitonic_sorts_what_pair_lists_keeps(k):
  rng = np.random.default_rng(k)
  vals, ids = _sorted_lists(rng, 8, k, 7, ids_from=200)
  # Jitted, as the backends run them (op by op, every op compiles).
  kept_v, kept_i, _ = jax.jit(state.pair_lists)(jnp.asarray(vals), jnp.asarray(ids))
  got_v, got_i = map(np.asarray, jax.jit(state.sort_bitonic)(kept_v, kept_i))
  for j in range(7):
    for c in range(4):
      order = np.lexsort((np.asarray(kept_i)[j, :, c], -np.asarray(kept_v)[j, :, c]))
      np.testing.assert_array_equal(got_v[j, :, c], np.asarray(kept_v)[j, order, c])
      np.testing.assert_array_equal(got_i[j, :, c], np.asarray(kept_i)[j, order, c])
  with pytest.raises(ValueError, match="power-of-two"):
    state.sort_bitonic(jnp.zeros((1, 3, 2)), jnp.zeros((1, 3, 2), jnp.int32))


@pytest.mark.parametrize("rounds", [0, 1, 2, 3])
def test_halve_parts_keeps_the_top_k_of_each_group_of_parts(rounds):
  # 13 parts: padded to a multiple of 2 ** rounds with empty lists. Each
  # group of 2 ** rounds neighbouring parts keeps exactly its K best (as a
  # set), and its bound is the largest of its parts' bounds and of every
  # value it dropped; the kept lists' top M over all groups is the lists'.
  rng = np.random.default_rng(rounds)
  n, k, p = 6, 4, 13
  vals, ids = _sorted_lists(rng, p, k, n, ids_from=400)
  bound = rng.integers(-5, 0, size=(n, p)).astype(np.float32)
  got_v, got_i, got_b = map(np.asarray, jax.jit(state.halve_parts, static_argnums=3)(
      jnp.asarray(vals), jnp.asarray(ids), jnp.asarray(bound), rounds))
  step = 1 << rounds
  groups = -(-p // step)
  assert got_v.shape == (n, k, groups) and got_b.shape == (n, groups)
  for j in range(n):
    for g in range(groups):
      parts = slice(g * step, min(p, (g + 1) * step))
      v, i, dropped = _best_k(vals[j, :, parts].T.ravel(), ids[j, :, parts].T.ravel(), k)
      assert sorted(zip(-v, i)) == sorted(zip(-got_v[j, :, g], got_i[j, :, g])), (j, g)
      assert got_b[j, g] == max(bound[j, parts].max(), dropped), (j, g)
