"""Sampling controls: their meaning, their checks, and stage 2's candidates path.

Every backend is checked against the reference on every control by the
shared suite (tests/backend_suite.py); this file holds what does not depend
on the backend: the truncation rules on materialized rows, argument checks,
the certification of candidates and its exact fallback, and the
distribution of truncated samples.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import controls, problem, stage2
from flashsample_jax.backends import xla as xla_backend
from tests import cases, inputs
from tests.backend_suite import BackendSuite
from tests.cases import B, CASES, D, H, KEYS, T, V, W
from tests.test_statistics import N, P_MIN, chi_square_p


class _Xla(BackendSuite):
  backend = "xla"


class _Dense(BackendSuite):
  backend = "dense"


check = _Xla().check_controls


def xla_finish(p, c):
  """Stage 2 on the xla backend's state: ``(tokens, out, fallback)``."""
  return stage2.finish(p, c, xla_backend.controls_state(p, c))


def test_fallback_path_is_exact(monkeypatch):
  # With 4 candidates most truncated rows cannot be certified and take the
  # materialized path; the tokens must not change.
  monkeypatch.setattr(stage2, "CANDIDATES", 4)
  jax.clear_caches()  # M is read when the sampler is traced
  for case in ("top_k", "top_p", "k_p_minp", "min_p"):
    check(CASES[case], return_logprobs=True)
  p = problem.prepare(H, W, KEYS["scalar"], temperature=T)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, **CASES["top_p"])
  # Jitted as fs.sample runs it (a function of its own: traced with M = 4).
  _, _, fallback = jax.jit(lambda p, c: xla_finish(p, c))(p, c)
  assert np.asarray(fallback).sum() > 0


def test_fallback_is_rare_for_peaked_rows():
  # LLM-like rows (a few dominant ids) are certified from the candidates
  # (64 for top_k=50: stage2.candidate_count).
  h, w = inputs.random_inputs(B, D, V, dtype=jnp.float32, seed=4, logit_std=4.0)
  p = problem.prepare(h, w, KEYS["scalar"], temperature=1.0)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, top_k=50, top_p=0.9)
  _, _, fallback = jax.jit(lambda p, c: xla_finish(p, c))(p, c)
  assert np.asarray(fallback).sum() == 0


@pytest.mark.parametrize("k, bound", [(1, 56), (20, 56), (50, 56), (56, 56), (57, 120),
                                      (120, 120), (121, 248)])
def test_k_bound_leaves_the_slack_in_a_power_of_two(k, bound):
  assert controls.k_bound(k) == bound
  assert bound + controls.LIST_SLACK & (bound + controls.LIST_SLACK - 1) == 0


@pytest.mark.parametrize("kw, m", [
    (dict(top_k=50), 64), (dict(top_k=50, top_p=0.9, min_p=0.1), 64),
    (dict(top_k=np.array([3] * (B - 1) + [20])), 64), (dict(top_k=56), 64),
    (dict(top_k=57), 128), (dict(top_k=121), 256), (dict(top_k=500), 512),
    (dict(top_k=1016), 1024), (dict(top_k=1017), 1032), (dict(top_k=1024), 1032),
    (dict(top_k=1025), 128),                                    # past RETURN_KEPT_MAX
    (dict(top_k=np.array([0] + [5] * (B - 1)), top_p=0.9), 128),   # a row without top-k
    (dict(top_p=0.9), 128), (dict(min_p=0.1), 128),
    (dict(top_k=20, top_logprobs=100), 108), (dict(top_k=20, return_kept=70), 78)])
def test_candidate_count_follows_a_concrete_top_k(kw, m):
  p = problem.prepare(H, W, KEYS["scalar"], temperature=T)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, **kw)
  assert stage2.candidate_count(p, c) == m


@pytest.mark.parametrize("backend", [xla_backend.XlaBackend(), xla_backend.DenseBackend()])
def test_a_top_k_past_the_default_lists_is_certified_on_longer_ones(backend):
  # Found by review: lists of CANDIDATES (128) certify no k-th value past
  # k = 120, and every row of a call with top_k = 128 or 200 took the exact
  # path. Lists of k_bound(k) + 8 decide them.
  h, w = inputs.random_inputs(B, D, V, dtype=jnp.float32, seed=4, logit_std=4.0)
  for k in (128, 200):
    p = problem.prepare(h, w, KEYS["scalar"], temperature=1.0)
    c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, top_k=k, top_p=0.95)
    st = stage2.per_sample(backend.controls_state(p, c.for_pass()), c.samples)
    assert int(np.sum(np.asarray(stage2.finish(p, c, st)[2]))) == 0
    got = fs.sample(h, w, KEYS["scalar"], backend=backend, top_k=k, top_p=0.95)
    np.testing.assert_array_equal(got, fs.reference.sample(h, w, KEYS["scalar"], top_k=k,
                                                           top_p=0.95))


def test_traced_top_k_keeps_the_full_lists():
  p = problem.prepare(H, W, KEYS["scalar"], temperature=T)
  seen = []
  def count(k):
    seen.append(stage2.candidate_count(
        p, controls.prepare_controls(batch=B, vocab_size=V, rows=V, top_k=k)))
    return k
  jax.jit(count)(jnp.full((B,), 50, jnp.int32))
  assert seen == [stage2.CANDIDATES]


@pytest.mark.parametrize("top_k", [60, 1000])
def test_top_p_near_one_under_top_k_on_every_row(top_k, monkeypatch):
  # Issue #42's rows (a nucleus around the lists' end, top_p within
  # rounding reach of 1) under a top-k on every row, whose set the lists
  # hold (60) or not (1000): stage 2 then skips the readings at p -/+ width
  # (_top_p_edge), which could decide no row more. Tokens equal the
  # reference's; a traced top_k (not known on every row) still reads them.
  from flashsample_jax import api
  h, w, keys, labels = cases.nucleus_inputs()
  calls = []
  edge = stage2._top_p_edge  # pylint: disable=protected-access
  monkeypatch.setattr(stage2, "_top_p_edge", lambda *a: calls.append(1) or edge(*a))
  api.run.clear_cache()
  for top_p in cases.NUCLEUS_TOP_P:
    want = np.asarray(fs.reference.sample(h, w, keys, top_k=top_k, top_p=top_p))
    got = np.asarray(fs.sample(h, w, keys, backend="xla", top_k=top_k, top_p=top_p))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(top_p, labels[i], int(got[i]), int(want[i])) for i in bad]
  assert not calls
  k = jnp.full((h.shape[0],), top_k, jnp.int32)
  got = jax.jit(lambda k: fs.sample(h, w, keys, backend="xla", top_k=k, top_p=top_p))(k)
  np.testing.assert_array_equal(got, want)
  assert calls
  api.run.clear_cache()


# Rows exact in bf16 (row r's logits are column r of the weight, picked by a
# one-hot hidden state) whose 50th value ties with the values after it: past
# top_k=50's 64 candidates, up to the 64th (the list's last: a 65th could
# tie), or inside the list.
_TIES_V = 512
_TIES = {"past": ((40, 2.0), (40, 1.0)), "to_last": ((49, 2.0), (15, 1.0)),
         "inside": ((45, 2.0), (10, 1.0))}


def _tied_inputs():
  rows = []
  for groups in _TIES.values():
    r = np.concatenate([np.full(n, v, np.float32) for n, v in groups])
    rows.append(np.concatenate([r, np.full(_TIES_V - r.size, -4.0, np.float32)]))
  n = len(rows)
  return jnp.eye(n, dtype=jnp.bfloat16), jnp.asarray(np.stack(rows).T, jnp.bfloat16)


@pytest.mark.parametrize("kw", [dict(top_k=50), dict(top_k=50, top_p=0.97)])
def test_ties_past_the_shorter_lists_take_the_exact_path(kw):
  h, w = _tied_inputs()
  keys = jax.random.split(jax.random.key(5), h.shape[0])
  p = problem.prepare(h, w, keys, temperature=1.0)
  c = controls.prepare_controls(batch=h.shape[0], vocab_size=_TIES_V, rows=_TIES_V, **kw)
  assert stage2.candidate_count(p, c) == 64
  _, _, fallback = jax.jit(lambda p, c: xla_finish(p, c))(p, c)
  np.testing.assert_array_equal(fallback, [True, True, False])
  for suite in (_Xla(), _Dense()):
    for key in (keys, jax.random.key(6)):
      suite.check_controls(kw, key=key, h=h, w=w, t=1.0)


def test_num_samples_equals_categorical_shape():
  l = jnp.dot(H.astype(jnp.float32), W.astype(jnp.float32).T)
  key = KEYS["scalar"]
  got = fs.sample(H, W, key, temperature=1.0, num_samples=4)
  np.testing.assert_array_equal(got, jax.random.categorical(key, l, shape=(4, B)))
  rows = KEYS["per_row"]
  got = fs.sample(H, W, rows, num_samples=3)
  want = jax.vmap(lambda k, r: jax.random.categorical(k, r, shape=(3,)))(rows, l).T
  np.testing.assert_array_equal(got, want)
  # Sample 0 is the single-sample call.
  np.testing.assert_array_equal(got[0], fs.sample(H, W, rows))


@pytest.mark.parametrize("kw", [dict(top_p=0.9),
                                dict(top_k=5, top_p=0.9, min_p=0.01, return_logprobs=True)])
def test_program_size_does_not_grow_with_num_samples(kw):
  # The sample axis is vectorized, not unrolled: an unrolled loop made the
  # program ~28x larger at S = 64 than at S = 2 (28 s to compile on a CPU,
  # minutes on a GPU). Measured: 64 samples ~1.01x the text of 2.
  h, w = inputs.exact_inputs(2, 4, 1000, scale=2, seed=2)
  size = lambda s: len(jax.jit(lambda h, w, k: fs.sample(
      h, w, k, temperature=1.0, num_samples=s, backend="xla", **kw)).lower(
          h, w, jax.random.key(0)).as_text())
  small, large = size(2), size(64)
  assert large < 1.5 * small, (small, large)


@pytest.mark.parametrize("kw", [dict(top_k=10), dict(top_p=0.6), dict(min_p=0.2),
                                dict(top_k=30, top_p=0.8)])
def test_truncated_distribution_chi_square(kw):
  vocab = 200
  h, w = inputs.random_inputs(1, 64, vocab, dtype=jnp.float32, seed=6, logit_std=2.0)
  hb = jnp.broadcast_to(h, (N, 64))
  tok = np.asarray(fs.sample(hb, w, inputs.row_keys(N, seed=6), **kw))
  l = np.asarray(jnp.dot(h, w.T))[:1]
  keep = np.asarray(controls.keep_mask(
      jnp.asarray(l), controls.prepare_controls(batch=1, vocab_size=vocab, rows=vocab,
                                                **kw)))[0]
  probs = np.where(keep, np.exp(l[0].astype(np.float64) - l.max()), 0.0)
  assert keep[tok].all(), "a truncated id was sampled"
  assert chi_square_p(tok, probs / probs.sum()) >= P_MIN


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(top_k=-1), ValueError, r"top_k=-1 must be in \[0, 2147483647\]"),
    (dict(top_k=2**40), ValueError, r"top_k=1099511627776"),
    (dict(top_k=np.full(B, 2**40, np.int64)), ValueError, r"top_k\[0\]=1099511627776"),
    (dict(top_k=2.5), TypeError, r"top_k=2.5"),
    (dict(top_k=jnp.ones(3, jnp.int32)), ValueError, r"top_k.shape=\(3,\)"),
    (dict(top_p=0.0), ValueError, r"top_p=0.0 must be in \(0.0, 1.0\]"),
    (dict(top_p=1.5), ValueError, r"top_p=1.5"),
    (dict(top_p=float("nan")), ValueError, r"top_p=nan"),
    (dict(top_p=jnp.array([0.5] * (B - 1) + [2.0])), ValueError, r"top_p\[23\]=2.0"),
    (dict(min_p=-0.1), ValueError, r"min_p=-0.1"),
    (dict(min_p=jnp.array([True] * B)), TypeError, r"min_p.dtype=bool"),
    (dict(logit_bias=jnp.zeros(5)), ValueError, r"logit_bias.shape=\(5,\)"),
    (dict(logit_bias=jnp.zeros(V, jnp.int32)), TypeError, r"logit_bias"),
    (dict(allowed_mask=jnp.zeros((B, 3), jnp.uint32)), ValueError,
     r"allowed_mask.shape=\(24, 3\)"),
    (dict(allowed_mask=jnp.zeros((B, 94), jnp.float32)), TypeError,
     r"allowed_mask.dtype=float32"),
    (dict(softcap=0.0), ValueError, r"softcap=0.0 must be > 0"),
    (dict(softcap="big"), TypeError, r"softcap='big'"),
    # Found by review: c = inf (or past float32) made every logit NaN and
    # every row id 0; a bool was 1.0 and a complex lost its imaginary part.
    (dict(softcap=float("inf")), ValueError, r"softcap=inf must be > 0 and finite"),
    (dict(softcap=1e39), ValueError, r"softcap=1e\+39 must be > 0 and finite"),
    (dict(softcap=jnp.array(True)), TypeError, r"softcap=.* must be a positive real"),
    (dict(softcap=np.bool_(True)), TypeError, r"softcap=.* must be a positive real"),
    (dict(softcap=np.complex64(1 + 1j)), TypeError, r"softcap=.* must be a positive real"),
    (dict(softcap=jnp.ones(2)), TypeError, r"softcap=.* must be a positive real"),
    (dict(num_samples=0), ValueError, r"num_samples=0"),
    (dict(num_samples=2.0), TypeError, r"num_samples=2.0"),
    (dict(return_logprobs=1), TypeError, r"return_logprobs=1"),
    (dict(top_logprobs=-1), ValueError, r"top_logprobs=-1 must be in \[0, 128\]"),
    (dict(top_logprobs=129), ValueError, r"top_logprobs=129"),
    (dict(top_logprobs=2.0), TypeError, r"top_logprobs=2.0"),
    (dict(top_logprobs=jnp.int32(3)), TypeError, r"top_logprobs"),
    (dict(repetition_penalty=0.0, output_ids=jnp.zeros((B, 2), jnp.int32)), ValueError,
     r"repetition_penalty=0.0 must be a normal float32"),
    (dict(repetition_penalty=jnp.full(B, -1.0)), ValueError, r"repetition_penalty\[0\]=-1.0"),
    (dict(presence_penalty=float("inf")), ValueError, r"presence_penalty=inf"),
    (dict(frequency_penalty=float("nan")), ValueError, r"frequency_penalty=nan"),
    (dict(frequency_penalty="x"), TypeError, r"frequency_penalty"),
    (dict(presence_penalty=1.0, output_ids=jnp.zeros((B,), jnp.int32)), ValueError,
     r"output_ids.shape=\(24,\) must be \[B, n\]"),
    (dict(presence_penalty=1.0, prompt_ids=jnp.zeros((3, 5), jnp.int32)), ValueError,
     r"prompt_ids.shape=\(3, 5\)"),
    (dict(presence_penalty=1.0, output_ids=jnp.zeros((B, 2), jnp.float32)), TypeError,
     r"output_ids.dtype=float32"),
    (dict(presence_penalty=1.0, output_ids=jnp.full((B, 2), V, jnp.int32)), ValueError,
     r"output_ids\[0, 0\]=3001 must be an id in \[0, 3001\) or -1"),
    (dict(presence_penalty=1.0, prompt_ids=jnp.full((B, 2), -2, jnp.int32)), ValueError,
     r"prompt_ids\[0, 0\]=-2"),
    (dict(presence_penalty=1.0, prompt_ids=[[1, 2]]), TypeError, r"prompt_ids must be"),
])
@pytest.mark.parametrize("sampler", [fs.sample, fs.reference.sample])
def test_bad_controls(sampler, kwargs, exc, match):
  with pytest.raises(exc, match=match):
    sampler(H, W, KEYS["scalar"], **kwargs)


# -- regressions found in review: each failed before its fix ----------------------


def test_keep_mask_matches_the_argsort_formulation():
  # keep_mask sorts once with two keys (value desc, id asc), which XLA never
  # hands to CUB (a CUB sort cannot live in a CUDA graph; see _sort_desc).
  # It must keep exactly what the textbook formulation keeps: a sort for
  # the k-th value, a stable argsort of the top-k survivors for top-p. Rows
  # with ties, signed zeros, +-inf and NaN; k and p at and past their ends.
  def textbook(t, c):
    keep = jnp.ones(t.shape, bool)
    if c.top_k is not None:
      k = c.top_k[:, None]
      desc = -jnp.sort(-t, axis=1)
      kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, t.shape[1] - 1), axis=1)
      keep &= (k <= 0) | (t >= kth)
    if c.top_p is not None:
      tk = jnp.where(keep, t, -jnp.inf)
      ts = jnp.take_along_axis(tk, jnp.argsort(-tk, axis=1, stable=True), axis=1)
      q = jnp.exp(ts - ts[:, :1])
      q = q / jnp.sum(q, axis=1, keepdims=True)
      before = jnp.cumsum(q, axis=1) - q
      n = jnp.maximum(jnp.sum(before < c.top_p[:, None], axis=1), 1)
      thr = jnp.take_along_axis(ts, (n - 1)[:, None], axis=1)
      keep &= (c.top_p[:, None] >= 1) | (tk >= thr)
    return keep

  rules = (("top_k",), ("top_p",), ("top_k", "top_p"))

  @jax.jit
  def both(t, k, p):
    # Every rule set of one drawn shape in one program (one compile per
    # shape instead of one per op and rule set); keep_mask always runs
    # jitted in the samplers.
    out = []
    for names in rules:
      # Raw rule values (k < 0, p = 0 or NaN: what traced values may hold).
      c = types.SimpleNamespace(top_k=k if "top_k" in names else None,
                                top_p=p if "top_p" in names else None, min_p=None)
      out.append((controls.keep_mask(t, c), textbook(t, c)))
    return out

  r = np.random.default_rng(11)
  checked = 0
  for _ in range(24):
    b, v = int(r.integers(1, 6)), int(r.integers(1, 200))
    x = np.round(r.normal(size=(b, v)) * r.choice([0.1, 1, 5]), int(r.integers(0, 3)))
    u = r.random((b, v))
    x[u < 0.05] = -np.inf
    x[(u > 0.05) & (u < 0.07)] = np.inf
    x[(u > 0.07) & (u < 0.09)] = np.nan
    x[(u > 0.09) & (u < 0.12)] = -0.0
    t = jnp.asarray(x, jnp.float32)
    k = jnp.asarray(r.choice([0, 1, 2, 5, v, v + 3, -1], size=b), jnp.int32)
    p = jnp.asarray(r.choice([1.0, 0.0, 1e-6, 0.3, 0.9, 0.999, np.nan], size=b),
                    jnp.float32)
    for names, (got, want) in zip(rules, both(t, k, p)):
      np.testing.assert_array_equal(got, want, err_msg=str(names))
      checked += 1
  assert checked == 72


def test_perturbed_ties_among_candidates_go_to_the_lowest_id():
  # f32: 30 + g[1007] == 34 + g[1096] for this key: the list is sorted by t,
  # so the first list position (1096) is not the lowest id (1007).
  v = 1100
  w = jnp.full((v, 1), -100.0).at[1007, 0].set(30.0).at[1096, 0].set(34.0)
  h = jnp.ones((1, 1))
  for kw in (dict(top_k=2), dict(min_p=0.001), dict(top_p=0.999999)):
    check(kw, key=jax.random.key(0), h=h, w=w, t=1.0, vocab_size=1097)


def test_nan_and_inf_logits_with_truncation_match_reference():
  w = jnp.asarray(np.arange(300, dtype=np.float32)[:, None] % 7)
  h = jnp.ones((2, 1))
  key = jax.random.key(0)
  for bad in (w.at[5, 0].set(jnp.nan), w.at[9, 0].set(jnp.inf)):
    for kw in (dict(top_k=3), dict(min_p=0.1), dict(top_p=0.5), dict(top_k=3, min_p=0.1)):
      tok = check(kw, key=key, h=h, w=bad, t=1.0)
      # min_p on a row with NaN or +inf: exp(t - max t) is NaN or 0 for
      # every id, none is kept, and the row returns -1 (README, "Invalid
      # values").
      assert ((tok == -1).all() if "min_p" in kw else (tok >= 0).all()), kw


def _second_id_mass(h, w):
  """The reference's f32 mass ranked before the second sorted id of the row
  ``h @ w.T`` (top-p alone: measured over the whole row)."""
  t = jnp.asarray(h, jnp.float32) @ jnp.asarray(w, jnp.float32).T
  desc = -jnp.sort(-t, axis=1)
  return np.float32(controls.mass_before(*controls.nucleus_terms(desc))[0, 1])


def test_top_p_at_a_rounding_boundary_matches_reference():
  # p is the reference's f32 mass ranked before the second id, exactly
  # (computed, so that it follows the definition's rounding): only the top
  # id is kept (``before < p`` is false there). Another rounding path (the
  # candidates' normalizer) could land on either side; rows this close to
  # p take the exact path.
  h, w = inputs.exact_inputs(8, 4, 1000, scale=2, seed=2)
  top_p = float(_second_id_mass(h[3:4], w))
  check(dict(top_p=top_p), key=jax.random.key(0), h=h[3:4], w=w, t=1.0, num_samples=64)
  c = controls.prepare_controls(batch=1, vocab_size=1000, rows=1000, top_p=top_p)
  t = jnp.asarray(h[3:4], jnp.float32) @ jnp.asarray(w, jnp.float32).T
  assert int(controls.keep_mask(t, c).sum()) == 1     # the premise holds


def test_nucleus_edge_within_rounding_resolved_when_tokens_agree():
  # The row above: its nucleus edge is within rounding of p, so it is never
  # certified from the candidates. With the edge ids kept or dropped the
  # token is often the same (then no materialized pass is needed); either
  # way the token must equal the reference's.
  h, w = inputs.exact_inputs(8, 4, 1000, scale=2, seed=2)
  h = h[3:4]
  mass = _second_id_mass(h, w)           # p two f32 steps above it
  kw = dict(top_p=float(np.nextafter(np.nextafter(mass, np.float32(1)), np.float32(1))))
  c = controls.prepare_controls(batch=1, vocab_size=1000, rows=1000, **kw)
  finish = jax.jit(xla_finish)   # one program for the 12 keys, as fs.sample runs it
  materialized = []
  for seed in range(12):
    key = jax.random.key(seed)
    p = problem.prepare(h, w, key, temperature=1.0)
    tok, _, fallback = finish(p, c)
    want = fs.reference.sample(h, w, key, temperature=1.0, **kw)
    np.testing.assert_array_equal(tok[0], want, err_msg=f"key {seed}")
    materialized.append(bool(fallback[0]))
  assert any(materialized) and not all(materialized), materialized


@pytest.mark.parametrize("top_p", cases.NUCLEUS_TOP_P, ids=lambda p: f"1-{1 - p:.0e}")
def test_top_p_near_one_on_the_dense_route(top_p):
  # Issue #42 was found on the dense route (one chunk) as on the streaming
  # one; the shared suite runs the xla backend, this the dense one.
  _Dense().test_top_p_near_one_with_a_nucleus_past_the_candidates(top_p)


def test_prefix_sums_of_a_prefix_are_those_of_the_whole_row():
  # controls.prefix_sums: entry j's additions depend on j alone, so a list
  # of a row's first m sorted values gets the whole row's bits.
  r = np.random.default_rng(5)
  x = jnp.asarray(r.exponential(size=(3, 1000)) ** 3, jnp.float32)
  full = np.asarray(controls.prefix_sums(x))
  for m in (1, 2, 3, 7, 50, 128, 999):
    np.testing.assert_array_equal(np.asarray(controls.prefix_sums(x[:, :m])), full[:, :m],
                                  err_msg=f"m={m}")
  # It is a prefix sum (to rounding), and the jitted program agrees.
  np.testing.assert_allclose(full, np.cumsum(np.asarray(x, np.float64), axis=1), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(jax.jit(controls.prefix_sums)(x)), full)


def _edge_row_and_p(k: int, seed: int):
  """A row of exact logits (V 1000) and three top-p values: the f32 mass
  keep_mask measures before the row's first id (past the 4th, under top-k =
  k) whose t is below its predecessor's, and that mass's two f32
  neighbours, so that the nucleus edge falls on either side of that id."""
  h, w = inputs.exact_inputs(8, 4, 1000, scale=2, seed=seed)
  h = h[3:4]
  t = jnp.asarray(h, jnp.float32) @ jnp.asarray(w, jnp.float32).T
  desc = -jnp.sort(-t, axis=1)
  ts = jnp.where(desc >= desc[:, k - 1:k], desc, -jnp.inf)
  d = np.asarray(desc[0])
  m = next(i for i in range(4, k) if d[i] < d[i - 1])
  mass = np.float32(controls.mass_before(*controls.nucleus_terms(ts))[0, m])
  ps = [np.nextafter(mass, np.float32(0)), mass, np.nextafter(mass, np.float32(1))]
  return h, w, t, [float(x) for x in ps]


@pytest.mark.parametrize("return_logprobs", [False, True])
def test_nucleus_edge_inside_top_k_is_decided_on_the_candidates(return_logprobs):
  # docs/design.md, "The nucleus edge, bit for bit": with top-k's kept set
  # in the lists, stage 2 evaluates keep_mask's expression on the same
  # values: p at the mass before an id, one ulp below and above, decides
  # the edge exactly (no exact path), even where the kept log-sum-exp is
  # asked for (no token-agreement shortcut then).
  h, w, t, ps = _edge_row_and_p(k=40, seed=2)
  sizes = []
  for top_p in ps:
    kw = dict(top_k=40, top_p=top_p)
    c = controls.prepare_controls(batch=1, vocab_size=1000, rows=1000,
                                  return_logprobs=return_logprobs, **kw)
    sizes.append(int(controls.keep_mask(t, c).sum()))
    finish = jax.jit(xla_finish)
    for seed in range(6):
      key = jax.random.key(seed)
      p = problem.prepare(h, w, key, temperature=1.0)
      tok, out, fallback = finish(p, c)
      assert not bool(fallback[0]), (top_p, seed)
      want = fs.reference.sample(h, w, key, temperature=1.0, return_logprobs=return_logprobs,
                                 **kw)
      if return_logprobs:
        np.testing.assert_array_equal(tok[0], want.tokens)
        np.testing.assert_allclose(np.ravel(out.logprob_truncated), want.logprob_truncated,
                                   rtol=1e-6)
      else:
        np.testing.assert_array_equal(tok[0], want, err_msg=f"p={top_p} key {seed}")
  # The premise: p and the f32 below it keep fewer ids than the f32 above.
  assert sizes[0] == sizes[1] < sizes[2], sizes


def test_a_kept_set_of_every_id_is_decided_only_on_complete_lists():
  # _certify's ``decided``: sampling among the kept candidates is sampling
  # the row. Top-p at p >= 1 is off and keeps every id, so that holds only
  # where the lists hold the row, whatever the candidates look like
  # (issue #42: the p + width shortcut sampled 1628 kept ids from 128).
  row = jnp.asarray(cases.NUCLEUS_ROWS["wide_1628"])[None]        # [1, 2048]
  cand = lax.top_k(row, 128)[0]
  lse = (row.max(axis=1), jnp.sum(jnp.exp(row - row.max(axis=1)), axis=1))
  for p, complete in ((1.0, False), (1.0001, False), (1.0, True)):
    c = controls.prepare_controls(batch=1, vocab_size=2048, rows=2048, top_p=1.0)
    c = dataclasses.replace(c, top_p=jnp.full((1,), p, jnp.float32))
    keep, decided, active = stage2._certify(
        c, cand, lse, jnp.asarray([complete]), cand[:, -1])
    assert not bool(active[0]) and bool(keep.all())
    assert bool(decided[0]) is complete, (p, complete)
  # With the nucleus inside the lists (p = 0.999: 120 ids), it is decided.
  c = controls.prepare_controls(batch=1, vocab_size=2048, rows=2048, top_p=0.999)
  keep, decided, active = stage2._certify(c, cand, lse, jnp.asarray([False]), cand[:, -1])
  assert bool(active[0]) and bool(decided[0]) and int(keep.sum()) == 120


@pytest.mark.parametrize("sampler", [fs.sample, fs.reference.sample],
                         ids=["xla", "reference"])
def test_no_token_possible_is_minus_one_only_with_controls(sampler):
  # Issue #42, defect 3: every row whose transformed logits are all -inf
  # (here from W) returns -1 once any control is given, as one whose mask
  # allows nothing; plain sampling (temperature, num_samples) is
  # jax.random.categorical's own, which returns id 0 for such a row.
  w = jnp.where(jnp.arange(300) < 150, 1.0, 2.0)[:, None]
  h = jnp.asarray([[1.0], [-jnp.inf], [1.0]])      # row 1: every logit -inf
  key, t = jax.random.key(0), jnp.asarray([1.0, 1.0, 0.0])
  run = lambda **kw: np.asarray(jax.tree.leaves(sampler(h, w, key, temperature=t, **kw))[0])
  assert run()[1] == 0 and (run(num_samples=2)[:, 1] == 0).all()
  # (A soft-cap is not among them: it maps -inf to -c, a finite logit.)
  for kw in (dict(return_logprobs=True), dict(top_logprobs=2),
             dict(allowed_mask=jnp.full((3, 10), 0xFFFFFFFF, jnp.uint32)),
             dict(logit_bias=jnp.zeros(300)), dict(top_k=3), dict(min_p=0.5),
             dict(top_p=0.5, num_samples=2)):
    tok = run(**kw)
    np.testing.assert_array_equal(tok[..., 1], -1, err_msg=str(kw))
    assert (tok[..., [0, 2]] >= 0).all(), kw
  out = sampler(h, w, key, temperature=t, return_logprobs=True, top_logprobs=2)
  assert np.isnan(out.logprob[1]) and np.isnan(out.logprob_truncated[1])
  assert np.isneginf(out.logsumexp[1]) and (out.top_ids[1] == -1).all()


def test_traced_out_of_range_controls_match_reference():
  f = jax.jit(lambda m, p: fs.sample(H[:4], W, KEYS["scalar"], temperature=4.0,
                                     min_p=m, top_p=p))
  g = jax.jit(lambda m, p: fs.reference.sample(H[:4], W, KEYS["scalar"], temperature=4.0,
                                               min_p=m, top_p=p))
  for m, p in ((2.0, 1.0), (jnp.nan, 1.0), (0.0, jnp.nan)):
    args = (jnp.float32(m), jnp.float32(p))
    np.testing.assert_array_equal(f(*args), g(*args))
    # A min_p above 1 or NaN keeps no id: nothing to sample, -1 (issue #42);
    # a NaN top_p keeps the top id.
    assert (np.asarray(g(*args)) == -1).all() == (m != 0.0), (m, p)


def test_top_logprobs_treat_signed_zeros_as_equal():
  # Found by the property test: a row whose logits are all +-0.0 (hidden
  # 0). lax.top_k orders 0.0 before -0.0, which log_softmax makes equal;
  # the definition (controls.top_n) ties them by id, on every path.
  h = jnp.zeros((2, 4), jnp.bfloat16)
  w = jnp.asarray(np.where(np.arange(40)[:, None] % 3 == 0, -1.0, 1.0) * np.ones((40, 4)),
                  jnp.float32)
  for backend in ("xla", xla_backend.XlaBackend(chunk=8)):
    out = fs.sample(h, w, KEYS["scalar"], top_logprobs=10, backend=backend)
    np.testing.assert_array_equal(out.top_ids, np.tile(np.arange(10), (2, 1)))
  ref = fs.reference.sample(h, w, KEYS["scalar"], top_logprobs=10)
  np.testing.assert_array_equal(ref.top_ids, np.tile(np.arange(10), (2, 1)))


def test_empty_histories_are_no_penalty():
  # Found by the property test: prompt_ids of width 0 crashed in a max over
  # an empty axis. A history of width 0 is no history.
  kw = dict(temperature=T, repetition_penalty=2.0, frequency_penalty=1.0,
            prompt_ids=jnp.zeros((B, 0), jnp.int32), output_ids=jnp.zeros((B, 0), jnp.int32))
  np.testing.assert_array_equal(fs.sample(H, W, KEYS["scalar"], backend="xla", **kw),
                                fs.sample(H, W, KEYS["scalar"], temperature=T, backend="xla"))
  np.testing.assert_array_equal(fs.reference.sample(H, W, KEYS["scalar"], **kw),
                                fs.sample(H, W, KEYS["scalar"], temperature=T, backend="xla"))


@pytest.mark.parametrize("kw,every", [
    (dict(top_k=50), True), (dict(top_p=0.9), True), (dict(min_p=0.05), True),
    (dict(top_k=0, top_p=0.9), True), (dict(top_k=0), False),
    (dict(top_p=1.0), False), (dict(min_p=0.0), False), (dict(top_k=0, min_p=0.0), False),
    (dict(top_k=np.array([5, 0, 3])), False), (dict(top_k=np.array([5, 1, 3])), True),
    (dict(top_p=jnp.array([0.5, 1.0, 0.2])), False), ({}, False),
    (dict(top_logprobs=5), False),
    # On in float64, off in the float32 the call keeps (0.99999999 is 1.0,
    # 1e-50 is 0), or a subnormal min_p, which a GPU flushes to 0.
    (dict(top_p=0.99999999), False), (dict(min_p=1e-50), False),
    (dict(min_p=1e-40), False), (dict(min_p=np.float32(1.2e-38)), True)])
def test_every_row_truncates_is_known_only_for_concrete_rules(kw, every):
  # for_pass drops the pass's noise only where every row is decided on the
  # candidates; anything else keeps the noise (and the samples).
  c = controls.prepare_controls(batch=3, vocab_size=100, rows=100, num_samples=2, **kw)
  assert c.every_row_truncates is every
  pc = c.for_pass()
  assert (pc.noise, pc.num_samples) == ((False, None) if every else (True, 2))


@pytest.mark.parametrize("kw", [dict(top_p=0.99999999), dict(min_p=1e-50), dict(min_p=1e-40)])
@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_a_rule_off_in_float32_leaves_the_rows_sampled(kw, backend):
  # Found by review: such a rule counted as on in every row dropped the
  # pass's noise, and stage 2, reading it off, took the noiseless argmax.
  x = jax.random.normal(jax.random.key(0), (8, 1000)) * 0.5
  keys = jax.random.split(jax.random.key(1), 8)
  want = fs.reference.sample_logits(x, keys, **kw)
  # eye(8) @ (x.T).T is x exactly: the head's logits are x.
  got = fs.sample(jnp.eye(8, dtype=jnp.float32), x.T, keys, backend=backend, **kw)
  np.testing.assert_array_equal(got, want)
  got = fs.sample_logits(x, keys, **kw)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(want, jnp.argmax(x, axis=1))


def test_traced_truncation_keeps_the_noise():
  seen = []

  def f(k):
    c = controls.prepare_controls(batch=3, vocab_size=100, rows=100, top_k=k)
    seen.append(c.every_row_truncates)
    return c.top_k

  jax.jit(f)(jnp.int32(5))
  assert seen == [False]
