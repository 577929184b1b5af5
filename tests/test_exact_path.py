"""Stage 2's exact path: the fallback rows, and only they, are redone from
materialized logits (rows flagged for their lists alone: those lists); at most ``stage2.EXACT_ROWS`` of them as a compacted
batch of their own, more as the whole batch, or in compacted groups where
the batch's logits exceed ``stage2.EXACT_GROUP_BYTES`` (that choice in a
conditional inside the one that skips the path); the groups bound the
memory the program reserves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import api, controls, problem, stage2
from flashsample_jax.backends import xla
from tests import cases
from tests.cases import B, CASES, H, KEYS, T, V, W

_SENTINEL = -7


LOGITS = jnp.dot(H, W.T, preferred_element_type=jnp.float32)


# Groups of 10 rows (B = 24: three loop steps when every row is flagged).
_GROUPS_OF_10 = 10 * 4 * V


@pytest.mark.parametrize("flagged, key, source, group_bytes", [
    (0, "scalar", "head", None), (1, "per_row", "head", None),
    (stage2.EXACT_ROWS, "scalar", "head", None), (stage2.EXACT_ROWS + 1, "per_row", "head", None),
    (B, "scalar", "head", None), (1, "scalar", "logits", None),
    (stage2.EXACT_ROWS, "per_row", "logits", None),
    (stage2.EXACT_ROWS + 1, "scalar", "logits", None),
    (stage2.EXACT_ROWS + 5, "per_row", "head", _GROUPS_OF_10),
    (B, "scalar", "head", _GROUPS_OF_10), (B - 1, "per_row", "logits", _GROUPS_OF_10)])
def test_flagged_rows_and_only_they_are_redone(flagged, key, source, group_bytes,
                                               monkeypatch):
  if group_bytes is not None:
    monkeypatch.setattr(stage2, "EXACT_GROUP_BYTES", group_bytes)
    assert stage2.exact_group_rows(V) == 10
  kw = dict(CASES["penalties_all"])                 # every per-row control field
  if source == "head":
    p = problem.prepare(H, W, KEYS[key], temperature=T)
  else:                                             # fs.sample_logits: rows of logits
    p = problem.prepare_logits(LOGITS, KEYS[key], temperature=T)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, num_samples=2,
                                return_logprobs=True, **kw)
  # Every other flagged row is flagged for its lists alone (relist): its
  # top-N list is redone, its token and floats are not.
  rows_flagged = np.random.default_rng(flagged).permutation(B)[:flagged]
  fallback, relist = np.zeros(B, bool), np.zeros(B, bool)
  fallback[rows_flagged[::2]] = True
  relist[rows_flagged[1::2]] = True
  listed = fallback | relist
  s, n = 2, kw["top_logprobs"]
  rows = stage2._Rows(tokens=jnp.full((s, B), _SENTINEL, jnp.int32),
                      t_tok=jnp.zeros((s, B)), lse_kept=jnp.zeros((s, B)),
                      lse_all=jnp.zeros((B,)),
                      top=(jnp.zeros((B, n)), jnp.full((B, n), _SENTINEL, jnp.int32)),
                      fallback=jnp.asarray(fallback), relist=jnp.asarray(relist))
  out = jax.jit(lambda p, c, rows: stage2._exact_path(p, c, rows, None))(p, c, rows)
  want = fs.reference.sample(H, W, KEYS[key], temperature=T, num_samples=2,
                             return_logprobs=True, **kw)
  tokens, top_ids = np.asarray(out.tokens), np.asarray(out.top[1])
  np.testing.assert_array_equal(tokens[:, fallback], np.asarray(want.tokens)[:, fallback])
  np.testing.assert_array_equal(top_ids[listed], np.asarray(want.top_ids)[listed])
  np.testing.assert_allclose(np.asarray(out.lse_all)[fallback],
                             np.asarray(want.logsumexp)[0, fallback], rtol=2e-5, atol=2e-5)
  assert (tokens[:, ~fallback] == _SENTINEL).all()
  assert (top_ids[~listed] == _SENTINEL).all()
  assert (np.asarray(out.lse_all)[~fallback] == 0).all()


def test_groups_bound_the_memory_the_program_reserves(monkeypatch):
  # XLA reserves every branch's buffers whether or not a row takes it: with
  # the whole batch in one group the exact path holds several [B, V] f32
  # buffers; in groups of 16 rows, [16, V] ones. (A fused pass writes no
  # logits, so this is what a call with truncation reserves beyond it.)
  b, v = 256, 4096
  h = jax.random.normal(jax.random.key(0), (b, 64), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (v, 64), jnp.bfloat16)
  p = problem.prepare(h, w, jax.random.key(2), temperature=1.0)
  c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, top_k=50, top_p=0.9,
                                return_logprobs=True)
  rows = stage2._Rows(tokens=jnp.zeros((1, b), jnp.int32), t_tok=jnp.zeros((1, b)),
                      lse_kept=jnp.zeros((1, b)), lse_all=jnp.zeros((b,)), top=None,
                      fallback=jnp.zeros((b,), bool), relist=jnp.zeros((b,), bool))

  def temp_bytes():
    f = jax.jit(lambda p, c, rows: stage2._exact_path(p, c, rows, None))
    return f.lower(p, c, rows).compile().memory_analysis().temp_size_in_bytes

  whole = temp_bytes()
  assert whole > 3 * b * v * 4
  monkeypatch.setattr(stage2, "EXACT_GROUP_BYTES", 16 * 4 * v)
  assert temp_bytes() < b * v * 4 / 2


def _the_conditional(jaxpr):
  """``(its equation, the primitives that follow it)`` for the exact path's
  conditional in the traced program (searched through nested jits), None
  where it has none."""
  for i, e in enumerate(jaxpr.eqns):
    if e.primitive.name == "cond":
      return e, [f.primitive.name for f in jaxpr.eqns[i + 1:]]
    if "jaxpr" in e.params:
      found = _the_conditional(e.params["jaxpr"].jaxpr)
      if found is not None:
        return found[0], found[1] + [f.primitive.name for f in jaxpr.eqns[i + 1:]]
  return None


def _conditionals(jaxpr) -> int:
  """The conditionals among ``jaxpr``'s own equations."""
  return sum(e.primitive.name == "cond" for e in jaxpr.eqns)


@pytest.mark.parametrize("rows", [4, stage2.EXACT_COND_ROWS, stage2.EXACT_COND_ROWS + 1, B])
@pytest.mark.parametrize("logprobs", [False, True])
def test_the_conditional_is_the_calls_last_step(rows, logprobs):
  # The output is assembled inside the conditional's branches: on a GPU a
  # kernel after it was launched apart from the CUDA graph. Only reshapes
  # (no kernel) may follow it. It has two branches; past EXACT_COND_ROWS
  # rows its taken branch holds the choice of compacted or every row, a
  # conditional of its own (docs/performance.md, "The exact path's
  # conditional").
  assert stage2.EXACT_COND_ROWS < B
  f = lambda h, w, k: fs.sample(h, w, k, temperature=0.7, top_k=20, top_p=0.9,
                                backend="xla", return_logprobs=logprobs)
  found = _the_conditional(jax.make_jaxpr(f)(H[:rows], W, KEYS["scalar"]).jaxpr)
  assert found is not None, "no conditional"
  cond, after = found
  skipped, taken = (b.jaxpr for b in cond.params["branches"])
  assert _conditionals(skipped) == 0
  assert _conditionals(taken) == (rows > stage2.EXACT_COND_ROWS)
  assert set(after) <= {"squeeze", "reshape"}, after


@pytest.mark.parametrize("rule, rows", [
    ("top_k", stage2.EXACT_COND_ROWS), ("top_k", stage2.EXACT_COND_ROWS + 4),
    ("top_p", 3 * stage2.EXACT_ROWS), ("top_p", 3 * stage2.EXACT_ROWS + 3)])
def test_flagged_rows_of_one_and_nested_conditionals_equal_reference(rule, rows):
  # Flagged rows, every third: with top-k 50, rows whose ties at the 50th
  # value run past the 64 candidates; with top-p alone, flat rows whose
  # nucleus is wider than the lists. Every row is redone up to
  # EXACT_COND_ROWS rows; past them the nested conditional redoes the
  # flagged rows compacted (up to EXACT_ROWS of them: 8 of 24 rows) or
  # every row (9 of 27); each must return the reference's tokens and flag
  # just those rows.
  v = 512
  rng = np.random.default_rng(rows)
  tied = np.arange(rows) % 3 == 0
  # Distinct values (multiples of 1/64 in [-4, 4), exact in bf16) on the
  # other rows: no ties there.
  logits = np.stack([rng.permutation(v) / 64 - 4 for _ in range(rows)]).astype(np.float32)
  if rule == "top_k":
    kw = dict(top_k=50, top_p=0.97)
    logits[tied] = np.round((logits[tied] - 8.0) * 8) / 8
    logits[tied, :40] = 2.0
    logits[tied, 40:80] = 1.0                        # 40 ties at the 50th value
  else:
    kw = dict(top_p=0.97)
    logits *= 4.0                                    # a narrow nucleus
    logits[tied] = 1.0                               # every id in it
  h = jnp.eye(rows, dtype=jnp.bfloat16)
  w = jnp.asarray(logits.T, jnp.bfloat16)
  assert np.array_equal(np.asarray(w, np.float32), logits.T)     # exact in bf16
  keys = jax.random.split(jax.random.key(rows), rows)
  p = problem.prepare(h, w, keys, temperature=1.0)
  c = controls.prepare_controls(batch=rows, vocab_size=v, rows=v, **kw)
  _, _, fallback = jax.jit(lambda p, c: stage2.finish(p, c, xla.controls_state(p, c)))(p, c)
  np.testing.assert_array_equal(fallback, tied)
  got = fs.sample(h, w, keys, temperature=1.0, backend="xla", **kw)
  want = fs.reference.sample(h, w, keys, temperature=1.0, **kw)
  np.testing.assert_array_equal(got, want)


def _pad(rows):
  """Zero hidden rows of a batch (two in every six)."""
  return np.flatnonzero(np.isin(np.arange(rows) % 6, (0, 5)))


def _zero_row_case(case, rows):
  """``(rules, flat)``: a case's rules for ``rows`` rows, and whether its
  zero rows are flat (docs/design.md, "Rows of equal logits")."""
  per_row = lambda on, off, dtype: jnp.asarray(np.where(np.arange(rows) == 3, off, on), dtype)
  return {
      # A concrete rule on every row: the pass draws no noise (Controls.for_pass),
      # so its best is no sample of a flat row.
      "every_row": (dict(top_k=20, top_p=0.9), True),
      # Every rule off for row 3: the pass draws noise.
      "per_row": (dict(top_k=per_row(20, 0, jnp.int32), top_p=per_row(0.9, 1.0, jnp.float32),
                       min_p=per_row(0.05, 0.0, jnp.float32)), True),
      "mask_penalties": (dict(top_p=jnp.asarray(np.linspace(0.3, 1.0, rows), jnp.float32),
                              allowed_mask=cases._mask(rows), softcap=5.0,
                              repetition_penalty=2.0, presence_penalty=0.0,
                              frequency_penalty=jnp.zeros((rows,), jnp.float32),
                              prompt_ids=cases.PENALTIES["prompt_ids"][:rows],
                              output_ids=cases.PENALTIES["output_ids"][:rows]), True),
      # A presence penalty moves the logits of the history's ids: not flat.
      "presence": (dict(top_k=20, top_p=0.9, presence_penalty=0.5,
                        output_ids=cases.PENALTIES["output_ids"][:rows]), False),
      # A bias makes the row what the bias is: not flat.
      "bias": (dict(top_k=per_row(20, 0, jnp.int32),
                    logit_bias=cases.CASES["bias"]["logit_bias"]), False),
  }[case]


def _zero_rows_flagged(h, kw, temperature, rl=None):
  """finish's exact-path rows of the call (the pass as api.run runs it),
  and whether that pass draws noise."""
  rows = h.shape[0]
  c = controls.prepare_controls(batch=rows, vocab_size=V, rows=V, **kw, **(rl or {}))
  p = problem.prepare(h, W, KEYS["scalar"], temperature=temperature)
  st = stage2.per_sample(api.pass_state(p, c.for_pass(), xla.XlaBackend(), 0), c.samples)
  return np.asarray(jax.jit(stage2.finish)(p, c, st)[2]), c.for_pass().noise


@pytest.mark.parametrize("rows", [12, 22])
@pytest.mark.parametrize("case", ["every_row", "per_row", "mask_penalties", "presence", "bias"])
def test_zero_rows_are_decided_on_the_pass_where_it_can(case, rows):
  # A batch padded with zero hidden rows: every logit of such a row is 0,
  # all tied at its top, so every truncation rule keeps the whole row and no
  # candidate list holds it. Where the pass drew noise its best is their
  # token, and they skip the exact path; where it drew none (a rule on for
  # every row, given as numbers) the sampled ones still take it
  # (docs/design.md, "Rows of equal logits"), and greedy rows never do.
  # 12 rows: one conditional; 22: the nested one. Tokens equal the
  # reference's (several samples too), the floats score_tokens finds for
  # them bit for bit.
  kw, flat = _zero_row_case(case, rows)
  pad = _pad(rows)
  h = H[:rows].at[pad].set(0)
  greedy = np.arange(rows) % 4 == 1                      # rows 5 and 17: zero rows
  temperature = jnp.asarray(np.where(greedy, 0.0, 0.5), jnp.float32)
  rl = dict(return_logprobs=True, return_entropy=True)
  fallback, noise = _zero_rows_flagged(h, kw, temperature, rl)
  assert (fallback[pad[greedy[pad]]] != flat).all()
  assert (fallback[pad[~greedy[pad]]] != (flat and noise)).all()
  got = fs.sample(h, W, KEYS["scalar"], temperature=temperature, backend="xla", **kw, **rl)
  want = fs.reference.sample(h, W, KEYS["scalar"], temperature=temperature, **kw, **rl)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  for name in ("logprob", "logprob_truncated", "logsumexp", "entropy", "entropy_truncated"):
    np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=2e-6,
                               err_msg=name)
  sc = fs.score_tokens(h, W, got.tokens, temperature=temperature, backend="xla", **kw)
  for name in ("logprob", "logprob_truncated", "entropy", "entropy_truncated"):
    a, b = (np.asarray(getattr(o, name)) for o in (got, sc))
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=name)
  np.testing.assert_array_equal(
      fs.sample(h, W, KEYS["per_row"][:rows], temperature=temperature, backend="xla",
                num_samples=3, **kw),
      fs.reference.sample(h, W, KEYS["per_row"][:rows], temperature=temperature,
                          num_samples=3, **kw))


@pytest.mark.parametrize("rows", [12, 22])
def test_zero_rows_beside_a_row_on_the_exact_path(rows):
  # Rules per row (noise in the pass) and a row the lists cannot certify
  # (a one-hot hidden row: integer logits in -3..3, ties at the 20th value
  # far past the lists): that row alone takes the exact path, the zero
  # rows are decided on the pass. Tokens equal the reference's.
  kw = dict(top_k=jnp.asarray(np.where(np.arange(rows) == 3, 0, 20), jnp.int32))
  h = H[:rows].at[_pad(rows)].set(0).at[2].set(jnp.eye(H.shape[1], dtype=H.dtype)[3])
  fallback, _ = _zero_rows_flagged(h, kw, 0.5)
  np.testing.assert_array_equal(np.flatnonzero(fallback), [2])
  np.testing.assert_array_equal(
      fs.sample(h, W, KEYS["scalar"], temperature=0.5, backend="xla", **kw),
      fs.reference.sample(h, W, KEYS["scalar"], temperature=0.5, **kw))


def test_zero_rows_of_a_non_finite_weight_take_the_exact_path():
  # A zero hidden row against a weight row holding inf has a NaN logit
  # (0 * inf), which the pass's sum of exp(t - max) shows (the xla
  # backend's max skips it): such a row is not flat and takes the exact
  # path, as every row of NaN logits does.
  rows = 6
  pad = _pad(rows)
  h = H[:rows].at[pad].set(0)
  w = W.at[7, 3].set(jnp.inf)
  kw = dict(top_k=jnp.full((rows,), 20, jnp.int32).at[1].set(0))
  c = controls.prepare_controls(batch=rows, vocab_size=V, rows=V, **kw)
  p = problem.prepare(h, w, KEYS["scalar"], temperature=0.5)
  assert c.for_pass().noise
  st = api.pass_state(p, c, xla.XlaBackend(), 0)
  assert np.isnan(np.asarray(st.lse_sum)[pad]).all()
  assert np.isnan(np.asarray(st.best_score)[pad]).all()
  _, _, fallback = jax.jit(stage2.finish)(p, c, st)
  assert np.asarray(fallback)[pad].all()
  np.testing.assert_array_equal(
      fs.sample(h, w, KEYS["scalar"], temperature=0.5, backend="xla", **kw),
      fs.reference.sample(h, w, KEYS["scalar"], temperature=0.5, **kw))


def _enclosing(jaxpr):
  """``(the jaxpr holding the exact path's conditional, its equation)``
  (searched through nested jits)."""
  for e in jaxpr.eqns:
    if e.primitive.name == "cond":
      return jaxpr, e
    if "jaxpr" in e.params:
      found = _enclosing(e.params["jaxpr"].jaxpr)
      if found is not None:
        return found
  return None


@pytest.mark.parametrize("rows", [4, B])
def test_controls_given_as_numbers_are_no_operands_of_the_conditional(rows):
  # Under jax.jit a temperature, top-k, top-p or penalty given as one number
  # becomes a [B] input of the sampler's program, as do the noise counters;
  # as operands of the conditional XLA materializes them on every call (a
  # kernel each on a GPU). The branches make them again (from a first
  # entry, or from static values: docs/performance.md, "The exact path's
  # conditional"); controls given per row stay operands.
  h, w = H[:rows], W
  given = dict(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.25)
  history = jnp.zeros((rows, 3), jnp.int32)
  as_rows = lambda v: jnp.full((rows,), v, jnp.int32 if isinstance(v, int) else jnp.float32)

  def row_operands(per_row: bool) -> int:
    def f(h, w, k, *arrays):
      kw = dict(zip(given, arrays)) if per_row else given
      return fs.sample(h, w, k, backend="xla", prompt_ids=history, **kw)
    arrays = [as_rows(v) for v in given.values()] if per_row else []
    jaxpr, cond = _enclosing(jax.make_jaxpr(f)(h, w, KEYS["scalar"], *arrays).jaxpr)
    inputs = set(jaxpr.invars)
    return sum(v in inputs and v.aval.shape == (rows,) and v.aval.dtype != jnp.bool_
               for v in cond.invars)

  assert row_operands(per_row=False) == 0
  assert row_operands(per_row=True) == len(given)
  np.testing.assert_array_equal(
      jax.jit(lambda h, w, k: fs.sample(h, w, k, backend="xla", prompt_ids=history,
                                        **given))(h, w, KEYS["scalar"]),
      fs.reference.sample(h, w, KEYS["scalar"], prompt_ids=history, **given))


@pytest.mark.parametrize("rows", [6, 12, 27])
def test_flagged_rows_under_jit_with_controls_given_as_numbers(rows):
  # Under jax.jit the exact path's branches make the temperature, the
  # controls given as numbers and the noise counters again: the flagged
  # rows (every third: 30 distinct values, then 40 ties at the 50th value,
  # past the 64 candidates) must still equal the reference, whose kept set
  # and token depend on each of them. 6 rows: every row redone; 12 and 27
  # (4 / 9 flagged): compacted / every row in the nested conditional.
  v = 512
  rng = np.random.default_rng(rows)
  tied = np.arange(rows) % 3 == 0
  logits = np.stack([rng.permutation(v) / 64 - 4 for _ in range(rows)]).astype(np.float32)
  logits[tied] = np.round((logits[tied] - 8.0) * 8) / 8
  logits[np.ix_(tied, np.arange(30))] = 3.0 + rng.permutation(32)[:30] / 32
  logits[np.ix_(tied, np.arange(30, 70))] = 1.0
  h = jnp.eye(rows, dtype=jnp.bfloat16)
  w = jnp.asarray(logits.T, jnp.bfloat16)
  assert np.array_equal(np.asarray(w, np.float32), logits.T)     # exact in bf16
  kw = dict(temperature=0.5, top_k=50, top_p=0.5, repetition_penalty=2.0,
            prompt_ids=jnp.asarray(np.tile([[0, 3, 31]], (rows, 1)), jnp.int32))
  def fallback(h, w, k):
    p = problem.prepare(h, w, k, temperature=kw["temperature"])
    c = controls.prepare_controls(batch=rows, vocab_size=v, rows=v,
                                  **{n: x for n, x in kw.items() if n != "temperature"})
    assert p.uniform_temperature and set(c.uniform) == {"top_k", "top_p", "repetition_penalty"}
    return stage2.finish(p, c, api.pass_state(p, c.for_pass(), xla.XlaBackend(), 0))[2]
  np.testing.assert_array_equal(jax.jit(fallback)(h, w, jax.random.key(0)), tied)
  f = jax.jit(lambda h, w, k: fs.sample(h, w, k, backend="xla", **kw))
  for seed in range(4):
    key = jax.random.key(seed)
    np.testing.assert_array_equal(f(h, w, key), fs.reference.sample(h, w, key, **kw))
