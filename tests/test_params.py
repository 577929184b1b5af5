"""``fs.SamplingParams``, ``fs.sample_logits`` and ``truncation_order``.

The params are the keyword controls as one pytree: a call with them must be
the call with the keywords (the shared backend suite checks the keywords
against the reference). ``sample_logits`` is stage 2 over given logits: its
tokens must be the reference's on those logits, and ``fs.sample``'s where
the logits are ``hidden @ W.T``. ``truncation_order="vllm"`` measures
top-p's mass over what min-p kept: the kept sets differ from ``"hf"``'s, and
every backend follows the reference (tests/cases.py, ``p_minp_vllm``).
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import controls, problem, reference
from flashsample_jax.params import STATIC_NAMES
from tests import cases
from tests.cases import B, CASES, H, KEYS, T, V, W
from tests.test_statistics import P_MIN, chi_square_p

LOGITS = jnp.dot(H, W.T, preferred_element_type=jnp.float32)     # exact: H, W exact


def _tokens(out):
  return np.asarray(out.tokens if isinstance(out, fs.SampleOutput) else out)


def _assert_same(got, want):
  """Identical tokens; log-probabilities within 2e-5 where returned; top ids
  identical but where two ids' log-probabilities tie within 2e-5 (a GPU's
  tanh in two programs may differ in the last bit: ids whose soft-capped
  logits tie may swap, as tests/backend_suite.py allows)."""
  np.testing.assert_array_equal(_tokens(got), _tokens(want))
  if isinstance(want, fs.SampleOutput):
    for name in ("logprob", "logprob_truncated", "logsumexp", "top_logprobs"):
      a, b = getattr(got, name), getattr(want, name)
      assert (a is None) == (b is None), name
      if b is not None:
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
    if want.top_ids is not None:
      got_ids, want_ids = np.asarray(got.top_ids), np.asarray(want.top_ids)
      lp = np.asarray(want.top_logprobs)
      for b, j in np.argwhere(got_ids != want_ids):
        k = np.flatnonzero(want_ids[b] == got_ids[b, j])
        assert all(abs(lp[b, i] - lp[b, j]) <= 2e-5 for i in k), (b, j)


# -- SamplingParams -------------------------------------------------------------


@pytest.mark.parametrize("case", ["k_p_minp", "p_minp_vllm", "penalties_all"])
def test_params_are_the_keywords(case):
  kw = dict(CASES[case], return_logprobs=True)
  params = fs.SamplingParams(temperature=T, **kw)
  got = fs.sample(H, W, KEYS["per_row"], params, backend="xla")
  want = fs.sample(H, W, KEYS["per_row"], temperature=T, backend="xla", **kw)
  for name, a in got._asdict().items():      # one program: bit for bit
    np.testing.assert_array_equal(a, getattr(want, name), err_msg=name)
  _assert_same(got, reference.sample(H, W, KEYS["per_row"], temperature=T, **kw))


def test_params_under_jit_and_scan():
  """A jit argument and a scan carry: leaves change per step without a new
  trace; each step equals the eager call with that step's values."""
  params = fs.SamplingParams(temperature=jnp.full((B,), 2.0), top_k=jnp.full((B,), 40),
                             top_p=jnp.full((B,), 0.9))
  traces = []

  @jax.jit
  def step_fn(params, key):
    traces.append(1)
    return fs.sample(H, W, key, params, backend="xla")

  def step(carry, key):
    params = carry
    tok = step_fn(params, key)
    return params.replace(temperature=params.temperature * 2,
                          top_k=params.top_k - 10), tok

  keys = jax.random.split(jax.random.key(7), 3)
  _, toks = jax.lax.scan(step, params, keys)
  for i, k in enumerate(keys):
    want = reference.sample(H, W, k, temperature=2.0 * 2**i, top_k=40 - 10 * i, top_p=0.9)
    np.testing.assert_array_equal(toks[i], want)
  leaves = jax.tree.leaves(params)
  assert len(leaves) == 3                  # the arrays; the options are static
  step_fn(params, keys[0])
  step_fn(params.replace(top_p=jnp.full((B,), 0.5)), keys[1])
  assert len(traces) == 1                  # one trace: the scan's and both calls


def test_static_fields_are_structure():
  a = fs.SamplingParams(top_logprobs=3)
  b = fs.SamplingParams(top_logprobs=4)
  assert jax.tree.structure(a) != jax.tree.structure(b)
  assert jax.tree.leaves(a) == [1.0]


def test_params_refuse_keywords_beside_them():
  params = fs.SamplingParams(top_k=5)
  with pytest.raises(TypeError, match=r"not both.*\['top_p', 'truncation_order'\]"):
    fs.sample(H, W, KEYS["scalar"], params, top_p=0.5, truncation_order="vllm")
  with pytest.raises(TypeError, match="not both.*temperature"):
    fs.sample(H, W, KEYS["scalar"], params, temperature=jnp.float32(1.0))
  with pytest.raises(TypeError, match="params must be a flashsample_jax.SamplingParams"):
    fs.sample(H, W, KEYS["scalar"], dict(top_k=5))
  with pytest.raises(TypeError, match="not both"):
    fs.sample_logits(LOGITS, KEYS["scalar"], params, min_p=0.1)
  # Keyword defaults beside params are allowed: nothing was asked twice.
  np.testing.assert_array_equal(
      fs.sample(H, W, KEYS["scalar"], params, temperature=1.0, backend="xla"),
      fs.sample(H, W, KEYS["scalar"], top_k=5, backend="xla"))


def test_from_generation_config():
  cfg = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.95,
         "repetition_penalty": 1.1, "eos_token_id": [1, 2], "max_new_tokens": 64,
         "transformers_version": "4.56.0"}
  p = fs.SamplingParams.from_generation_config(cfg)
  assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.7, 20, 0.95, 1.1)
  assert p.min_p is None and p.return_logprobs is False
  # batch: one [B] array per read setting, dtypes as fs.sample casts them.
  pb = fs.SamplingParams.from_generation_config(cfg, batch=4, return_logprobs=True)
  assert pb.top_k.shape == (4,) and pb.top_k.dtype == jnp.int32
  assert pb.temperature.dtype == jnp.float32 and pb.return_logprobs
  # do_sample False (Hugging Face's default): greedy; truncation ignored.
  g = fs.SamplingParams.from_generation_config(types.SimpleNamespace(
      do_sample=False, temperature=0.6, top_k=50, top_p=0.9, num_beams=1))
  assert g.temperature == 0.0 and g.top_k is None and g.top_p is None
  assert fs.SamplingParams.from_generation_config({"do_sample": True, "top_k": 0}).top_k is None
  # A dict is read as written (vLLM's reading): no do_sample samples, no
  # top_k is none; an object's own defaults are read as it holds them.
  d = fs.SamplingParams.from_generation_config({"temperature": 0.6, "top_p": 0.9})
  assert (d.temperature, d.top_k, d.top_p) == (0.6, None, 0.9)
  o = fs.SamplingParams.from_generation_config(types.SimpleNamespace(
      do_sample=True, temperature=0.6, top_k=50, top_p=0.9))
  assert (o.temperature, o.top_k, o.top_p) == (0.6, 50, 0.9)
  with pytest.raises(ValueError, match="typical_p=0.9"):
    fs.SamplingParams.from_generation_config({"typical_p": 0.9})
  with pytest.raises(ValueError, match="num_beams=4"):
    fs.SamplingParams.from_generation_config({"num_beams": 4})
  fs.SamplingParams.from_generation_config({"typical_p": 1.0, "num_beams": 1})
  with pytest.raises(TypeError, match="unknown SamplingParams fields"):
    fs.SamplingParams.from_generation_config({}, top_n=3)
  for not_a_config in ("generation_config.json", [("temperature", 0.7)]):
    with pytest.raises(TypeError, match="config must be a mapping"):
      fs.SamplingParams.from_generation_config(not_a_config)
  with pytest.raises(ValueError, match="batch=0"):
    fs.SamplingParams.from_generation_config({}, batch=0)
  # Checked before the broadcast casts them (found by review: 1e-50 became a
  # greedy 0, a top_k of 2.9 became 2), as without batch.
  for bad, exc, match in (({"temperature": 1e-50}, ValueError, "temperature=1e-50"),
                          ({"top_k": 2.9}, TypeError, "top_k=2.9"),
                          ({"top_p": 1.5}, ValueError, "top_p=1.5"),
                          ({"temperature": "0.7"}, TypeError, "temperature must be a float")):
    with pytest.raises(exc, match=match):
      fs.SamplingParams.from_generation_config({"do_sample": True, **bad}, batch=4)
  # Without batch too: a bad config fails where it is read, naming the key,
  # not in the sampler call that first uses it (found by review).
  for bad, exc, match in (({"temperature": "0.7"}, TypeError, "temperature must be a float"),
                          ({"top_k": 2.9}, TypeError, "top_k=2.9"),
                          ({"min_p": -0.1}, ValueError, "min_p"),
                          ({"typical_p": "0.9"}, TypeError, "typical_p='0.9' must be a number"),
                          ({"do_sample": "false"}, TypeError, "do_sample='false' must be a bool")):
    with pytest.raises(exc, match=match):
      fs.SamplingParams.from_generation_config(bad)
  # Per-row arrays in a config set its batch for the check.
  rows = fs.SamplingParams.from_generation_config({"temperature": np.array([0.5, 0.7]),
                                                  "top_k": np.array([5, 0])})
  np.testing.assert_array_equal(rows.top_k, [5, 0])
  with pytest.raises(ValueError, match="top_p"):
    fs.SamplingParams.from_generation_config({"top_p": np.array([0.9, 1.5])})
  # Settings Hugging Face applies from the generated length: refused when
  # on, as a sampler call has no step; off values pass.
  for name, value in (("min_new_tokens", 5), ("min_length", 3), ("forced_bos_token_id", 0),
                      ("forced_eos_token_id", 2), ("exponential_decay_length_penalty", (8, 1.1))):
    with pytest.raises(ValueError, match=f"{name}=.*depends on the decoding step"):
      fs.SamplingParams.from_generation_config({"do_sample": True, name: value})
  fs.SamplingParams.from_generation_config({"min_new_tokens": 0, "min_length": 0,
                                            "forced_bos_token_id": None})
  # The params sample as the keywords do.
  key = KEYS["per_row"]
  np.testing.assert_array_equal(
      fs.sample(H, W, key, fs.SamplingParams.from_generation_config(cfg, batch=B),
                backend="xla"),
      reference.sample(H, W, key, temperature=0.7, top_k=20, top_p=0.95))


# -- sample_logits ---------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(KEYS))
def test_sample_logits_plain_is_categorical(key):
  k = KEYS[key]
  got = fs.sample_logits(LOGITS, k, temperature=2.0, num_samples=3)
  if key == "scalar":
    want = jax.random.categorical(k, LOGITS / 2.0, shape=(3, B))
  else:
    want = jax.vmap(lambda kk, row: jax.random.categorical(kk, row / 2.0, shape=(3,)))(
        k, LOGITS).T
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", ["all", "p_minp_vllm", "penalties_all", "top_logprobs"])
def test_sample_logits_is_sample(case):
  """On logits = H @ W.T: fs.sample's tokens and log-probabilities, and the
  reference's on the logits."""
  kw = dict(CASES[case], temperature=T, return_logprobs=True)
  got = fs.sample_logits(LOGITS, KEYS["per_row"], **kw)
  _assert_same(got, reference.sample_logits(LOGITS, KEYS["per_row"], **kw))
  _assert_same(got, reference.sample(H, W, KEYS["per_row"], **kw))
  _assert_same(fs.sample_logits(LOGITS, KEYS["per_row"], fs.SamplingParams(**kw)), got)


def test_sample_logits_padding_dtypes_and_errors():
  pad = jnp.concatenate([LOGITS, jnp.full((B, 7), 1e4, jnp.float32)], axis=1)
  np.testing.assert_array_equal(
      fs.sample_logits(pad, KEYS["scalar"], vocab_size=V, top_k=30),
      reference.sample_logits(LOGITS, KEYS["scalar"], top_k=30))
  half = LOGITS.astype(jnp.bfloat16)
  np.testing.assert_array_equal(
      fs.sample_logits(half, KEYS["scalar"], top_p=0.9),
      reference.sample_logits(half.astype(jnp.float32), KEYS["scalar"], top_p=0.9))
  assert fs.sample_logits(LOGITS[:0], KEYS["scalar"]).shape == (0,)
  with pytest.raises(ValueError, match="logits must be 2-D"):
    fs.sample_logits(LOGITS[0], KEYS["scalar"])
  with pytest.raises(TypeError, match="logits.dtype=int32"):
    fs.sample_logits(LOGITS.astype(jnp.int32), KEYS["scalar"])
  with pytest.raises(ValueError, match=r"vocab_size=5000 must be in \[1, 3001\] \(the columns of logits\)"):
    fs.sample_logits(LOGITS, KEYS["scalar"], vocab_size=5000)
  with pytest.raises(ValueError, match="top_p=1.5"):
    fs.sample_logits(LOGITS, KEYS["scalar"], top_p=1.5)


def test_sample_logits_under_jit():
  f = jax.jit(fs.sample_logits, static_argnames=STATIC_NAMES)
  np.testing.assert_array_equal(
      f(LOGITS, KEYS["scalar"], top_k=jnp.int32(25), top_logprobs=4).top_ids,
      reference.sample_logits(LOGITS, KEYS["scalar"], top_k=25, top_logprobs=4).top_ids)


# -- truncation_order -------------------------------------------------------------


def _keep(kw, order):
  p = problem.prepare(H, W, KEYS["scalar"], temperature=T)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, truncation_order=order,
                                **{k: v for k, v in kw.items() if k != "truncation_order"})
  x = reference.transformed_logits(p, c)
  t = x / jnp.where(p.temperature[:, None] == 0, 1.0, p.temperature[:, None])
  return np.asarray(controls.keep_mask(t, c))


def test_vllm_case_keeps_other_ids():
  """The suite's vLLM case is one where the orders differ (so it can fail):
  the vLLM nucleus is inside Hugging Face's, and smaller in many rows."""
  hf, vllm = _keep(CASES["p_minp_vllm"], "hf"), _keep(CASES["p_minp_vllm"], "vllm")
  assert not np.any(vllm & ~hf)
  assert np.sum(np.any(hf != vllm, axis=1)) >= 6


# Probabilities ~ [0.51, 0.31, 0.19] (exact in bf16): min_p=0.5 keeps ids 0
# and 1; top_p=0.6 then keeps both over the whole row (mass before id 1:
# 0.51), but only id 0 over min-p's two (0.62 >= 0.6): vLLM never draws id 1.
_ROW = jnp.asarray([[0.0], [-0.5], [-1.0]], jnp.bfloat16)            # W [V=3, D=1]


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_vllm_order_on_a_known_row(backend):
  n = 4000
  h = jnp.ones((n, 1), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(11), n)
  kw = dict(top_p=0.6, min_p=0.5)
  for order, kept in (("hf", [0, 1]), ("vllm", [0])):
    got = np.asarray(fs.sample(h, _ROW, keys, backend=backend, truncation_order=order, **kw))
    np.testing.assert_array_equal(
        got, reference.sample(h, _ROW, keys, truncation_order=order, **kw))
    probs = np.exp(np.asarray(_ROW[kept, 0], np.float64))
    assert set(np.unique(got)) == set(kept)
    if len(kept) > 1:
      assert chi_square_p(got, np.concatenate([probs, [0.0]])) > P_MIN


def test_truncation_order_is_checked():
  with pytest.raises(ValueError, match="truncation_order='HF' must be one of"):
    fs.sample(H, W, KEYS["scalar"], truncation_order="HF")
  with pytest.raises(ValueError, match="truncation_order=None"):
    fs.SamplingParams(truncation_order=None) and fs.sample(
        H, W, KEYS["scalar"], fs.SamplingParams(truncation_order=None))
