"""``fs.verify_drafts`` (speculative decoding) against its reference.

Exact inputs: every backend's tokens, acceptance counts and log-probabilities
equal ``fs.reference.verify_drafts`` (materialized, position by position,
``jax.random.categorical``) on 100% of requests; ``strict`` equals
``fs.sample`` per position. Distributions: for ``one_hot`` and
``probabilistic`` the token emitted at position 0 follows the target's
processed distribution and drafts are accepted with ``p(d)`` / ``min(1,
p/q)`` (chi-square and binomial tests over many keys). GPU cases (mosaic,
triton) are marked ``gpu``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from scipy import stats

import flashsample_jax as fs
from flashsample_jax.backends.mosaic import MosaicBackend
from tests import inputs
from tests.test_statistics import P_MIN, chi_square_p

B, K, D, V = 6, 3, 64, 1000
K1 = K + 1
H, W = inputs.exact_inputs(B * K1, D, V, seed=4)
H = H.reshape(B, K1, D)
LOGITS = jnp.einsum("bkd,vd->bkv", H.astype(jnp.float32), W.astype(jnp.float32))
# Drafts the target often accepts (its argmax), one ragged row, one unlikely draft.
DRAFTS = jnp.argmax(LOGITS[:, :K], axis=-1).astype(jnp.int32).at[2, 1].set(-1).at[4, 0].set(7)
T = jnp.asarray([1.0, 2.0, 0.0, 4.0, 1.0, 0.5])
KEYS = {"scalar": jax.random.key(1), "per_request": jax.random.split(jax.random.key(2), B)}
_R = np.random.default_rng(0)
Q = jax.nn.softmax(jnp.asarray(_R.normal(size=(B, K, V)) * 2, jnp.float32), axis=-1)
CASES = {
    "plain": {},
    "top_k_top_p": dict(top_k=30, top_p=jnp.asarray([0.9, 0.5, 0.9, 0.95, 0.8, 0.7])),
    # a grammar state per position, and penalties over output_ids + drafts
    "mask_penalties": dict(
        allowed_mask=jnp.asarray(_R.integers(0, 2**32, (B, K1, -(-V // 32)),
                                              dtype=np.uint32)).at[:, :, 0].set(0xFFFFFFFF),
        repetition_penalty=2.0, frequency_penalty=0.5, min_p=0.01,
        output_ids=jnp.asarray(_R.integers(-1, 40, (B, 5)), jnp.int32),
        prompt_ids=jnp.asarray(_R.integers(-1, V, (B, 7)), jnp.int32)),
}
METHODS = ("strict", "one_hot", "probabilistic")


def _extra(method):
  return {"draft_probs": Q} if method == "probabilistic" else {}


def check(backend, method, key, case, h=H, w=W, drafts=DRAFTS, **kw):
  kw = dict(CASES[case], temperature=T, return_logprobs=True, **_extra(method), **kw)
  got = fs.verify_drafts(h, w, key, drafts, method=method, backend=backend, **kw)
  want = fs.reference.verify_drafts(h, w, key, drafts, method=method, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
  np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=2e-5, atol=2e-5)
  return got


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("key", sorted(KEYS))
@pytest.mark.parametrize("method", METHODS)
def test_xla_equals_reference(method, key, case):
  got = check("xla", method, KEYS[key], case)
  n = np.asarray(got.num_accepted)
  assert n.min() < K and n.max() > 0           # rejections and acceptances both


def test_mosaic_interpret_equals_reference():
  # The one-hot rule's pass (an allowed mask per row); strict is fs.sample's
  # pass, which the backend suite checks in interpret mode. (The dense
  # route needs no case here: at these shapes the xla backend runs one
  # chunk, the dense program.)
  if jax.default_backend() == "gpu":
    pytest.skip("interpret mode is the CPU's check; the GPU runs the kernel (marked gpu)")
  backend = MosaicBackend(interpret=True)
  check(backend, "one_hot", KEYS["scalar"], "top_k_top_p")
  check(backend, "one_hot", KEYS["per_request"], "plain")


@pytest.mark.parametrize("key", sorted(KEYS))
def test_strict_emits_what_sample_draws_per_position(key):
  kw = dict(CASES["top_k_top_p"], temperature=T)
  got = fs.verify_drafts(H, W, KEYS[key], DRAFTS, method="strict", backend="xla", **kw)
  if key == "scalar":
    keys = [jax.random.fold_in(KEYS[key], j) for j in range(K1)]
  else:
    keys = [jax.vmap(jax.random.fold_in, (0, None))(KEYS[key], j) for j in range(K1)]
  per_position = np.stack([fs.sample(H[:, j], W, keys[j], backend="xla", **kw)
                           for j in range(K1)], axis=1)
  tokens, n = np.asarray(got.tokens), np.asarray(got.num_accepted)
  for b in range(B):
    np.testing.assert_array_equal(tokens[b, :n[b] + 1], per_position[b, :n[b] + 1])
    assert (tokens[b, n[b] + 1:] == -1).all()
    assert (per_position[b, :n[b]] == np.asarray(DRAFTS)[b, :n[b]]).all()


def test_greedy_rows_accept_the_argmax_and_emit_it():
  got = fs.verify_drafts(H, W, KEYS["scalar"], DRAFTS, method="one_hot", temperature=0.0,
                         backend="xla")
  argmax = np.asarray(jnp.argmax(LOGITS, axis=-1))
  d = np.asarray(DRAFTS)
  for b in range(B):
    n = int(got.num_accepted[b])
    live = np.cumprod(d[b] >= 0)
    want = int(np.sum(np.cumprod((d[b] == argmax[b, :K]) & (live > 0))))
    assert n == want
    assert got.tokens[b, n] == argmax[b, n]


def _peaked(n, v=12):
  """``n`` requests of one context: hidden ``[n, 2, 1]`` against ``W [v, 1]``
  of logits ``[0, -0.5, -1, ...]`` (exact in bf16)."""
  w = jnp.asarray(-0.5 * np.arange(v), jnp.bfloat16)[:, None]
  h = jnp.ones((n, 2, 1), jnp.bfloat16)
  probs = np.exp(-0.5 * np.arange(v))
  return h, w, probs / probs.sum()


@pytest.mark.parametrize("draft", [0, 3])
def test_one_hot_emits_the_target_distribution(draft):
  n = 20000
  h, w, probs = _peaked(n)
  keys = jax.random.split(jax.random.key(5), n)
  out = fs.verify_drafts(h, w, keys, jnp.full((n, 1), draft, jnp.int32), backend="xla")
  first = np.asarray(out.tokens[:, 0])
  assert chi_square_p(first, probs) > P_MIN
  accepted = int(np.sum(np.asarray(out.num_accepted) == 1))
  assert stats.binomtest(accepted, n, probs[draft]).pvalue > P_MIN
  # Rejections emit the rest of the distribution, never the draft.
  rejected = first[np.asarray(out.num_accepted) == 0]
  assert (rejected != draft).all()
  rest = np.delete(probs, draft)
  assert chi_square_p(np.searchsorted(np.delete(np.arange(probs.size), draft), rejected),
                      rest) > P_MIN


def test_probabilistic_emits_the_target_distribution():
  n = 20000
  h, w, probs = _peaked(n)
  q = np.exp(np.linspace(0, -2, probs.size))[::-1].copy()     # a drafter that disagrees
  q /= q.sum()
  rng = np.random.default_rng(7)
  drafts = rng.choice(probs.size, size=(n, 1), p=q).astype(np.int32)
  qq = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, 1, probs.size))
  keys = jax.random.split(jax.random.key(6), n)
  out = fs.verify_drafts(h, w, keys, jnp.asarray(drafts), method="probabilistic",
                         draft_probs=qq, backend="xla")
  assert chi_square_p(np.asarray(out.tokens[:, 0]), probs) > P_MIN
  accept = np.minimum(1.0, probs / q)
  acc = np.asarray(out.num_accepted) == 1
  for d in (0, probs.size - 1):                  # p/q > 1 and p/q < 1
    sel = drafts[:, 0] == d
    assert stats.binomtest(int(acc[sel].sum()), int(sel.sum()), accept[d]).pvalue > P_MIN


# 2 and 8 shards (CI time: 1 is the unsharded program's own, 4 lies between;
# tests/test_sharding.py runs fs.sample on 1/2/4/8).
@pytest.mark.parametrize("shards", [2, 8])
def test_sharded_vocabulary_equals_unsharded(shards):
  if len(jax.devices()) < shards:
    pytest.skip(f"needs {shards} devices (tests/conftest.py gives a CPU 8)")
  mesh = jax.make_mesh((shards,), ("tp",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:shards])
  kw = dict(CASES["top_k_top_p"], temperature=T, return_logprobs=True)
  want = fs.verify_drafts(H, W, KEYS["per_request"], DRAFTS, backend="xla", **kw)

  def f(h, w, k):
    out = fs.verify_drafts(h, w, k, DRAFTS, backend="xla", vocab_axis="tp", **kw)
    return out.tokens[None], out.num_accepted[None]

  sm = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("tp", None), P()),
                             out_specs=(P("tp"), P("tp"))))
  tokens, n = sm(H, W, KEYS["per_request"])
  for i in range(shards):
    np.testing.assert_array_equal(tokens[i], want.tokens)
    np.testing.assert_array_equal(n[i], want.num_accepted)


def test_bad_arguments_are_named():
  key = KEYS["scalar"]
  with pytest.raises(ValueError, match="method='greedy' must be one of"):
    fs.verify_drafts(H, W, key, DRAFTS, method="greedy")
  with pytest.raises(ValueError, match=r"draft_ids.shape=\(6, 2\) must be \[B, K\]=\(6, 3\)"):
    fs.verify_drafts(H, W, key, DRAFTS[:, :2])
  with pytest.raises(ValueError, match=r"draft_ids\[1, 2\]=1000 must be an id in \[0, 1000\)"):
    fs.verify_drafts(H, W, key, DRAFTS.at[1, 2].set(V))
  with pytest.raises(TypeError, match="draft_ids.dtype=float32"):
    fs.verify_drafts(H, W, key, DRAFTS.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"method='probabilistic' needs draft_probs.*"
                     r"\[B, K, V\]=\(6, 3, 1000\)$"):
    fs.verify_drafts(H, W, key, DRAFTS, method="probabilistic")
  with pytest.raises(ValueError, match=r"draft_probs.shape=\(6, 3, 999\)"):
    fs.verify_drafts(H, W, key, DRAFTS, method="probabilistic", draft_probs=Q[:, :, 1:])
  with pytest.raises(ValueError, match="draft_probs is read only by"):
    fs.verify_drafts(H, W, key, DRAFTS, draft_probs=Q)
  # Values: a distribution per position (a negative q(d) accepted any draft).
  for bad, why in ((Q.at[1, 2, 5].set(-0.1), r"draft_probs\[1, 2\] has a negative, NaN"),
                   (Q.at[0, 1, 3].set(jnp.nan), r"draft_probs\[0, 1\] has a negative, NaN"),
                   (Q.at[4, 0].multiply(2.0), r"draft_probs\[4, 0\] sums to 2.0.*, not 1")):
    with pytest.raises(ValueError, match=why):
      fs.verify_drafts(H, W, key, DRAFTS, method="probabilistic", draft_probs=bad)
  with pytest.raises(ValueError, match=r"hidden.shape=\(6, 64\) must be \[B, K \+ 1, D\]"):
    fs.verify_drafts(H[:, 0], W, key, DRAFTS)
  with pytest.raises(ValueError, match=r"top_p must be a scalar or have shape \[B\]=\(6,\), got top_p.shape=\(24,\)"):
    fs.verify_drafts(H, W, key, DRAFTS, top_p=jnp.full((B * K1,), 0.9))
  with pytest.raises(ValueError, match=r"top_p\[2\]=1.5 must be in"):
    fs.verify_drafts(H, W, key, DRAFTS, top_p=jnp.asarray([0.9, 0.9, 1.5, 0.9, 0.9, 0.9]))
  with pytest.raises(ValueError, match=r"allowed_mask.shape=\(6, 3, 32\) must be"):
    fs.verify_drafts(H, W, key, DRAFTS,
                     allowed_mask=jnp.zeros((B, K, 32), jnp.uint32))
  # The caller's shape, not the [B (K + 1), words] it is repeated into.
  with pytest.raises(ValueError, match=r"allowed_mask.shape=\(6, 3\) must be \[B, words\]"
                                       r"=\(6, 32\)"):
    fs.verify_drafts(H, W, key, DRAFTS, allowed_mask=jnp.zeros((B, 3), jnp.uint32))
  out = fs.verify_drafts(H[:0], W, key, DRAFTS[:0], return_logprobs=True)
  assert out.tokens.shape == (0, K1) and out.logprobs.shape == (0, K1)


# -- on the GPU -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mosaic", "triton"])
@pytest.mark.parametrize("method", ["strict", "one_hot"])
def test_gpu_backends_equal_reference(backend, method):
  for case in CASES:
    for key in KEYS.values():
      check(backend, method, key, case)


def test_example_runs_every_method(capsys):
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "speculative.py"
  spec = importlib.util.spec_from_file_location("speculative_example", path)
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  for method in METHODS:
    assert example.main(["--method", method, "--steps", "2", "--vocab", "512", "--dim", "64",
                         "--batch", "4", "--k", "2", "--backend", "xla"]) == 0
    assert f"{method}, K = 2, B = 4" in capsys.readouterr().out
  # The drafter equal to the target, greedy: every draft is accepted.
  assert example.main(["--noise", "0", "--temperature", "0", "--steps", "2", "--vocab", "512",
                       "--dim", "64", "--backend", "xla"]) == 0
  assert "acceptance rate 1.00" in capsys.readouterr().out
  assert example.main(["--k", "0"]) == 2


@pytest.mark.parametrize("exact_rows, group_rows", [(2, None), (8, None), (2, 3)])
def test_rows_on_the_exact_path_equal_reference(exact_rows, group_rows, monkeypatch):
  """Short candidate lists send rows to the exact path: with 32 candidates
  6 of the 24 rows (per key kind), which a compacted batch of 8 redoes, and
  a batch of 2 cannot (the whole batch is redone, or groups of 3 rows in a
  loop where the batch's logits are over stage2.EXACT_GROUP_BYTES)."""
  from flashsample_jax import stage2
  monkeypatch.setattr(stage2, "CANDIDATES", 32)
  monkeypatch.setattr(stage2, "EXACT_ROWS", exact_rows)
  if group_rows is not None:
    monkeypatch.setattr(stage2, "EXACT_GROUP_BYTES", group_rows * 4 * V)
  jax.clear_caches()                # both are read when the call is traced
  try:
    for key in KEYS.values():
      check("xla", "one_hot", key, "top_k_top_p")
  finally:
    jax.clear_caches()


@pytest.mark.parametrize("method", METHODS)
def test_positions_with_nothing_allowed_accept_no_minus_one(method):
  # A grammar that allows nothing at a position (finished) samples -1 there.
  # With strict acceptance that -1 matched the -1 of a missing draft or the
  # bonus slot: num_accepted reached K + 1. And the reference's greedy rows
  # with nothing allowed emitted id 0 (argmax of -inf), not sample()'s -1.
  words = -(-V // 32)
  mask = jnp.full((B, K1, words), 0xFFFFFFFF, jnp.uint32)
  mask = mask.at[:, K].set(0).at[2, 1].set(0)        # the bonus slot; request 2's gap
  drafts = jnp.argmax(LOGITS[:, :K], axis=-1).astype(jnp.int32).at[2, 1].set(-1)
  kw = dict(method=method, temperature=T, allowed_mask=mask, return_logprobs=True)
  if method == "probabilistic":
    kw["draft_probs"] = Q
  got = fs.verify_drafts(H, W, KEYS["scalar"], drafts, **kw)
  want = fs.reference.verify_drafts(H, W, KEYS["scalar"], drafts, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
  assert int(jnp.max(got.num_accepted)) <= K
  assert int(got.num_accepted[2]) <= 1                   # request 2: nothing after draft 1
  # Greedy requests (T = 0: request 2) whose position allows nothing emit -1.
  none = jnp.zeros((B, K1, words), jnp.uint32)
  empty = jnp.full((B, K), -1, jnp.int32)
  for verify in (fs.verify_drafts, fs.reference.verify_drafts):
    out = verify(H, W, KEYS["scalar"], empty, **dict(kw, allowed_mask=none))
    np.testing.assert_array_equal(out.tokens, -1)
    np.testing.assert_array_equal(out.num_accepted, 0)
  # A live draft at a position that allows nothing is rejected and the
  # position emits -1 (found by review: probabilistic drew its residual from
  # NaN probabilities and emitted id 0, in the reference too).
  first_none = mask.at[:, 0].set(0)
  for verify in (fs.verify_drafts, fs.reference.verify_drafts):
    out = verify(H, W, KEYS["scalar"], drafts, **dict(kw, allowed_mask=first_none))
    np.testing.assert_array_equal(out.num_accepted, 0)
    np.testing.assert_array_equal(out.tokens[:, 0], -1)
    assert bool(jnp.all(jnp.isnan(out.logprobs[:, 0])))


def test_ragged_drafts_ignore_what_follows_the_first_minus_one():
  # The docstring's promise (found by review: ids and draft_probs rows past a
  # request's first -1 were still checked, so zero-padded q was refused).
  drafts = DRAFTS.at[:, 1].set(-1).at[:, 2].set(V + 5).at[0, 2].set(-9)
  q = Q.at[:, 1:].set(0.0)
  for method in METHODS:
    extra = {"draft_probs": q} if method == "probabilistic" else {}
    got = fs.verify_drafts(H, W, KEYS["scalar"], drafts, method=method, temperature=T,
                           return_logprobs=True, **extra)
    want = fs.verify_drafts(H, W, KEYS["scalar"], DRAFTS.at[:, 1:].set(-1), method=method,
                            temperature=T, return_logprobs=True,
                            **({"draft_probs": Q} if extra else {}))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
  # A reached entry is still checked: the first -1's own place, and q's rows
  # of the drafts before it.
  with pytest.raises(ValueError, match=r"draft_ids\[3, 1\]=-4 must be an id"):
    fs.verify_drafts(H, W, KEYS["scalar"], drafts.at[3, 1].set(-4))
  with pytest.raises(ValueError, match=r"draft_probs\[5, 0\] sums to 0.0"):
    fs.verify_drafts(H, W, KEYS["scalar"], drafts, method="probabilistic",
                     draft_probs=q.at[5, 0].set(0.0))


def test_traced_drafts_past_the_vocabulary_are_never_accepted():
  # Found by review: under jit (no eager check) the probabilistic method read
  # q and p at a clipped id and accepted a padding row's id as a token.
  vocab = V - 40
  drafts = DRAFTS.at[:, 0].set(V - 10)                   # a padding row of W
  # q 0 at the last id, the clip's target: u * q < p there for any u.
  q = jnp.full((B, K, vocab), 1.0 / (vocab - 1), jnp.float32).at[:, :, -1].set(0.0)
  for method in METHODS:
    extra = {"draft_probs": q} if method == "probabilistic" else {}
    out = jax.jit(lambda d: fs.verify_drafts(H, W, KEYS["scalar"], d, method=method,
                                             vocab_size=vocab, **extra))(drafts)
    np.testing.assert_array_equal(out.num_accepted, 0)
    assert int(jnp.max(out.tokens)) < vocab


@pytest.mark.parametrize("method", METHODS)
def test_zero_hidden_requests_equal_reference(method):
  # A batch padded with zero hidden states (request 3 at every position, and
  # request 0's last), rules per request with every rule off in request 1
  # so that the pass draws noise: stage 2 decides the zero rows on the pass
  # (docs/design.md, "Rows of equal logits"), the residual draw included.
  h = H.at[3].set(0).at[0, K].set(0)
  rules = dict(top_k=jnp.asarray([30, 0, 30, 30, 30, 30], jnp.int32),
               top_p=jnp.asarray([0.9, 1.0, 0.9, 0.95, 0.8, 0.7], jnp.float32))
  for key in KEYS.values():
    check("xla", method, key, "plain", h=h, **rules)
