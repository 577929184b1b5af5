"""The RL outputs (issue #39): entropies, raw log-probabilities, kept sets.

The reference is held to formulas written out here in float64 on the
materialized logits; the streaming backends (xla, dense; the suite in
tests/backend_suite.py runs every backend) to the reference, exactly for
the kept sets (ties at every edge, overflow rows) and within 1e-5 for the
entropies and log-probabilities; vocabulary sharding to one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import flashsample_jax as fs
from flashsample_jax import controls, problem, reference, stage2
from tests import cases, inputs
from tests.conftest import has_gpu

RL = cases.RL


def _f64_outputs(kw, key=cases.KEYS["scalar"], h=cases.H, w=cases.W, t=cases.T):
  """Entropies, raw log-probabilities and kept sets of the reference's
  tokens, from the materialized logits in float64."""
  p = problem.prepare(h, w, key, temperature=t)
  c = controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size, rows=p.weight_rows,
                                **kw)
  x = np.asarray(reference.transformed_logits(p, c), np.float64)
  temp = np.asarray(p.temperature, np.float64)[:, None]
  tt = x / np.where(temp == 0, 1.0, temp)
  t32 = jnp.asarray(np.asarray(reference.transformed_logits(p, c)) /
                    np.where(temp == 0, 1.0, temp).astype(np.float32))
  keep = np.asarray(controls.keep_mask(t32, c)) if c.truncates else np.isfinite(tt)

  def entropy(v):
    v = np.where(np.isfinite(v), v, -np.inf)
    m = v.max(axis=1, keepdims=True)
    q = np.exp(v - m)
    q /= q.sum(axis=1, keepdims=True)
    return -np.sum(np.where(q > 0, q * np.log(np.where(q > 0, q, 1)), 0), axis=1)

  l = np.asarray(reference._logits(p), np.float64)
  raw = l if c.softcap is None else float(c.softcap) * np.tanh(l / float(c.softcap))
  raw_lp = raw - (raw.max(axis=1, keepdims=True)
                  + np.log(np.exp(raw - raw.max(axis=1, keepdims=True)).sum(axis=1,
                                                                           keepdims=True)))
  return entropy(tt), entropy(np.where(keep, tt, -np.inf)), raw_lp, keep & np.isfinite(tt), tt


@pytest.mark.parametrize("case", ["top_k", "k_p_minp", "p_minp_vllm", "penalties_all",
                                  "softcap", "mask"])
def test_reference_is_the_formulas(case):
  kw = {k: v for k, v in cases.CASES[case].items() if k != "top_logprobs"}
  out = fs.reference.sample(cases.H, cases.W, cases.KEYS["scalar"], temperature=cases.T,
                            **kw, **RL)
  ent, ent_kept, raw_lp, keep, tt = _f64_outputs(kw)
  np.testing.assert_allclose(out.entropy, ent, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out.entropy_truncated, ent_kept, atol=1e-5, rtol=1e-5)
  tok = np.asarray(out.tokens)
  np.testing.assert_allclose(out.logprob_raw, raw_lp[np.arange(cases.B), tok],
                             atol=1e-5, rtol=1e-5)
  count = keep.sum(axis=1)
  np.testing.assert_array_equal(out.kept_count, count)
  for b in range(cases.B):
    ids = np.flatnonzero(keep[b])
    order = ids[np.lexsort((ids, -tt[b, ids]))][:64]           # t descending, then id
    got = np.asarray(out.kept_ids[b])
    np.testing.assert_array_equal(got[:order.size], order)
    assert np.all(got[order.size:] == -1)
    assert tok[b] in ids                                         # drawn from the kept set
  if "top_k" not in kw and "top_p" not in kw and "min_p" not in kw:
    # No rule: the kept set is every id of finite t (the allowed ids).
    np.testing.assert_array_equal(out.kept_count, np.isfinite(tt).sum(axis=1))


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_kept_sets_at_every_edge_and_overflow(backend):
  # The nucleus rows: ties at the top-p edge, nuclei wider than the lists
  # and than N (overflow: kept_count > N, the N most likely listed).
  h, w, keys, _ = cases.nucleus_inputs()
  sel = np.arange(0, h.shape[0], 4)
  h, keys = h[sel], keys[sel]
  for kw in (dict(top_p=1 - 1e-4), dict(top_k=130), dict(min_p=jnp.float32(np.exp(-4.75))),
             dict(top_k=125, top_p=0.999)):
    got = fs.sample(h, w, keys, backend=backend, **kw, **RL)
    want = fs.reference.sample(h, w, keys, **kw, **RL)
    cases.check_rl(got, want)
    assert np.any(np.asarray(want.kept_count) > 64)                 # overflow rows
  # Ties at the top-k edge: every id tied at the k-th value is kept.
  b, v = 6, 300
  hh = jnp.ones((b, 64), jnp.bfloat16)
  ww = np.zeros((v, 64), np.float32)
  ww[:, 0] = np.repeat(np.arange(30), 10)[::-1][:v] / 4
  ww = jnp.asarray(ww, jnp.bfloat16)
  got = fs.sample(hh, ww, jax.random.key(1), backend=backend, top_k=15, **RL)
  want = fs.reference.sample(hh, ww, jax.random.key(1), top_k=15, **RL)
  cases.check_rl(got, want)
  assert np.all(np.asarray(got.kept_count) == 20)


def test_greedy_rows_and_several_samples():
  kw = dict(top_k=40, top_p=0.8)
  t = cases.T.at[:3].set(0.0)
  got = fs.sample(cases.H, cases.W, cases.KEYS["per_row"], temperature=t, num_samples=3,
                  backend="xla", **kw, **RL)
  want = fs.reference.sample(cases.H, cases.W, cases.KEYS["per_row"], temperature=t,
                             num_samples=3, **kw, **RL)
  assert got.logprob_raw.shape == (3, cases.B) and got.entropy.shape == (cases.B,)
  assert got.kept_ids.shape == (cases.B, 64)
  cases.check_rl(got, want)


def test_rows_with_nothing_to_sample():
  mask = np.zeros((cases.B, -(-cases.V // 32)), np.uint32)
  mask[1:] = 0xFFFFFFFF
  got = fs.sample(cases.H, cases.W, cases.KEYS["scalar"], temperature=cases.T,
                  allowed_mask=jnp.asarray(mask), backend="xla", top_k=5, **RL)
  assert got.tokens[0] == -1 and got.kept_count[0] == 0 and np.all(got.kept_ids[0] == -1)
  assert np.isnan(got.logprob_raw[0]) and np.isnan(got.entropy_truncated[0])
  want = fs.reference.sample(cases.H, cases.W, cases.KEYS["scalar"], temperature=cases.T,
                             allowed_mask=jnp.asarray(mask), top_k=5, **RL)
  cases.check_rl(got, want)


def test_params_jit_and_empty_batch():
  params = fs.SamplingParams(temperature=0.7, top_k=30, return_entropy=True, return_kept=8)
  f = jax.jit(lambda h, k, p: fs.sample(h, cases.W, k, p, backend="xla"))
  got = f(cases.H, cases.KEYS["scalar"], params)
  want = fs.reference.sample(cases.H, cases.W, cases.KEYS["scalar"], temperature=0.7,
                             top_k=30, return_entropy=True, return_kept=8)
  np.testing.assert_array_equal(got.kept_ids, want.kept_ids)
  np.testing.assert_allclose(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)
  assert got.logprob is None and got.logprob_raw is None
  empty = fs.sample(cases.H[:0], cases.W, cases.KEYS["scalar"], **RL)
  assert empty.kept_ids.shape == (0, 64) and empty.entropy.shape == (0,)


def test_bad_arguments_name_them():
  key = cases.KEYS["scalar"]
  with pytest.raises(ValueError, match=r"return_kept=1025 must be in \[0, 1024\]"):
    fs.sample(cases.H, cases.W, key, return_kept=1025)
  with pytest.raises(TypeError, match=r"return_kept=True must be a Python int"):
    fs.sample(cases.H, cases.W, key, return_kept=True)
  with pytest.raises(TypeError, match=r"return_entropy='yes' must be a bool"):
    fs.sample(cases.H, cases.W, key, return_entropy="yes")
  with pytest.raises(TypeError, match=r"return_raw_logprobs=1 must be a bool"):
    fs.sample(cases.H, cases.W, key, return_raw_logprobs=1)
  # What a backend does not compute it refuses by name (the mosaic kernels:
  # raw top-N lists); auto takes one that does.
  from flashsample_jax.backends.mosaic import MosaicBackend
  mosaic = MosaicBackend(interpret=True)
  with pytest.raises(NotImplementedError, match=r"mosaic backend does not yet list the raw"):
    fs.sample(cases.H, cases.W, key, top_logprobs=5, top_logprobs_mode="raw",
              backend=mosaic)
  assert fs.backends.get(fs.which_backend(cases.H, cases.W, key, return_kept=4)).rl_outputs()
  # A backend without the RL fields (a user's own) refuses them and scores.
  from flashsample_jax.backends.xla import XlaBackend

  class NoRl(XlaBackend):
    def rl_outputs(self):
      return False

  for call in (lambda: fs.sample(cases.H, cases.W, key, return_entropy=True, backend=NoRl()),
               lambda: fs.score_tokens(cases.H, cases.W, jnp.zeros((cases.B,), jnp.int32),
                                       backend=NoRl())):
    with pytest.raises(NotImplementedError, match=r"does not yet compute entropies, raw "
                                                  r"log-probabilities, kept sets or scores"):
      call()


@pytest.mark.skipif(has_gpu(), reason="needs 8 CPU devices as jax.devices()")
def test_sharded_rl_outputs_on_1_2_8_shards():
  # 1, 2 and 8 shards (CI time: 4 lies between; tests/test_sharding.py runs
  # the controls on 1/2/4/8).
  kw = dict(top_k=40, top_p=0.9, softcap=8.0, top_logprobs=6, top_logprobs_mode="raw", **RL)
  h, w = cases.H, cases.W[:3000]                       # 3000: divisible by 8
  want = fs.reference.sample(h, w, cases.KEYS["scalar"], temperature=cases.T, **kw)
  for n in (1, 2, 8):
    mesh = jax.make_mesh((n,), ("tp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:n])
    got = fs.sample_sharded(h, w, cases.KEYS["scalar"], mesh=mesh, vocab_axis="tp",
                            temperature=cases.T, **kw)
    cases.check_rl(got, want)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(has_gpu(), reason="needs 8 CPU devices as jax.devices()")
def test_float_outputs_across_shard_counts_within_2_ulp():
  # Shards merge their parts in shard order, so a row's float bits may move
  # with the shard count (docs/design.md, "Determinism and RL"); the tokens
  # may not. A log-probability is t - lse, so it carries the log-sum-exp's
  # rounding: within 2 ulp of the log-sum-exp's magnitude (of the raw one
  # for logprob_raw); entropies within 2 ulp of themselves. Random inputs,
  # per-row keys, 1/2/8 shards (CI time; 4 measured the same:
  # docs/design.md, "Determinism and RL").
  b, v = 40, 4096
  h, w = inputs.random_inputs(b, 128, v, seed=3, logit_std=3.0)
  keys = inputs.row_keys(b, seed=1)
  t = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, b), jnp.float32)
  for kw in (dict(), dict(top_k=50, top_p=0.9), dict(min_p=0.05, softcap=20.0)):
    outs = {}
    for n in (1, 2, 8):
      mesh = jax.make_mesh((n,), ("tp",), axis_types=(AxisType.Auto,),
                           devices=jax.devices()[:n])
      outs[n] = fs.sample_sharded(h, w, keys, mesh=mesh, vocab_axis="tp", temperature=t,
                                  return_logprobs=True, return_entropy=True,
                                  return_raw_logprobs=True, **kw)
    one = outs[1]
    lse = np.abs(np.asarray(one.logsumexp))
    c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, softcap=kw.get("softcap"))
    raw_l = np.asarray(reference.raw_logits(problem.prepare(h, w, keys), c))
    raw_l = np.take_along_axis(raw_l, np.asarray(one.tokens)[:, None], 1)[:, 0]
    raw_lse = np.abs(raw_l - np.asarray(one.logprob_raw))
    scales = dict(logprob=lse, logprob_truncated=lse, logsumexp=lse, logprob_raw=raw_lse,
                  entropy=0.0, entropy_truncated=0.0)
    for n in (2, 8):
      np.testing.assert_array_equal(outs[n].tokens, one.tokens)
      for name, scale in scales.items():
        a, want = np.asarray(getattr(outs[n], name)), np.asarray(getattr(one, name))
        ulp = np.spacing(np.maximum(np.abs(want), scale).astype(np.float32))
        worst = float(np.max(np.abs(a - want) / ulp))
        assert worst <= 2.0, (kw, n, name, worst)


# -- score_tokens: the log-probabilities of given tokens ----------------------


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_score_tokens_is_bit_for_bit_what_sample_returned(backend):
  # Random inputs, so that any other summation order would show in the bits.
  h, w = inputs.random_inputs(48, 128, 4099, seed=3, logit_std=3.0)
  t = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, 48), jnp.float32).at[:4].set(0)
  keys = inputs.row_keys(48, seed=1)
  hist = jnp.asarray(np.random.default_rng(1).integers(0, 4099, (48, 16)), jnp.int32)
  for kw in (dict(), dict(top_k=50, top_p=0.9), dict(min_p=0.05, softcap=20.0),
             dict(top_p=0.95, repetition_penalty=1.2, output_ids=hist)):
    out = fs.sample(h, w, keys, temperature=t, backend=backend, return_logprobs=True,
                    return_entropy=True, return_raw_logprobs=True, **kw)
    sc = fs.score_tokens(h, w, out.tokens, temperature=t, backend=backend, **kw)
    for name in ("logprob", "logprob_truncated", "logprob_raw", "entropy",
                 "entropy_truncated"):
      a, b = np.asarray(getattr(out, name)), np.asarray(getattr(sc, name))
      np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=name)
    assert np.all(np.asarray(sc.in_kept))


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_score_tokens_takes_the_list_lengths_of_the_sample_call(backend):
  # Found by review: with a truncation rule, top_logprobs=N or
  # return_kept=N lengthens the candidate lists to N + the slack, so a kept
  # set of 129 to ~N ids was certified on them in sample and redone from
  # materialized logits in score_tokens (lists of 128): other bits (1 row
  # each here before). score_tokens takes them as sample does, keywords or
  # params. Row r: 140 + r ids of near-equal logits, the rest far below, so
  # that top-p 0.9 keeps ~126-133 ids (one-hot hidden states: exact logits).
  b, d, v = 8, 64, 4096
  rng = np.random.default_rng(1)
  w = np.zeros((v, d), np.float32)
  w[:, :b] = -30.0
  for r in range(b):
    w[rng.choice(v, 140 + r, replace=False), r] = rng.normal(0, 0.05, 140 + r)
  h, w = jnp.asarray(np.eye(b, d, dtype=np.float32)), jnp.asarray(w)
  keys = jax.random.split(jax.random.key(1), b)
  names = ("logprob", "logprob_truncated", "entropy", "entropy_truncated")
  for kw in (dict(top_logprobs=128), dict(return_kept=136)):
    params = fs.SamplingParams(top_p=0.9, return_logprobs=True, return_entropy=True, **kw)
    out = fs.sample(h, w, keys, params, backend=backend)
    for sc in (fs.score_tokens(h, w, out.tokens, top_p=0.9, backend=backend, **kw),
               fs.score_tokens(h, w, out.tokens, params, backend=backend)):
      for name in names:
        np.testing.assert_array_equal(np.asarray(getattr(out, name)).view(np.uint32),
                                      np.asarray(getattr(sc, name)).view(np.uint32),
                                      err_msg=f"{kw} {name}")
  kept = np.asarray(fs.sample(h, w, keys, top_p=0.9, return_kept=256, backend=backend).kept_count)
  assert np.any((kept > stage2.CANDIDATES) & (kept <= 136)), kept
  # Checked as sample checks them, raw lists included (they decide the route).
  with pytest.raises(ValueError, match=r"top_logprobs=-1 must be in"):
    fs.score_tokens(h, w, out.tokens, top_logprobs=-1, top_logprobs_mode="raw")
  with pytest.raises(TypeError, match=r"return_kept=True must be a Python int"):
    fs.score_tokens(h, w, out.tokens, return_kept=True)


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_score_tokens_of_non_finite_rows_is_what_sample_returned(backend):
  # Found by review: a row of NaN logits sampled plainly scored -inf and
  # in_kept False for the token sample returned (in_kept tested t > -inf);
  # a greedy row whose kept set is empty (a +inf logit with min_p) reported
  # logprob_truncated +inf from sample and -inf from score_tokens. Both NaN.
  b, d, v = 3, 8, 64
  rng = np.random.default_rng(0)
  h = rng.normal(size=(b, d)).astype(np.float32)
  w = rng.normal(size=(v, d)).astype(np.float32)
  h[0, 3] = np.nan                       # row 0: every logit NaN
  h[1] = 0.0
  h[1, 0] = 2.0                          # row 1: the logit of id 40 is +inf
  w[:, 0] = 0.1
  w[40, 0] = 3e38
  h, w = jnp.asarray(h), jnp.asarray(w)
  for kw, kept in ((dict(temperature=1.0), [True, True, True]),
                   (dict(temperature=jnp.asarray([1.0, 0.0, 1.0]), min_p=0.1),
                    [False, False, True])):
    key = jax.random.key(0)
    out = fs.sample(h, w, key, backend=backend, return_logprobs=True, **kw)
    ref = fs.reference.sample(h, w, key, return_logprobs=True, **kw)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.logprob_truncated, ref.logprob_truncated)
    sc = fs.score_tokens(h, w, jnp.maximum(out.tokens, 0), backend=backend, **kw)
    np.testing.assert_array_equal(sc.logprob_truncated, out.logprob_truncated)
    np.testing.assert_array_equal(sc.in_kept, kept)
    assert np.isnan(np.asarray(out.logprob_truncated)[:2]).all(), kw


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_score_tokens_is_bit_for_bit_what_each_of_several_samples_returned(backend):
  # A GRPO-style group: num_samples=4, then each sample's tokens scored. The
  # streaming pass sizes its chunks for B x S rows when it reports no float;
  # with floats for B (backends/xla.py, _chunk_rows), so that its merges are
  # score_tokens' own. V spans several chunks either way.
  b, v, s = 48, 12007, 4
  h, w = inputs.random_inputs(b, 64, v, seed=4, logit_std=3.0)
  t = jnp.asarray(np.random.default_rng(2).uniform(0.5, 1.5, b), jnp.float32)
  keys = inputs.row_keys(b, seed=2)
  for kw in (dict(), dict(top_k=50, top_p=0.9)):
    kw = dict(kw, temperature=t, backend=backend)
    out = fs.sample(h, w, keys, num_samples=s, return_logprobs=True, return_entropy=True,
                    return_raw_logprobs=True, **kw)
    for j in range(s):
      sc = fs.score_tokens(h, w, out.tokens[j], **kw)
      for name in ("logprob", "logprob_truncated", "logprob_raw", "entropy",
                   "entropy_truncated"):
        a = np.asarray(getattr(out, name))
        a = a[j] if a.ndim == 2 else a                # entropies are per row
        np.testing.assert_array_equal(a.view(np.uint32),
                                      np.asarray(getattr(sc, name)).view(np.uint32),
                                      err_msg=f"{name}, sample {j}, {kw}")


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_float_outputs_at_small_temperatures(backend):
  # A temperature far below 1 is a normal float and samples (README): one
  # ulp of t = l / T is then large, and a pass whose row maximum and
  # exp(t - max) sum read two roundings of t reported entropies off by
  # 1e-3 (T = 1e-3) and an infinite log-sum-exp (T = 1e-30). Against the
  # reference: tokens, entropies to 1e-5, log-sum-exps to 2 ulp.
  b, v = 8, 1003
  k1, k2 = jax.random.split(jax.random.key(0))
  h = jax.random.normal(k1, (b, 64)) * 0.6
  w = jax.random.normal(k2, (v, 64))
  keys = jax.random.split(jax.random.key(2), b)
  for t in (1e-3, 1e-5, 1e-30):
    kw = dict(temperature=t, return_logprobs=True, return_entropy=True, top_logprobs=2)
    want = fs.reference.sample(h, w, keys, **kw)
    got = fs.sample(h, w, keys, backend=backend, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    lse = np.asarray(want.logsumexp)
    assert np.all(np.isfinite(lse)) and np.all(np.isfinite(np.asarray(got.logsumexp)))
    np.testing.assert_allclose(got.logsumexp, lse, rtol=2 ** -22, err_msg=f"T={t}")
    for name in ("entropy", "entropy_truncated"):
      np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=1e-5,
                                 err_msg=f"{name}, T={t}")


def test_entropy_of_a_row_with_an_infinite_or_nan_logit_is_nan():
  # Such a row's softmax is NaN, and so are its log-probabilities; the
  # reference's entropy was -0.0 there (its q > 0 mask dropped the NaN
  # terms) where the backends report NaN. Row 0: a NaN logit (+inf - inf);
  # row 1: a +inf one; row 2: finite, a control.
  h = jnp.asarray([[0.5] * 16, [0.5] * 15 + [-0.5], [0.5] * 16], jnp.float32)
  w = jax.random.normal(jax.random.key(3), (300, 16))
  w = w.at[7].set(jnp.inf).at[7, 15].set(-jnp.inf)
  w = jnp.where((jnp.arange(3) == 2)[:, None, None], w.at[7].set(0.0), w[None])
  keys = jax.random.split(jax.random.key(1), 3)
  for b in range(3):
    want = fs.reference.sample(h[b:b + 1], w[b], keys[b:b + 1], return_entropy=True)
    got = fs.sample(h[b:b + 1], w[b], keys[b:b + 1], return_entropy=True, backend="xla")
    for name in ("entropy", "entropy_truncated"):
      a, x = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
      assert np.isnan(x[0]) == (b < 2), (b, name, x)
      np.testing.assert_allclose(a, x, atol=1e-5, err_msg=f"row {b} {name}")


def test_score_tokens_of_any_token_against_float64():
  kw = {k: v for k, v in cases.CASES["penalties_all"].items() if k != "top_logprobs"}
  r = np.random.default_rng(5)
  ent, ent_kept, raw_lp, keep, tt = _f64_outputs(kw)
  # Half the rows score a kept id, half an id truncation removes.
  tok = np.array([r.choice(np.flatnonzero(keep[b] if b % 2 else ~keep[b] & np.isfinite(tt[b])))
                  for b in range(cases.B)])
  sc = fs.score_tokens(cases.H, cases.W, jnp.asarray(tok, jnp.int32), temperature=cases.T,
                       **kw)
  lse = np.log(np.sum(np.exp(tt - tt.max(axis=1, keepdims=True)), axis=1)) + tt.max(axis=1)
  kt = np.where(keep, tt, -np.inf)
  lse_k = np.log(np.sum(np.exp(kt - kt.max(axis=1, keepdims=True)), axis=1)) + kt.max(axis=1)
  rows = np.arange(cases.B)
  np.testing.assert_array_equal(sc.in_kept, rows % 2 == 1)
  np.testing.assert_allclose(sc.logprob, tt[rows, tok] - lse, atol=1e-5, rtol=1e-5)
  want_k = np.where(rows % 2 == 1, tt[rows, tok] - lse_k, -np.inf)
  np.testing.assert_allclose(sc.logprob_truncated, want_k, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(sc.logprob_raw, raw_lp[rows, tok], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(sc.entropy, ent, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(sc.entropy_truncated, ent_kept, atol=1e-5, rtol=1e-5)


def test_score_tokens_under_jit_params_and_errors():
  params = fs.SamplingParams(temperature=0.7, top_k=30, return_kept=4)
  tok = jnp.arange(cases.B, dtype=jnp.int32)
  # Both jitted: the params are the keywords, program for program (an
  # eager call compiles its ops one by one, which may round otherwise).
  got = jax.jit(lambda h, tk: fs.score_tokens(h, cases.W, tk, params))(cases.H, tok)
  want = jax.jit(lambda h, tk: fs.score_tokens(h, cases.W, tk, temperature=0.7, top_k=30))(
      cases.H, tok)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match=r"token_ids\[2\]=3001 must be in \[0, 3001\)"):
    fs.score_tokens(cases.H, cases.W, tok.at[2].set(3001))
  with pytest.raises(ValueError, match=r"token_ids.shape=\(23,\) must be \[B\]=\(24,\)"):
    fs.score_tokens(cases.H, cases.W, tok[1:])
  with pytest.raises(TypeError, match=r"token_ids must be an integer array"):
    fs.score_tokens(cases.H, cases.W, tok.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"params.num_samples=2 must be None"):
    fs.score_tokens(cases.H, cases.W, tok, fs.SamplingParams(num_samples=2))
  with fs.traced_checks():
    err, _ = jax.jit(jax.experimental.checkify.checkify(
        lambda tk: fs.score_tokens(cases.H, cases.W, tk)))(tok.at[5].set(-1))
  with pytest.raises(Exception, match=r"token_ids\[5\]=-1 must be in \[0, 3001\)"):
    err.throw()


@pytest.mark.skipif(has_gpu(), reason="needs 8 CPU devices as jax.devices()")
def test_score_tokens_in_shard_map():
  kw = dict(top_k=40, top_p=0.9, softcap=8.0)
  h, w = cases.H, cases.W[:3000]
  tok = jnp.asarray(np.random.default_rng(6).integers(0, 3000, cases.B), jnp.int32)
  want = fs.score_tokens(h, w, tok, temperature=cases.T, **kw)
  for n in (2, 8):
    mesh = jax.make_mesh((n,), ("tp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:n])
    f = jax.shard_map(
        lambda h, w, tk: fs.score_tokens(h, w, tk, temperature=cases.T, vocab_axis="tp",
                                         **kw),
        mesh=mesh, in_specs=(P(), P("tp", None), P()), out_specs=P(), check_vma=False)
    got = jax.jit(f)(h, w, tok)
    np.testing.assert_array_equal(got.in_kept, want.in_kept)
    for name in ("logprob", "logprob_truncated", "logprob_raw", "entropy",
                 "entropy_truncated"):
      np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-6,
                                 atol=1e-6, err_msg=name)


def test_state_from_parts_merges_the_rl_fields_of_kernel_parts():
  # What a kernel reports per tile, merged, equals one block over the row.
  from flashsample_jax import stage2
  from pallas_kernels.state import ControlsState
  r = np.random.default_rng(7)
  t = r.standard_normal((5, 96)).astype(np.float32) * 3
  t[0] = -np.inf                                      # an empty row
  t[1, :40] = -np.inf                                 # an empty first part
  t = jnp.asarray(t)
  raw = jnp.asarray(r.standard_normal((5, 96)).astype(np.float32))
  gid = jnp.arange(96)
  c = controls.Controls(return_entropy=True, return_raw_logprobs=True, return_kept=4,
                        given_ids=jnp.asarray([3, 50, 95, 0, 17], jnp.int32))

  def block(tb, rb, gb):
    mx = jnp.max(tb, axis=1)
    st = ControlsState(best_score=tb[:, :1], best_id=jnp.zeros((5, 1), jnp.int32),
                       best_t=tb[:, :1], lse_max=mx,
                       lse_sum=jnp.sum(jnp.where(mx[:, None] == -jnp.inf, 0.0,
                                                 jnp.exp(tb - mx[:, None])), axis=1))
    return stage2.rl_state(c, st, tb, rb, gid=gb)

  whole = block(t, raw, gid)
  parts = [block(t[:, a:a + 32], raw[:, a:a + 32], gid[a:a + 32]) for a in (0, 32, 64)]
  stack = lambda name: jnp.stack([getattr(q, name) for q in parts], axis=-1)
  merged = stage2.state_from_parts(
      stack("best_score"), stack("best_id"), None, stack("lse_max"), stack("lse_sum"),
      m=4, ent_sum=stack("ent_sum"), raw_max=stack("raw_max"), raw_sum=stack("raw_sum"),
      finite_count=stack("finite_count"), given_t=stack("given_t"))
  for name in ("lse_max", "lse_sum", "ent_sum", "raw_max", "raw_sum"):
    np.testing.assert_allclose(getattr(merged, name), getattr(whole, name), rtol=1e-5,
                               atol=1e-5, err_msg=name)
  np.testing.assert_array_equal(merged.finite_count, whole.finite_count)
  np.testing.assert_array_equal(merged.given_t, whole.given_t)
  ent = jnp.log(merged.lse_sum) - merged.ent_sum / merged.lse_sum
  np.testing.assert_allclose(ent[1:], controls.entropy(t)[1:], rtol=1e-5, atol=1e-5)


# -- top_logprobs_mode="raw" ---------------------------------------------------


@pytest.mark.parametrize("backend", ["xla", "dense"])
def test_raw_top_logprobs(backend):
  # Every control together, then with the penalties (the xla backend's
  # streaming pass; the dense route shares its stage 2: "all" there).
  for case in ("all", "penalties_all") if backend == "xla" else ("all",):
    kw = {k: v for k, v in cases.CASES[case].items() if k != "top_logprobs"}
    args = (cases.H, cases.W, cases.KEYS["scalar"])
    got = fs.sample(*args, temperature=cases.T, backend=backend, top_logprobs=12,
                    top_logprobs_mode="raw", **kw)
    want = fs.reference.sample(*args, temperature=cases.T, top_logprobs=12,
                               top_logprobs_mode="raw", **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=1e-5, atol=1e-5)
    # Against the raw logits written out, and unlike the processed top N.
    raw = np.asarray(reference._logits(problem.prepare(*args)), np.float64)
    if "softcap" in kw:
      raw = float(kw["softcap"]) * np.tanh(raw / float(kw["softcap"]))
    lse = np.log(np.exp(raw - raw.max(1, keepdims=True)).sum(1)) + raw.max(1)
    ids = np.asarray(got.top_ids)
    np.testing.assert_allclose(got.top_logprobs,
                               np.take_along_axis(raw, ids, 1) - lse[:, None], atol=1e-5)
    proc = fs.sample(*args, temperature=cases.T, backend=backend, top_logprobs=12, **kw)
    assert not np.array_equal(proc.top_ids, got.top_ids)
  # Ties at the N-th raw logit: uncertified on the lists, decided on the
  # exact path (every raw logit of these rows is one of three values).
  h = jnp.ones((4, 64), jnp.bfloat16)
  w = jnp.asarray(np.repeat([[1.0], [0.0], [-1.0]], 100, axis=0) * np.ones((1, 64)),
                  jnp.bfloat16)
  got = fs.sample(h, w, jax.random.key(0), backend=backend, top_logprobs=5,
                  top_logprobs_mode="raw", temperature=0.5)
  want = fs.reference.sample(h, w, jax.random.key(0), top_logprobs=5,
                             top_logprobs_mode="raw", temperature=0.5)
  np.testing.assert_array_equal(got.top_ids, want.top_ids)
  np.testing.assert_array_equal(got.top_ids[0], np.arange(5))
  np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=1e-6)
  with pytest.raises(ValueError, match=r"top_logprobs_mode='logits' must be one of"):
    fs.sample(h, w, jax.random.key(0), top_logprobs=5, top_logprobs_mode="logits")
  # Rows of -inf logits and rows with +inf ones: -1 where the raw logit is
  # -inf, decided before the log-sum-exp (found by review: a row of -inf
  # listed ids 0, 1 with NaN; a finite id beside two +inf ones became -1).
  logits = jnp.asarray([[1.0, 2.0, 3.0, 0.0], [-jnp.inf] * 4, [jnp.inf, 1.0, jnp.inf, -jnp.inf]])
  for f in (fs.sample_logits, fs.reference.sample_logits):
    out = f(logits, jax.random.key(0), top_logprobs=4, top_logprobs_mode="raw")
    np.testing.assert_array_equal(out.top_ids, [[2, 1, 0, 3], [-1] * 4, [0, 2, 1, -1]])
    assert np.isnan(np.asarray(out.top_logprobs[1])).all()
    np.testing.assert_array_equal(np.asarray(out.top_logprobs[2, 2:]), [-np.inf, -np.inf])


def test_parts_sum_adds_in_a_fixed_pairwise_order():
  # state.parts_sum merges a kernel's per-tile (per-warpgroup) sums in an
  # order fixed by the number of parts alone (docs/design.md, "Determinism
  # and RL"): the same bits as this float32 pairwise tree, for any batch
  # around a row.
  from pallas_kernels import state  # pylint: disable=import-outside-toplevel
  r = np.random.default_rng(3)
  x = (r.exponential(size=(9, 1187)) ** 4).astype(np.float32)

  def tree(row):
    row = np.concatenate([row, np.zeros((1 << (len(row) - 1).bit_length()) - len(row),
                                        np.float32)])
    while len(row) > 1:
      row = row[:len(row) // 2] + row[len(row) // 2:]
    return row[0]

  want = np.asarray([tree(row) for row in x]).view(np.uint32)
  sums = jax.jit(state.parts_sum)
  np.testing.assert_array_equal(np.asarray(sums(jnp.asarray(x))).view(np.uint32), want)
  for b in (1, 2, 5):
    np.testing.assert_array_equal(np.asarray(sums(jnp.asarray(x[:b]))).view(np.uint32),
                                  want[:b])
  # A sequential sum rounds differently on such rows: the order is pinned.
  assert (np.cumsum(x, axis=1, dtype=np.float32)[:, -1].view(np.uint32) != want).any()


def test_kept_log_sum_exp_and_entropy_sum_in_the_fixed_order():
  # stage2.fixed_logsumexp and the kept candidates' entropy sum a row in
  # parts_sum's order, not jnp.sum's (which on a GPU follows the batch's
  # shape: docs/design.md, "Determinism and RL"): the same bits as the
  # float32 formula on each row with that tree, and jax.nn.logsumexp's
  # value and special rows.
  from flashsample_jax import stage2  # pylint: disable=import-outside-toplevel
  from pallas_kernels import state  # pylint: disable=import-outside-toplevel
  r = np.random.default_rng(4)
  x = (r.standard_normal((7, 300)) * 4).astype(np.float32)
  x[:, 200:] = -np.inf                     # past a kept set's end
  x[1] = -np.inf                           # nothing kept
  x[2, 5] = np.inf
  x[3, 7] = np.nan
  got = np.asarray(jax.jit(stage2.fixed_logsumexp)(jnp.asarray(x)))
  m = np.max(x, axis=1)
  safe = jnp.asarray(np.where(np.isfinite(m), m, 0), jnp.float32)
  want = np.asarray(jnp.log(state.parts_sum(jnp.exp(jnp.asarray(x) - safe[:, None]))) + safe)
  finite = np.isfinite(want)
  np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
  np.testing.assert_allclose(got, jax.nn.logsumexp(jnp.asarray(x), axis=1), rtol=2e-7)
  assert got[1] == -np.inf and got[2] == np.inf and np.isnan(got[3])
  for b in (1, 2, 5):   # a row's bits alone as in the batch
    part = np.asarray(stage2.fixed_logsumexp(jnp.asarray(x[:b])))
    np.testing.assert_array_equal(part[finite[:b]].view(np.uint32),
                                  got[:b][finite[:b]].view(np.uint32))
  # The kept entropy takes the same tree for both of its sums.
  keep = np.isfinite(x[4:5])
  ent = float(np.asarray(stage2._kept_entropy(jnp.asarray(keep), jnp.asarray(x[4:5])))[0])
  t = x[4][keep[0]].astype(np.float64)
  p = np.exp(t - t.max()) / np.exp(t - t.max()).sum()
  np.testing.assert_allclose(ent, -(p * np.log(p)).sum(), rtol=1e-5)
  ent_tree = np.asarray(controls.entropy(jnp.asarray(np.where(keep, x[4:5], -np.inf)),
                                         lambda v: state.parts_sum(v, axis=-1)))
  np.testing.assert_array_equal(np.float32(ent).view(np.uint32), ent_tree.view(np.uint32))
