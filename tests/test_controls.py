"""Sampling controls: the xla backend against the reference (100% on exact inputs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import _validate, controls, xla_backend
from tests import inputs
from tests.test_statistics import N, P_MIN, chi_square_p

B, D, V = 24, 64, 3001
# scale=1 and T=4: logits with std ~2, so truncation matters and rows differ.
H, W = inputs.exact_inputs(B, D, V, scale=1, seed=1)
T = inputs.pow2_temperatures(B, greedy_every=7, seed=1) * 4
KEYS = {"scalar": jax.random.key(3), "per_row": inputs.row_keys(B, seed=3)}
R = np.random.default_rng(0)

CASES = {
    "top_k": dict(top_k=jnp.asarray(R.integers(0, 60, B), jnp.int32)),
    "top_k_scalar": dict(top_k=20),
    "top_p": dict(top_p=jnp.asarray(R.uniform(0.05, 1.0, B), jnp.float32)),
    "min_p": dict(min_p=jnp.asarray(R.uniform(0.0, 0.5, B), jnp.float32)),
    "k_p_minp": dict(top_k=40, top_p=0.8, min_p=0.02),
    "bias": dict(logit_bias=jnp.asarray(R.integers(-4, 5, V), jnp.float32)),
    "softcap": dict(softcap=3.0),
    "mask": dict(allowed_mask=jnp.asarray(R.integers(0, 2**32, (B, -(-V // 32)),
                                                     dtype=np.uint32))),
    "all": dict(top_k=30, top_p=0.9, min_p=0.01, softcap=8.0,
                logit_bias=jnp.asarray(R.integers(-2, 3, V), jnp.float32),
                allowed_mask=jnp.asarray(R.integers(0, 2**32, (B, -(-V // 32)),
                                                    dtype=np.uint32))),
}


def check(kw, key=KEYS["scalar"], h=H, w=W, t=T, **extra):
  got = fs.sample(h, w, key, temperature=t, backend="xla", **kw, **extra)
  want = fs.reference.sample(h, w, key, temperature=t, **kw, **extra)
  if isinstance(want, fs.SampleOutput):
    np.testing.assert_array_equal(got.tokens, want.tokens)
    for name in ("logprob", "logprob_truncated", "logsumexp"):
      np.testing.assert_allclose(getattr(got, name), getattr(want, name),
                                 rtol=2e-5, atol=2e-5, err_msg=name)
    return got.tokens
  np.testing.assert_array_equal(got, want)
  return np.asarray(got)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("key", sorted(KEYS))
def test_control_matches_reference(case, key):
  check(CASES[case], KEYS[key])


@pytest.mark.parametrize("case", ["top_k", "top_p", "all"])
def test_controls_with_samples_and_logprobs(case):
  check(CASES[case], num_samples=3, return_logprobs=True)
  check(CASES[case], KEYS["per_row"], num_samples=2, return_logprobs=True)


def test_fallback_path_is_exact(monkeypatch):
  # With 4 candidates most truncated rows cannot be certified and take the
  # materialized path; the tokens must not change.
  monkeypatch.setattr(xla_backend, "CANDIDATES", 4)
  for case in ("top_k", "top_p", "k_p_minp", "min_p"):
    check(CASES[case], return_logprobs=True)
  p = _validate.prepare(H, W, KEYS["scalar"], temperature=T)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, **CASES["top_p"])
  _, _, fallback = xla_backend.sample_with_controls(p, c)
  assert np.asarray(fallback).sum() > 0


def test_fallback_is_rare_for_peaked_rows():
  # LLM-like rows (a few dominant ids) are certified from 128 candidates.
  h, w = inputs.random_inputs(B, D, V, dtype=jnp.float32, seed=4, logit_std=4.0)
  p = _validate.prepare(h, w, KEYS["scalar"], temperature=1.0)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, top_k=50, top_p=0.9)
  _, _, fallback = xla_backend.sample_with_controls(p, c)
  assert np.asarray(fallback).sum() == 0


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


def test_edge_cases():
  plain = check({}, t=4.0)
  l = np.asarray(jnp.dot(H.astype(jnp.float32), W.astype(jnp.float32).T))
  top = l == l.max(axis=1, keepdims=True)          # integer logits: ties occur
  unique = top.sum(axis=1) == 1
  greedy = l.argmax(axis=1)
  for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
    tok = check(kw, t=4.0)
    # Only the top logit survives (all of it when tied): greedy where unique.
    assert top[np.arange(B), tok].all(), kw
    np.testing.assert_array_equal(tok[unique], greedy[unique])
  assert unique.any() and not unique.all()
  np.testing.assert_array_equal(check(dict(top_k=V + 5), t=4.0), plain)
  np.testing.assert_array_equal(check(dict(top_p=1.0), t=4.0), plain)
  np.testing.assert_array_equal(check(dict(min_p=0.0), t=4.0), plain)
  # A mask that leaves one id per row: that id, whatever the logits.
  only = R.integers(0, V, B)
  mask = np.zeros((B, -(-V // 32)), np.uint32)
  mask[np.arange(B), only // 32] = (1 << (only % 32)).astype(np.uint32)
  np.testing.assert_array_equal(check(dict(allowed_mask=jnp.asarray(mask))), only)
  # A bias of -inf bans ids.
  bias = np.zeros(V, np.float32)
  bias[plain] = -np.inf
  tok = check(dict(logit_bias=jnp.asarray(bias)), t=4.0)
  assert not np.isin(tok, plain).any()


def test_rows_with_nothing_allowed_return_minus_one():
  mask = R.integers(0, 2**32, (B, -(-V // 32)), dtype=np.uint32)
  mask[3] = 0
  mask[5, :-1] = 0
  mask[5, -1] = np.uint32(0xFFFFFFFF) << np.uint32(V % 32)   # only ids >= V
  out = fs.sample(H, W, KEYS["scalar"], temperature=T, allowed_mask=jnp.asarray(mask),
                  return_logprobs=True)
  assert out.tokens[3] == -1 and out.tokens[5] == -1
  assert np.isnan(out.logprob[3]) and np.isnan(out.logprob_truncated[5])
  assert (np.delete(np.asarray(out.tokens), [3, 5]) >= 0).all()
  check(dict(allowed_mask=jnp.asarray(mask)), return_logprobs=True)


def test_traced_controls_under_jit():
  f = jax.jit(lambda k, p, m: fs.sample(H, W, KEYS["scalar"], temperature=T,
                                        top_k=k, top_p=p, min_p=m))
  g = jax.jit(lambda k, p, m: fs.reference.sample(H, W, KEYS["scalar"], temperature=T,
                                                  top_k=k, top_p=p, min_p=m))
  args = (jnp.int32(25), jnp.float32(0.7), jnp.float32(0.03))
  np.testing.assert_array_equal(f(*args), g(*args))


def test_mosaic_declines_controls():
  assert fs.which_backend(H, W, KEYS["scalar"], top_k=5) == "xla"
  with pytest.raises(NotImplementedError, match="controls"):
    fs.sample(H, W, KEYS["scalar"], top_k=5, backend="mosaic")


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
    (dict(top_k=-1), ValueError, r"top_k\[0\]=-1"),
    (dict(top_k=2.5), TypeError, r"top_k=2.5"),
    (dict(top_k=jnp.ones(3, jnp.int32)), ValueError, r"top_k.shape=\(3,\)"),
    (dict(top_p=0.0), ValueError, r"top_p\[0\]=0.0 must be in \(0.0, 1.0\]"),
    (dict(top_p=1.5), ValueError, r"top_p\[0\]=1.5"),
    (dict(min_p=-0.1), ValueError, r"min_p\[0\]=-0.1"),
    (dict(min_p=jnp.array([True] * B)), TypeError, r"min_p.dtype=bool"),
    (dict(logit_bias=jnp.zeros(5)), ValueError, r"logit_bias.shape=\(5,\)"),
    (dict(logit_bias=jnp.zeros(V, jnp.int32)), TypeError, r"logit_bias"),
    (dict(allowed_mask=jnp.zeros((B, 3), jnp.uint32)), ValueError,
     r"allowed_mask.shape=\(24, 3\)"),
    (dict(allowed_mask=jnp.zeros((B, 94), jnp.float32)), TypeError,
     r"allowed_mask.dtype=float32"),
    (dict(softcap=0.0), ValueError, r"softcap=0.0 must be > 0"),
    (dict(softcap="big"), TypeError, r"softcap='big'"),
    (dict(num_samples=0), ValueError, r"num_samples=0"),
    (dict(num_samples=2.0), TypeError, r"num_samples=2.0"),
    (dict(return_logprobs=1), TypeError, r"return_logprobs=1"),
])
@pytest.mark.parametrize("sampler", [fs.sample, fs.reference.sample])
def test_bad_controls(sampler, kwargs, exc, match):
  with pytest.raises(exc, match=match):
    sampler(H, W, KEYS["scalar"], **kwargs)
