"""One test base that every backend subclasses.

A subclass sets ``backend`` (a name of ``fs.BACKENDS`` or a backend instance,
e.g. ``MosaicBackend(interpret=True)``) and may override the shape tables.
Plain sampling and every sampling control are checked against
``flashsample_jax.reference.sample``: exact inputs demand 100% identical
tokens (and log-probabilities within 2e-5), random inputs >= 99.9%.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from benchmarks.shapes import HEADS
from tests import cases, inputs


class BackendSuite:
  backend = ""
  # (B, D, V) triples small enough for the slowest subclass (interpret mode).
  shapes = [(1, 64, 200), (5, 64, 1000), (16, 128, 517), (37, 64, 2048)]
  dtypes = [jnp.bfloat16, jnp.float16, jnp.float32]
  # Control cases a slow subclass leaves to a case that covers them
  # (name -> the covering case), e.g. in interpret mode.
  covered_cases: dict[str, str] = {}
  # The same for test_controls_with_samples_and_logprobs.
  covered_sample_cases: dict[str, str] = {}
  # The control cases that test_control_matches_reference also runs with
  # per-row keys (None: all). Keys reach a kernel as per-row data that no
  # control touches, so a slow subclass may run them with fewer cases.
  row_key_cases: frozenset[str] | None = None
  # The rows of cases.H that test_top_logprobs_edges's greedy top 128 runs
  # on (None: all); a slow subclass may take fewer (each row has its ties).
  greedy_top_rows: int | None = None

  def run(self, hidden, weight, key, **kw):
    return fs.sample(hidden, weight, key, backend=self.backend, **kw)

  def check_exact(self, hidden, weight, key, **kw):
    got = np.asarray(self.run(hidden, weight, key, **kw))
    want = np.asarray(fs.reference.sample(hidden, weight, key, **kw))
    assert got.dtype == np.int32 and got.shape == want.shape
    mismatch = np.nonzero(got != want)[0]
    assert mismatch.size == 0, (
        f"{mismatch.size}/{want.size} rows differ, e.g. row {mismatch[0]}: "
        f"got {got[mismatch[0]]}, want {want[mismatch[0]]}")
    return got

  def check_controls(self, kw, key=cases.KEYS["scalar"], h=cases.H, w=cases.W,
                     t=cases.T, **extra):
    """Tokens equal to the reference's; log-probabilities within 2e-5."""
    return self.checked_output(kw, key, h, w, t, **extra)[0]

  def checked_output(self, kw, key=cases.KEYS["scalar"], h=cases.H, w=cases.W,
                     t=cases.T, **extra):
    """:meth:`check_controls`, returning ``(tokens, the backend's output)``
    (for further checks of that output without running the backend again)."""
    got = self.run(h, w, key, temperature=t, **kw, **extra)
    want = fs.reference.sample(h, w, key, temperature=t, **kw, **extra)
    if isinstance(want, fs.SampleOutput):
      np.testing.assert_array_equal(got.tokens, want.tokens)
      if "softcap" in kw and want.top_ids is not None:
        # A kernel's tanh may differ from XLA's in the last bit
        # (docs/design.md, "Soft-cap"): ids whose capped logits tie exactly
        # in the reference may then come in another order. Elsewhere the
        # ids are identical; here each listed id must be one whose
        # reference log-probability is the one listed at its place.
        got_ids, want_ids = np.asarray(got.top_ids), np.asarray(want.top_ids)
        got_lp, want_lp = np.asarray(got.top_logprobs), np.asarray(want.top_logprobs)
        for b, j in np.argwhere(got_ids != want_ids):
          assert abs(got_lp[b, j] - want_lp[b, j]) <= 2e-5, (b, j)
          k = np.flatnonzero(want_ids[b] == got_ids[b, j])   # none: a tie at the N-th
          assert all(abs(want_lp[b, i] - want_lp[b, j]) <= 2e-5 for i in k), (b, j)
      else:
        np.testing.assert_array_equal(got.top_ids, want.top_ids)
      for name in ("logprob", "logprob_truncated", "logsumexp", "top_logprobs"):
        if getattr(want, name) is None:
          assert getattr(got, name) is None, name
          continue
        np.testing.assert_allclose(getattr(got, name), getattr(want, name),
                                   rtol=2e-5, atol=2e-5, err_msg=name)
      return np.asarray(got.tokens), got
    np.testing.assert_array_equal(got, want)
    return np.asarray(got), got

  # -- exact inputs: 100% identical tokens --------------------------------

  @pytest.mark.parametrize("layout", ["vd", "dv"])
  def test_scalar_key(self, layout):
    for i, (b, d, v) in enumerate(self.shapes):
      h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=i)
      t = inputs.pow2_temperatures(b, seed=i)
      self.check_exact(h, w, jax.random.key(i), temperature=t,
                       weight_layout=layout)

  @pytest.mark.parametrize("layout", ["vd", "dv"])
  def test_per_row_keys(self, layout):
    for i, (b, d, v) in enumerate(self.shapes):
      h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=10 + i)
      self.check_exact(h, w, inputs.row_keys(b, seed=i), temperature=1.0,
                       weight_layout=layout)

  def test_greedy_and_mixed_rows(self):
    b, d, v = self.shapes[-1]
    h, w = inputs.exact_inputs(b, d, v, seed=3)
    self.check_exact(h, w, jax.random.key(0), temperature=0.0)
    t = inputs.pow2_temperatures(b, greedy_every=3, seed=3)
    self.check_exact(h, w, jax.random.key(0), temperature=t)
    self.check_exact(h, w, inputs.row_keys(b), temperature=t)

  def test_greedy_ties_take_lowest_id(self):
    # All-zero weight: every logit ties, greedy must return id 0, and an
    # all-equal row with duplicated winners must return the first.
    b, d, v = 8, 64, 300
    h, w = inputs.exact_inputs(b, d, v, seed=4)
    w = w.at[:].set(0).at[123].set(1).at[250].set(1)
    h = jnp.abs(h) + 1
    tok = self.check_exact(h, w, jax.random.key(0), temperature=0.0)
    assert (tok == 123).all()

  def test_padded_vocab(self):
    for layout in ("vd", "dv"):
      h, w = inputs.exact_inputs(9, 64, 700, layout=layout, seed=5)
      # Make the padding rows attractive: they must still never be returned.
      big = jnp.asarray(100, w.dtype)
      w = w.at[650:].set(big) if layout == "vd" else w.at[:, 650:].set(big)
      h = jnp.abs(h) + 1
      for t in (1.0, 0.0):
        tok = self.check_exact(h, w, jax.random.key(1), temperature=t,
                               weight_layout=layout, vocab_size=650)
        assert (tok < 650).all()
      self.check_exact(h, w, inputs.row_keys(9), weight_layout=layout,
                       vocab_size=650)

  def test_dtypes(self):
    for dt in self.dtypes:
      h, w = inputs.exact_inputs(6, 64, 400, dtype=dt, seed=6)
      self.check_exact(h, w, jax.random.key(2), temperature=0.5)

  def test_under_jit_with_traced_arguments(self):
    h, w = inputs.exact_inputs(8, 64, 512, seed=7)
    t = inputs.pow2_temperatures(8, greedy_every=4, seed=7)
    f = jax.jit(lambda h, w, k, t: self.run(h, w, k, temperature=t))
    for keys in (jax.random.key(3), inputs.row_keys(8, seed=3)):
      want = fs.reference.sample(h, w, keys, temperature=t)
      np.testing.assert_array_equal(f(h, w, keys, t), want)

  def test_decode_loop_in_scan(self):
    # A decode loop: each step samples with a fresh key and feeds the token's
    # embedding back as the next hidden state.
    b, d, v = 4, 64, 256
    h0, w = inputs.exact_inputs(b, d, v, seed=8)

    def loop(sampler):
      def step(carry, key):
        h = carry
        tok = sampler(h, w, key, temperature=2.0)
        return w[tok], tok
      keys = jax.random.split(jax.random.key(4), 6)
      return jax.lax.scan(step, h0, keys)[1]

    got = jax.jit(lambda: loop(self.run))()
    want = jax.jit(lambda: loop(fs.reference.sample))()
    np.testing.assert_array_equal(got, want)

  # -- quantized heads: weight_scale, exact inputs --------------------------

  quantized_dtypes = inputs.QUANTIZED_DTYPES

  @pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
  def test_quantized_heads(self, per_row):
    # Every dtype in both layouts over the two parameters; per-row keys and
    # mixed greedy rows.
    b, d, v = self.shapes[1]
    for i, dt in enumerate(self.quantized_dtypes):
      layout = ("vd", "dv")[(i + per_row) % 2]
      h, w, s = inputs.quantized_inputs(b, d, v, dtype=dt, layout=layout,
                                        per_row=per_row, seed=20 + i)
      t = inputs.pow2_temperatures(b, greedy_every=3, seed=i)
      keys = inputs.row_keys(b, seed=i) if i % 2 else jax.random.key(i)
      self.check_exact(h, w, keys, temperature=t, weight_layout=layout, weight_scale=s)

  @pytest.mark.parametrize("case", ["all", "penalties_all"])
  def test_quantized_heads_with_controls(self, case):
    # The controls apply to the scaled logits: cases.H/W's integers are
    # exact in 8 bits; a power-of-two scale keeps the logits exact.
    dt = jnp.float8_e4m3fn if case == "all" else jnp.int8
    s = inputs.quantized_scale(cases.V, per_row=case == "all", seed=5)
    self.check_controls(dict(cases.CASES[case], return_logprobs=True),
                        w=cases.W.astype(dt), weight_scale=s)

  # -- RL outputs: entropies, raw log-probabilities, kept sets -------------

  @pytest.mark.parametrize("case", ["k_p_minp", "penalties_all"])
  def test_rl_outputs(self, case):
    kw = dict(cases.CASES[case], return_entropy=True, return_raw_logprobs=True,
              return_kept=40, return_logprobs=True)
    impl = (self.backend if isinstance(self.backend, fs.backends.SamplerBackend)
            else fs.backends.get(self.backend))
    if not impl.rl_outputs():
      # Refused by name (auto then takes a backend that computes them).
      with pytest.raises(NotImplementedError, match="does not yet compute entropies"):
        self.run(cases.H, cases.W, cases.KEYS["scalar"], temperature=cases.T, **kw)
      return
    got, out = self.checked_output(kw)
    want = fs.reference.sample(cases.H, cases.W, cases.KEYS["scalar"], temperature=cases.T,
                               **kw)
    np.testing.assert_array_equal(out.kept_ids, want.kept_ids)
    np.testing.assert_array_equal(out.kept_count, want.kept_count)
    for name in ("logprob_raw", "entropy", "entropy_truncated"):
      np.testing.assert_allclose(getattr(out, name), getattr(want, name), rtol=1e-5,
                                 atol=1e-5, err_msg=name)

  # Cases whose scores test_score_tokens_is_what_sample_returned checks here.
  score_cases = ("k_p_minp", "all", "penalties")

  @pytest.mark.parametrize("case", ["k_p_minp", "all", "penalties"])
  def test_score_tokens_is_what_sample_returned(self, case):
    # fs.score_tokens on the tokens fs.sample drew, on the same backend and
    # batch: the same bits in every field (docs/design.md, "Determinism and
    # RL"), each token in its row's kept set; per-row keys.
    if case not in self.score_cases:
      pytest.skip(f"scores run with cases {list(self.score_cases)} here")
    kw = cases.CASES[case]
    out = self.run(cases.H, cases.W, cases.KEYS["per_row"], temperature=cases.T,
                   return_logprobs=True, return_entropy=True, return_raw_logprobs=True, **kw)
    sc = fs.score_tokens(cases.H, cases.W, out.tokens, temperature=cases.T,
                         backend=self.backend, **kw)
    differ = [name for name in ("logprob", "logprob_truncated", "logprob_raw", "entropy",
                                "entropy_truncated")
              if np.any(np.asarray(getattr(out, name)).view(np.uint32)
                        != np.asarray(getattr(sc, name)).view(np.uint32))]
    assert not differ, differ
    assert np.all(np.asarray(sc.in_kept))

  def test_score_tokens_is_what_sample_with_lists_or_samples_returned(self):
    # Found by review: outputs that are not controls (top_logprobs,
    # return_kept, num_samples) changed the floats of a call with no
    # truncation rule, which score_tokens (given only the controls) cannot
    # follow. The mosaic kernel ran another epilogue for them (a row's
    # column slots, so its sums' order, moved), and stage 2 redid every
    # float of a row whose top-N list or kept set the candidates could not
    # certify from the materialized logits (XLA's dot, not the pass's).
    # Random inputs, so that any other summation order shows in the bits,
    # and copies of each row's best weight rows, so that its lists tie and
    # overflow at the edge (uncertified rows).
    b, d, v = 8, 128, 1024
    h, w = inputs.random_inputs(b, d, v, seed=3, logit_std=3.0)
    w = np.asarray(w).copy()
    rng = np.random.default_rng(0)
    best = np.argsort(-(np.asarray(h, np.float32) @ np.asarray(w, np.float32).T), axis=1)
    for r in range(b):
      w[rng.choice(v, 24, replace=False)] = w[best[r, r % 3]]
    w = jnp.asarray(w)
    keys = inputs.row_keys(b, seed=1)
    t = jnp.asarray(rng.uniform(0.5, 1.5, b), jnp.float32)
    names = ("logprob", "logprob_truncated", "entropy", "entropy_truncated")
    for kw in (dict(top_logprobs=5), dict(return_kept=8), dict(num_samples=2)):
      out = self.run(h, w, keys, temperature=t, return_logprobs=True, return_entropy=True,
                     **kw)
      tokens = np.asarray(out.tokens).reshape(-1, b)
      for j, tok in enumerate(tokens):
        sc = fs.score_tokens(h, w, jnp.asarray(tok), temperature=t, backend=self.backend)
        for name in names:
          got = np.asarray(getattr(out, name))
          got = got[j] if got.ndim == 2 else got            # entropies are per row
          differ = np.nonzero(got.view(np.uint32)
                              != np.asarray(getattr(sc, name)).view(np.uint32))[0]
          assert differ.size == 0, (kw, j, name, differ)
      if "top_logprobs" in kw:
        # A token's entry in the top list is its log-probability, bit for bit.
        ids, lps = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
        own = ids == tokens[0][:, None]
        np.testing.assert_array_equal(
            lps.view(np.uint32)[own],
            np.broadcast_to(np.asarray(out.logprob)[:, None], lps.shape).view(np.uint32)[own])

  # -- random inputs: >= 99.9% agreement ------------------------------------

  random_shapes = [(64, 128, 4099), (32, 256, 3000)]

  def test_random_inputs_agree(self):
    agree = total = 0
    for i, (b, d, v) in enumerate(self.random_shapes):
      h, w = inputs.random_inputs(b, d, v, seed=20 + i)
      for keys in (jax.random.key(i), inputs.row_keys(b, seed=i)):
        got = np.asarray(self.run(h, w, keys, temperature=0.7))
        want = np.asarray(fs.reference.sample(h, w, keys, temperature=0.7))
        agree += int((got == want).sum())
        total += got.size
    assert agree / total >= 0.999, f"{agree}/{total} rows agree"

  # -- sampling controls (exact inputs: 100% identical tokens) ---------------

  @pytest.mark.parametrize("case", sorted(cases.CASES))
  @pytest.mark.parametrize("key", sorted(cases.KEYS))
  def test_control_matches_reference(self, case, key):
    if case in self.covered_cases:
      pytest.skip(f"covered by case {self.covered_cases[case]!r} here")
    if key != "scalar" and self.row_key_cases is not None and case not in self.row_key_cases:
      pytest.skip(f"per-row keys run with cases {sorted(self.row_key_cases)} here")
    self.check_controls(cases.CASES[case], cases.KEYS[key])

  @pytest.mark.parametrize("case", ["top_k", "top_p", "all", "penalties_all"])
  def test_controls_with_samples_and_logprobs(self, case):
    if case in self.covered_sample_cases:
      pytest.skip(f"covered by case {self.covered_sample_cases[case]!r} here")
    self.check_controls(cases.CASES[case], num_samples=3, return_logprobs=True)
    self.check_controls(cases.CASES[case], cases.KEYS["per_row"], num_samples=2,
                        return_logprobs=True)

  def test_several_samples_alone(self):
    # Temperature only: a backend may draw the samples as rows of one plain
    # pass; sample 0 is the single-sample call.
    for key in cases.KEYS.values():
      got = self.check_controls({}, key=key, num_samples=5)
      np.testing.assert_array_equal(got[0], self.run(cases.H, cases.W, key,
                                                     temperature=cases.T))

  def test_control_edge_cases(self):
    h, w, b, v = cases.H, cases.W, cases.B, cases.V
    plain = np.asarray(self.run(h, w, cases.KEYS["scalar"], temperature=4.0))
    l = np.asarray(jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32).T))
    top = l == l.max(axis=1, keepdims=True)          # integer logits: ties occur
    unique = top.sum(axis=1) == 1
    greedy = l.argmax(axis=1)
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
      tok = self.check_controls(kw, t=4.0)
      # Only the top logit survives (all of it when tied): greedy where unique.
      assert top[np.arange(b), tok].all(), kw
      np.testing.assert_array_equal(tok[unique], greedy[unique])
    assert unique.any() and not unique.all()
    np.testing.assert_array_equal(self.check_controls(dict(top_k=v + 5), t=4.0), plain)
    np.testing.assert_array_equal(self.check_controls(dict(top_p=1.0), t=4.0), plain)
    np.testing.assert_array_equal(self.check_controls(dict(min_p=0.0), t=4.0), plain)
    # A mask that leaves one id per row: that id, whatever the logits.
    only, mask = cases.only_one_allowed(np.random.default_rng(1))
    np.testing.assert_array_equal(self.check_controls(dict(allowed_mask=mask)), only)
    # A bias of -inf bans ids.
    bias = np.zeros(v, np.float32)
    bias[plain] = -np.inf
    tok = self.check_controls(dict(logit_bias=jnp.asarray(bias)), t=4.0)
    assert not np.isin(tok, plain).any()

  def test_rows_with_nothing_allowed_return_minus_one(self):
    v = cases.V
    mask = np.random.default_rng(2).integers(0, 2**32, (cases.B, -(-v // 32)),
                                             dtype=np.uint32)
    mask[3] = 0
    mask[5, :-1] = 0
    mask[5, -1] = np.uint32(0xFFFFFFFF) << np.uint32(v % 32)   # only ids >= V
    # Equal to the reference's (below), and those rows -1 with NaN.
    _, out = self.checked_output(dict(allowed_mask=jnp.asarray(mask)),
                                 return_logprobs=True)
    assert out.tokens[3] == -1 and out.tokens[5] == -1
    assert np.isnan(out.logprob[3]) and np.isnan(out.logprob_truncated[5])
    assert (np.delete(np.asarray(out.tokens), [3, 5]) >= 0).all()

  @pytest.mark.parametrize("kw", [{}, dict(top_k=5, top_p=0.9), dict(min_p=0.05)],
                           ids=["no_truncation", "top_k_top_p", "min_p"])
  def test_rows_with_nothing_to_sample_return_minus_one(self, kw):
    # Issue #42, defect 3: one answer for "no token possible", whatever
    # empties the row (here a bias of -inf on every id the row's mask
    # allows): -1, with NaN log-probabilities, as for a mask that allows
    # nothing; logsumexp -inf, top ids -1 with NaN log-probabilities.
    b, v = cases.B, cases.V
    truncating = bool(kw)
    banned = 1504                                    # ids [0, 1504): 47 words
    bias = np.zeros(v, np.float32)
    bias[:banned] = -np.inf
    mask = np.full((b, -(-v // 32)), 0xFFFFFFFF, np.uint32)
    empty = [3, 7, 10]                               # row 7 is greedy (cases.T)
    mask[empty] = 0
    mask[empty, :banned // 32] = 0xFFFFFFFF          # only banned ids allowed
    kw = dict(kw, logit_bias=jnp.asarray(bias), allowed_mask=jnp.asarray(mask))
    # One key kind per case (the rule does not depend on the key): the
    # truncating cases with per-row keys, the plain one with a scalar key.
    key = cases.KEYS["per_row" if truncating else "scalar"]
    _, out = self.checked_output(kw, key=key, num_samples=2, return_logprobs=True,
                                 top_logprobs=3)
    tok = np.asarray(out.tokens)
    assert (tok[:, empty] == -1).all() and (np.delete(tok, empty, axis=1) >= banned).all()
    for name in ("logprob", "logprob_truncated"):
      assert np.isnan(np.asarray(getattr(out, name))[:, empty]).all(), name
    assert np.isneginf(np.asarray(out.logsumexp)[:, empty]).all()
    assert (np.asarray(out.top_ids)[empty] == -1).all()
    assert np.isnan(np.asarray(out.top_logprobs)[empty]).all()
    if not truncating:
      # A bias of -inf everywhere: every row, greedy ones too, bare tokens.
      tok = self.check_controls(dict(kw, logit_bias=jnp.full((v,), -jnp.inf),
                                     allowed_mask=None))
      np.testing.assert_array_equal(tok, -1)

  @pytest.mark.parametrize("top_p", cases.NUCLEUS_TOP_P,
                           ids=lambda p: f"1-{1 - p:.0e}")
  def test_top_p_near_one_with_a_nucleus_past_the_candidates(self, top_p):
    # Issue #42: a nucleus just inside, just past or far past the 128
    # candidates, at top_p within rounding-margin reach of 1 (cases.py,
    # NUCLEUS_ROWS); every row equal to the reference's.
    h, w, keys, labels = cases.nucleus_inputs()
    got = np.asarray(self.run(h, w, keys, top_p=top_p))
    want = np.asarray(fs.reference.sample(h, w, keys, top_p=top_p))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(labels[i], int(got[i]), int(want[i])) for i in bad]

  def test_top_logprobs_edges(self):
    h, w, b, v = cases.H, cases.W, cases.B, cases.V
    key = cases.KEYS["scalar"]
    # One allowed id per row: it, then -1 with log-probability -inf.
    only, mask = cases.only_one_allowed(np.random.default_rng(3))
    mask = np.asarray(mask).copy()
    mask[2] = 0                                          # nothing allowed
    # Equal to the reference's, and:
    _, out = self.checked_output(dict(allowed_mask=jnp.asarray(mask)), key=key,
                                 top_logprobs=3)
    rows = np.delete(np.arange(b), 2)
    np.testing.assert_array_equal(out.top_ids[rows, 0], only[rows])
    assert (out.top_ids[rows, 1:] == -1).all()
    np.testing.assert_allclose(out.top_logprobs[rows, 0], 0.0, atol=1e-6)
    assert np.isneginf(out.top_logprobs[rows, 1:]).all()
    assert (out.top_ids[2] == -1).all() and np.isnan(out.top_logprobs[2]).all()
    # Greedy rows report T = 1; the ids are the logits' order, ties by id.
    h = h[:self.greedy_top_rows]
    l = np.asarray(jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32).T))
    out = self.run(h, w, key, temperature=0.0, top_logprobs=v if v <= 128 else 128)
    order = np.lexsort((np.broadcast_to(np.arange(v), l.shape), -l), axis=1)
    # (the top 128 of every row hold ties: the order by id is checked)
    assert all(len(set(r[:out.top_ids.shape[1]])) < out.top_ids.shape[1]
               for r in np.take_along_axis(l, order, axis=1))
    np.testing.assert_array_equal(out.top_ids, order[:, :out.top_ids.shape[1]])
    np.testing.assert_allclose(
        out.top_logprobs, np.take_along_axis(np.asarray(jax.nn.log_softmax(l)),
                                             order[:, :out.top_ids.shape[1]], axis=1),
        rtol=2e-5, atol=2e-5)

  def test_penalties_edges(self):
    h, w, b, v = cases.H, cases.W, cases.B, cases.V
    key, t = cases.KEYS["per_row"], cases.T
    plain = np.asarray(self.run(h, w, key, temperature=t))
    hist = dict(prompt_ids=cases.PENALTIES["prompt_ids"],
                output_ids=cases.PENALTIES["output_ids"])
    # Penalties that are off, or without a history, change nothing.
    np.testing.assert_array_equal(self.check_controls(
        dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
             **hist), key=key), plain)
    np.testing.assert_array_equal(self.check_controls(
        dict(repetition_penalty=3.0), key=key), plain)
    # A large presence penalty bans every generated id.
    tok = self.check_controls(dict(presence_penalty=1e4, **hist), key=key)
    out = np.asarray(hist["output_ids"])
    assert not any(tok[i] in out[i] for i in range(b))
    # A mask that allows only history ids: the pass sees nothing, the
    # history scoring everything.
    ids = np.asarray(hist["prompt_ids"])
    mask = np.zeros((b, -(-v // 32)), np.uint32)
    for i in range(b):
      for j in ids[i][ids[i] >= 0]:
        mask[i, j // 32] |= np.uint32(1 << (j % 32))
    tok = self.check_controls(dict(repetition_penalty=2.0, allowed_mask=jnp.asarray(mask),
                                   **hist), key=key, top_logprobs=4)
    assert tok[1] == -1 and all(tok[i] in ids[i] for i in range(b) if i != 1)

  def test_truncating_every_row_skips_the_noise(self):
    # A rule on for every row (a concrete top_k = 5): the pass draws no
    # noise, and its best of each row is the argmax of x (lowest id on
    # ties), which only greedy rows read; tokens still equal
    # the reference's, several samples included.
    from flashsample_jax import controls, problem
    h, w, b, v = cases.H, cases.W, cases.B, cases.V
    key, t = cases.KEYS["per_row"], cases.T
    p = problem.prepare(h, w, key, temperature=t)
    c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, top_k=5,
                                  return_logprobs=True)
    pc = c.for_pass()
    assert c.every_row_truncates and not pc.noise and pc.samples == 1
    impl = fs.backends.resolve(self.backend, p, pc)
    st = jax.jit(lambda p, c: impl.controls_state(p, c))(p, pc)
    l = np.asarray(jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32).T))
    np.testing.assert_array_equal(np.asarray(st.best_id)[:, 0], l.argmax(axis=1))
    np.testing.assert_array_equal(np.asarray(st.best_score)[:, 0], l.max(axis=1))
    for kw in (dict(top_k=5), dict(top_k=5, top_p=0.9, min_p=0.01)):
      self.check_controls(kw, key=key, num_samples=3, return_logprobs=True)
    # A row with top-k off (k = 0) is sampled from the pass's noise.
    k = jnp.asarray(np.where(np.arange(b) % 5 == 1, 0, 5), jnp.int32)
    c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, top_k=k)
    assert not c.every_row_truncates and c.for_pass() is c
    self.check_controls(dict(top_k=k), key=key)

  # 0 * inf in interpret mode's matmul, on purpose (the last part).
  @pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
  def test_zero_hidden_rows_are_decided_on_the_pass(self):
    # A batch padded with zero hidden rows, controls per row with every rule
    # off in row 3, so that the pass draws noise: the zero rows' logits all
    # tie, every rule keeps their whole row, and the pass's best of each
    # sample is their token (docs/design.md, "Rows of equal logits"), with
    # no row on the exact path. Tokens equal the reference's, the floats
    # score_tokens finds for them bit for bit.
    from flashsample_jax import api, controls, problem, stage2
    b, v = cases.B, cases.V
    pad = np.arange(b) % 4 == 2
    h = jnp.where(jnp.asarray(pad)[:, None], 0, cases.H).astype(cases.H.dtype)
    off = np.arange(b) == 3
    kw = dict(top_k=jnp.asarray(np.where(off, 0, 30), jnp.int32),
              top_p=jnp.asarray(np.where(off, 1.0, 0.9), jnp.float32),
              min_p=jnp.asarray(np.where(off, 0.0, 0.02), jnp.float32),
              allowed_mask=cases.CASES["mask"]["allowed_mask"], softcap=8.0)
    rl = dict(return_logprobs=True, return_entropy=True)
    key, t = cases.KEYS["per_row"], cases.T
    p = problem.prepare(h, cases.W, key, temperature=t)
    c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, num_samples=2, **kw, **rl)
    assert c.for_pass().noise
    impl = fs.backends.resolve(self.backend, p, c)
    st = stage2.per_sample(api.pass_state(p, c, impl, 0), c.samples)
    _, _, fallback = jax.jit(stage2.finish)(p, c, st)
    assert not np.asarray(fallback)[pad].any()
    self.check_controls(kw, key=key, h=h, num_samples=2, **rl)
    out = self.run(h, cases.W, key, temperature=t, **kw, **rl)
    sc = fs.score_tokens(h, cases.W, out.tokens, temperature=t, backend=self.backend, **kw)
    for name in ("logprob", "logprob_truncated", "entropy", "entropy_truncated"):
      a, s = (np.asarray(getattr(o, name)) for o in (out, sc))
      np.testing.assert_array_equal(a.view(np.uint32), s.view(np.uint32), err_msg=name)
    # An infinite weight entry gives the zero rows a NaN logit (0 * inf),
    # soft-capped here: the pass's sum of exp(t - max) is then not the count
    # of allowed ids (NaN, or a number where a soft-cap made the NaN one, as
    # the Triton kernels' did), so they are not flat, and the sampled ones'
    # tokens are still the reference's (no mask here, which could disallow
    # that id; the other rows' +-inf and NaN logits are not this test's).
    w = cases.W.at[7, 3].set(jnp.inf)
    kw.pop("allowed_mask")
    p = problem.prepare(h, w, key, temperature=t)
    c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, **kw)
    st = api.pass_state(p, c, impl, 0)
    assert not np.asarray(stage2._flat_rows(p, c, st))[pad].any()
    sampled = pad & (np.asarray(t) != 0)
    np.testing.assert_array_equal(
        np.asarray(self.run(h, w, key, temperature=t, **kw))[sampled],
        np.asarray(fs.reference.sample(h, w, key, temperature=t, **kw))[sampled])

  def test_traced_controls_under_jit(self):
    h, w, key, t = cases.H, cases.W, cases.KEYS["scalar"], cases.T
    f = jax.jit(lambda k, p, m, c: self.run(h, w, key, temperature=t, top_k=k,
                                            top_p=p, min_p=m, softcap=c))
    g = jax.jit(lambda k, p, m, c: fs.reference.sample(
        h, w, key, temperature=t, top_k=k, top_p=p, min_p=m, softcap=c))
    args = (jnp.int32(25), jnp.float32(0.7), jnp.float32(0.03), jnp.float32(6.0))
    np.testing.assert_array_equal(f(*args), g(*args))


def penalty_kwargs(b: int, v: int, seed: int, *, out_width: int = 30):
  """Penalties whose arithmetic rounds (repetition 0.7 / 1.3 divides by a
  non-power of two, presence and frequency are not quarters) and boost the
  history (r < 1 scales positive logits up, negative presence adds), so
  that history ids win rows and fill the top lists; outputs over the first
  50 ids repeat (counts up to ~out_width / 10), some entries are -1."""
  r = np.random.default_rng(seed)
  prompt = r.integers(-1, v, (b, 40)).astype(np.int32)
  output = np.where(r.random((b, out_width)) < 0.6, r.integers(0, 50, (b, out_width)),
                    r.integers(-1, v, (b, out_width))).astype(np.int32)
  return dict(
      repetition_penalty=jnp.asarray(r.choice([0.7, 1.3, 0.55, 1.0], b), jnp.float32),
      presence_penalty=jnp.asarray(r.choice([-2.3, 0.6, -0.7], b), jnp.float32),
      frequency_penalty=jnp.asarray(r.choice([0.3, -0.45, 0.0], b), jnp.float32),
      prompt_ids=jnp.asarray(prompt), output_ids=jnp.asarray(output))


def _ieee_penalized(p, c, seen, count):
  """The penalized, tempered logits ``t`` and scores of ``p``'s exact inputs
  in NumPy f32 (IEEE division, every op rounded), with the package's noise:
  what an interpret-mode kernel computes (XLA:CPU's own dense program may
  multiply by a reciprocal instead, 1 ulp away for a few quotients)."""
  from flashsample_jax import noise
  h = np.asarray(p.hidden, np.float64)
  w = np.asarray(p.weight, np.float64)
  x = (h @ (w.T if p.layout == "vd" else w)).astype(np.float32)   # exact
  col = lambda a, off: (np.full((x.shape[0], 1), off, np.float32) if a is None
                        else np.asarray(a, np.float32)[:, None])
  r = col(c.repetition_penalty, 1.0)
  x = np.where(seen, np.where(x > 0, x / r, x * r), x).astype(np.float32)
  n = count.astype(np.float32)
  sub = None
  if c.frequency_penalty is not None:
    sub = (col(c.frequency_penalty, 0.0) * n).astype(np.float32)
  if c.presence_penalty is not None:
    pres = np.broadcast_to(col(c.presence_penalty, 0.0), x.shape)
    sub = pres if sub is None else (sub + pres).astype(np.float32)
  if sub is not None:
    x = np.where(count > 0, x - sub, x).astype(np.float32)
  temp = np.asarray(p.temperature)[:, None]
  t = (x / np.where(temp == 0, np.float32(1), temp)).astype(np.float32)
  gid = jnp.arange(x.shape[1], dtype=jnp.uint32)
  hi, lo = noise.add_u32(p.ctr_hi[:, None], p.ctr_lo[:, None], gid[None, :])
  g = np.asarray(noise.gumbel(p.k0[:, None], p.k1[:, None], hi, lo))
  return t, np.where(temp == 0, x, (t + g).astype(np.float32))


def check_fused_penalties(backend, h, w, key, t, kw, *, top_n: int = 16,
                          ieee: bool = False):
  """A backend that applies penalties in its pass (``fuses_penalties``):
  each row's best id, score and tempered logit, and its listed candidates
  above the list's bound, equal bit for bit those of the penalized logits
  computed densely: by XLA in one program (the reference's arithmetic, on
  a GPU), or with ``ieee`` in NumPy (interpret mode on a CPU).

  Returns the number of rows whose best id is in the row's history.
  """
  from flashsample_jax import controls, problem, stage2
  b, v = h.shape[0], w.shape[0]
  p = problem.prepare(h, w, key, temperature=t)
  c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, top_logprobs=top_n,
                                return_logprobs=True, **kw)
  assert backend.fuses_penalties(p, c)
  got = jax.jit(lambda p, c: backend.controls_state(p, c))(p, c)
  seen, count = controls.dense_history(c, b, v)

  def dense(p, c):
    l = problem.logits(p.hidden, p.weight, p.layout)
    gid = jax.lax.iota(jnp.int32, v)
    x = controls.transform(l, gid, c, v, history=(seen, count))
    t = stage2.tempered(p, x)
    return t, stage2.perturbed(p, x, t, gid, 1)[:, 0]

  if ieee:
    t_all, sc = _ieee_penalized(p, c, np.asarray(seen), np.asarray(count))
  else:
    t_all, sc = (np.asarray(a) for a in jax.jit(dense)(p, c))
  best = np.argmax(sc, axis=1)                       # first max: the tie rule
  rows = np.arange(b)
  np.testing.assert_array_equal(np.asarray(got.best_id)[:, 0], best)
  np.testing.assert_array_equal(np.asarray(got.best_score)[:, 0], sc[rows, best])
  np.testing.assert_array_equal(np.asarray(got.best_t)[:, 0], t_all[rows, best])
  vals, ids = np.asarray(got.cand_vals), np.asarray(got.cand_ids)
  bound = np.maximum(np.asarray(got.cand_bound), vals[:, -1])
  for i in range(b):
    above = vals[i] > bound[i]
    np.testing.assert_array_equal(vals[i, above], t_all[i, ids[i, above]])
    want = np.sort(t_all[i][t_all[i] > bound[i]])[::-1]
    np.testing.assert_array_equal(np.sort(vals[i, above])[::-1], want)
  return int(np.asarray(seen)[np.arange(b), best].sum())


def device_random_inputs(b, d, v, seed, logit_std=3.0):
  """Gaussian ``hidden [B, D]`` and ``weight [V, D]`` bf16, drawn on the
  device (NumPy would need gigabytes of float64 for real heads)."""
  kh, kw = jax.random.split(jax.random.key(seed))
  h = jax.random.normal(kh, (b, d), jnp.bfloat16)
  w = (jax.random.normal(kw, (v, d), jnp.float32) * (logit_std / np.sqrt(d))
       ).astype(jnp.bfloat16)
  return h, w


class GpuSuite:
  """The benchmarks' heads as correctness tests, for the GPU subclasses of
  :class:`BackendSuite` (random inputs: >= 99.9% identical tokens)."""

  backend = ""

  @pytest.mark.parametrize("head", ["S", "L"])
  def test_benchmark_heads_random(self, head):
    d, v = HEADS[head]
    agree = total = 0
    _, w = device_random_inputs(1, d, v, seed=d)
    for b in (1, 64, 256):
      h, _ = device_random_inputs(b, d, 64, seed=b)
      t = jnp.asarray(np.random.default_rng(b).uniform(0.5, 1.5, b), jnp.float32)
      for key in (jax.random.key(b), inputs.row_keys(b, seed=b)):
        got = np.asarray(fs.sample(h, w, key, temperature=t, backend=self.backend))
        want = np.asarray(fs.reference.sample(h, w, key, temperature=t))
        agree += int((got == want).sum())
        total += got.size
    assert agree / total >= 0.999, f"{agree}/{total} rows agree"

  @pytest.mark.parametrize("rules", ["softcap", "softcap_top_k_per_row"])
  def test_nan_logits_with_a_softcap(self, rules):
    # An infinite weight entry: rows whose hidden state is 0 there have a
    # NaN logit (0 * inf), one per row, which c * tanh(x / c) keeps NaN, so
    # it wins (the tie rule); the others' +-inf are capped to +-c. The
    # Triton kernels' tanh clamped the NaN to a number (8 of 24 rows here
    # sampled other ids on an H200) before its clamp kept NaN
    # (docs/design.md, "The exactness contract").
    h, b, v = cases.H.at[2].set(0), cases.B, cases.V
    w = cases.W.at[7, 3].set(jnp.inf)
    kw = dict(softcap=8.0)
    if rules == "softcap_top_k_per_row":
      kw["top_k"] = jnp.asarray(np.where(np.arange(b) % 2, 0, 30), jnp.int32)
    assert np.any(np.asarray(h)[:, 3] == 0)
    self.check_controls(kw, key=cases.KEYS["per_row"], h=h, w=w)

  def test_controls_benchmark_head_random(self):
    # Qwen3-8B's head with LLM-like logits (std 3): every control the
    # benchmark times, B = 100. Tokens >= 99.9% identical to the reference
    # (the soft-cap's tanh may differ in the last bit); log-probabilities
    # close where the tokens agree.
    d, v = HEADS["S"]
    b = 100
    h, w = device_random_inputs(b, d, v, seed=5)
    key = jax.random.key(5)
    r = np.random.default_rng(5)
    bias = jnp.asarray(r.normal(size=v), jnp.float32)
    mask = jnp.asarray(r.integers(0, 2**32, (b, -(-v // 32)), dtype=np.uint32)
                       | r.integers(0, 2**32, (b, -(-v // 32)), dtype=np.uint32))
    t = jnp.asarray(r.uniform(0.5, 1.5, b), jnp.float32).at[::9].set(0.0)
    kws = [dict(top_k=50, top_p=0.9), dict(min_p=0.05), dict(top_p=0.95),
           dict(logit_bias=bias, allowed_mask=mask), dict(softcap=30.0),
           dict(top_k=20, softcap=30.0, logit_bias=bias, allowed_mask=mask)]
    agree = total = 0
    for kw in kws:
      got = fs.sample(h, w, key, temperature=t, backend=self.backend,
                      return_logprobs=True, num_samples=2, **kw)
      want = fs.reference.sample(h, w, key, temperature=t, return_logprobs=True,
                                 num_samples=2, **kw)
      same = np.asarray(got.tokens) == np.asarray(want.tokens)
      agree += int(same.sum())
      total += same.size
      for name in ("logprob", "logprob_truncated", "logsumexp"):
        np.testing.assert_allclose(np.asarray(getattr(got, name))[same],
                                   np.asarray(getattr(want, name))[same],
                                   rtol=1e-4, atol=1e-4, err_msg=f"{kw} {name}")
    assert agree / total >= 0.999, f"{agree}/{total} tokens agree"

  @pytest.mark.parametrize("kw", [dict(top_k=50, top_p=0.9), dict(top_logprobs=20),
                                  dict(top_logprobs=20, top_k=20, top_p=0.95)],
                           ids=["top_k_top_p", "top_logprobs", "top_logprobs_qwen3"])
  def test_controls_are_certified_on_llm_like_rows(self, kw):
    # On logits of std 3 the candidate lists decide every row: none needs
    # the materialized pass (which would cost the time of XLA's dot).
    from flashsample_jax import controls, problem, stage2
    d, v = HEADS["S"]
    b = 64
    h, w = device_random_inputs(b, d, v, seed=6)
    p = problem.prepare(h, w, jax.random.key(6), temperature=1.0)
    c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, **kw)
    impl = fs.backends.resolve(self.backend, p, c)
    _, _, fallback = stage2.finish(p, c, impl.controls_state(p, c))
    assert int(np.asarray(fallback).sum()) == 0

  def test_top_logprobs_and_penalties_benchmark_head_random(self):
    # Shape S, B = 64, 256 history ids per row, top_logprobs=20, with and
    # without top-k/top-p: tokens and top ids >= 99.9% identical to the
    # reference, log-probabilities close where they agree.
    d, v = HEADS["S"]
    b = 64
    h, w = device_random_inputs(b, d, v, seed=7)
    key = inputs.row_keys(b, seed=7)
    r = np.random.default_rng(7)
    hist = dict(prompt_ids=jnp.asarray(r.integers(-1, v, (b, 128)), jnp.int32),
                output_ids=jnp.asarray(r.integers(0, 2000, (b, 128)), jnp.int32),
                repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    t = jnp.asarray(r.uniform(0.5, 1.5, b), jnp.float32).at[::9].set(0.0)
    agree = total = top_agree = top_total = 0
    for kw in (dict(top_logprobs=20), hist, dict(hist, top_logprobs=20, top_k=20,
                                                 top_p=0.95)):
      got = fs.sample(h, w, key, temperature=t, backend=self.backend,
                      return_logprobs=True, **kw)
      want = fs.reference.sample(h, w, key, temperature=t, return_logprobs=True, **kw)
      same = np.asarray(got.tokens) == np.asarray(want.tokens)
      agree += int(same.sum())
      total += same.size
      np.testing.assert_allclose(np.asarray(got.logprob)[same],
                                 np.asarray(want.logprob)[same], rtol=1e-4, atol=1e-4)
      if "top_logprobs" in kw:
        same = np.asarray(got.top_ids) == np.asarray(want.top_ids)
        top_agree += int(same.sum())
        top_total += same.size
        np.testing.assert_allclose(np.asarray(got.top_logprobs)[same],
                                   np.asarray(want.top_logprobs)[same],
                                   rtol=1e-4, atol=1e-4)
    assert agree / total >= 0.999, f"{agree}/{total} tokens agree"
    assert top_agree / top_total >= 0.999, f"{top_agree}/{top_total} top ids agree"


def mosaic_gumbel(bits, *, interpret: bool, block=(64, 128)):
  """``threefry.gumbel_from_bits`` with the Mosaic kernels' logarithm
  (:func:`~pallas_kernels.sm90_common.noise_log`), run by a Mosaic GPU
  kernel: ``bits`` uint32 ``[R, 128]``, R a multiple of 64, one CTA per
  ``block``. The tests compare it with XLA's noise for every ``u``."""
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels import sm90_common, threefry

  r = bits.shape[0] // block[0]

  def body(b_ref, o_ref):
    i = lax.axis_index("x")

    def scoped(b_smem, o_smem, bar):
      plgpu.copy_gmem_to_smem(b_ref.at[i], b_smem, bar)
      plgpu.barrier_wait(bar)
      o_smem[...] = threefry.gumbel_from_bits(
          b_smem[...], log=sm90_common.noise_log(interpret))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_ref.at[i])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM(block, jnp.uint32),
                  plgpu.SMEM(block, jnp.float32), plgpu.Barrier(num_arrivals=1))

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((r, *block), jnp.float32),
                   grid=(r,), grid_names=("x",),
                   interpret=plgpu.InterpretGPUParams() if interpret else None)
  return f(bits.reshape(r, *block)).reshape(bits.shape)


def every_uniform_bits():
  """uint32 ``[2**16, 128]``: random bits giving each of the 2**23 values
  of ``u`` that ``jax.random`` draws once (the low 9 bits are dropped)."""
  m = jnp.arange(1 << 23, dtype=jnp.uint32)
  return (m << 9).reshape(1 << 16, 128)


def check_exact_top(backend, h, w, key, t, kw, *, n: int = 20, rows=None,
                    exact_values: bool = True, layout: str = "vd", vocab_size=None,
                    weight_scale=None):
  """A backend's early-exit exact top N (``exact_top``), with ``rows``
  flagged (default all): its ids equal ``controls.top_n``'s of the
  reference's tempered logits, and its values bit for bit (with
  ``exact_values``; else within a few ulp: interpret mode divides in IEEE,
  XLA:CPU sometimes by a reciprocal). Rows not flagged are not read.
  ``kw``'s ``logit_bias`` and ``allowed_mask`` are sized to ``vocab_size``
  (default: the weight's rows) by the caller."""
  from flashsample_jax import controls, problem, reference, stage2
  b = h.shape[0]
  p = problem.prepare(h, w, key, temperature=t, weight_layout=layout,
                      vocab_size=vocab_size, weight_scale=weight_scale)
  c = controls.prepare_controls(batch=b, vocab_size=p.vocab_size, rows=p.weight_rows,
                                top_logprobs=n, **kw)
  run = backend.exact_top(p, c)
  assert run is not None
  flags = np.ones((b,), bool) if rows is None else np.isin(np.arange(b), rows)
  vals, ids = (np.asarray(a) for a in jax.jit(run)(jnp.asarray(flags)))
  want_v, want_i = (np.asarray(a) for a in jax.jit(
      lambda p, c: controls.top_n(stage2.tempered(p, reference.transformed_logits(p, c)),
                                  n))(p, c))
  np.testing.assert_array_equal(ids[flags], want_i[flags])
  if exact_values:
    np.testing.assert_array_equal(vals[flags].view(np.uint32), want_v[flags].view(np.uint32))
  else:
    np.testing.assert_allclose(vals[flags], want_v[flags], rtol=5e-7, atol=0)


def _lane_bound(v, ids, bound):
  """What ``sm90_top.top_lists`` returns as each row's bound: the input
  bound, raised to the largest value that a lane (columns ``c, c + 32,
  ...`` of the row padded to a power of two >= 128) holds beyond its 8
  first by (value, -0.0 == 0.0, lower id)."""
  rows, length = v.shape
  width = 1 << max(7, (length - 1).bit_length())
  x = np.full((rows, width), -np.inf, np.float32)
  x[:, :length] = np.where(v > bound[:, None], v, -np.inf)
  i = np.full((rows, width), np.iinfo(np.int32).max, np.int64)
  i[:, :length] = ids
  out = bound.astype(np.float32).copy()
  for r in range(rows):
    for c in range(32):
      lane = sorted(zip(x[r, c::32] + 0.0, i[r, c::32]), key=lambda e: (-e[0], e[1]))
      if len(lane) > 8:
        out[r] = max(out[r], max(e[0] for e in lane[8:]))
  return out


def check_top_lists(length: int, m: int, target):
  """``sm90_top.top_lists`` against ``state.top_m(by_id=True)`` on 7 rows
  of ``length`` candidates: bit for bit above the bound it returns, ``-inf``
  at or below it, and that bound equal to :func:`_lane_bound`'s. Rows hold
  signed zeros, NaN and +-inf (NaN and values at or below the input bound
  count as -inf), ties broken by id across lists, fewer finite candidates
  than ``m``, INT_MAX padding, and (``length >= 288``) ten of the largest
  values in one lane, which must raise the bound; ``length < m``: fewer
  candidates than ``m``."""
  from pallas_kernels import sm90_top
  from pallas_kernels.state import top_m
  r = np.random.default_rng(length)
  b = 7
  v = r.normal(0, 1, (b, length)).astype(np.float32)
  v[0, :5] = [0.0, -0.0, 0.0, np.nan, np.inf]
  v[1] = np.round(v[1] * 2) / 2                  # many ties
  v[2, 10:] = -np.inf
  v[3] = np.nan
  v[3, :3] = [1.0, 2.0, -0.0]
  ids = np.stack([r.permutation(5000)[:length] for _ in range(b)]).astype(np.int32)
  ids[4, length // 3:] = np.iinfo(np.int32).max
  v[4, length // 3:] = -np.inf
  v[5, ::7] = -0.0
  crowded = v[6, 0::32][:10]                     # lane 0's first ten columns
  v[6, 0:320:32] = 10.0 + np.arange(crowded.size)
  bound = np.array([-np.inf, 0.5, -np.inf, -np.inf, 0.0, 0.25, -np.inf], np.float32)
  args = jnp.asarray(v), jnp.asarray(ids), jnp.asarray(bound)
  want_v, want_i = map(np.asarray, jax.jit(
      lambda v, i, bd: top_m(v, i, bd, m, by_id=True))(*args))
  got_v, got_i, got_b = map(np.asarray, jax.jit(
      lambda v, i, bd: sm90_top.top_lists(v, i, bd, m, target=target))(*args))
  np.testing.assert_array_equal(got_b, _lane_bound(v, ids, bound))
  if length >= 288:   # lane 0 drops 10 and 11: eight values stay listed
    assert got_b[6] == 11.0 and np.sum(got_v[6] > -np.inf) == min(8, m)
  above = want_v > got_b[:, None]
  assert above[:, 0].sum() >= 4                # the check compares something
  np.testing.assert_array_equal(np.where(above, got_i, -1), np.where(above, want_i, -1))
  np.testing.assert_array_equal(np.where(above, got_v, 0).view(np.uint32),
                                np.where(above, want_v, 0).view(np.uint32))
  # At or below the bound: -inf, even where the sort lists a value.
  assert np.all(np.where(above, True, got_v == -np.inf))
  return got_b
