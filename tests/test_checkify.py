"""Traced controls out of range (issue #42, defect 5).

A traced value cannot be range-checked when the call is traced; while traced
checks are on (``fs.traced_checks()``, ``FSJ_TRACED_CHECKS=1``; this module
turns them on for its tests; the last ones turn them off again) each control carries a
``checkify`` check instead: a no-op in a plain call (the call runs and
returns what it returns for such a value), an error naming the control and
its first bad entry under ``checkify.checkify``. Off (the default), a trace
carries no check and no effect, so jitted calls keep JAX's fast dispatch.
Concrete values are refused eagerly (tests/test_validation.py); the
temperature's and the repetition penalty's traced checks are tested there
too.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import flashsample_jax as fs
from tests import inputs

B, V = 4, 100
H, W = inputs.exact_inputs(B, 64, V)
KEY = jax.random.key(0)
HISTORY = jnp.zeros((B, 2), jnp.int32)
NAN = float("nan")

# (control, bad value, entry shown, what the message says it must be; the
# other keywords the call needs).
BAD = [
    ("top_p", 1.5, "1.5", r"in \(0.0, 1.0\]", {}),
    ("top_p", 0.0, "0.0", r"in \(0.0, 1.0\]", {}),
    ("top_p", -1.0, "-1.0", r"in \(0.0, 1.0\]", {}),
    ("top_p", NAN, "nan", r"in \(0.0, 1.0\]", {}),
    ("min_p", 2.0, "2.0", r"in \[0.0, 1.0\]", {}),
    ("min_p", NAN, "nan", r"in \[0.0, 1.0\]", {}),
    ("top_k", -3, "-3", r"in \[0, 2147483647\]", {}),
    ("softcap", -1.0, "-1.0", r"> 0", {}),
    ("softcap", NAN, "nan", r"> 0", {}),
    ("softcap", float("inf"), "inf", r"> 0 and finite", {}),
    ("presence_penalty", float("inf"), "inf", "finite", {"output_ids": HISTORY}),
    ("frequency_penalty", NAN, "nan", "finite", {"output_ids": HISTORY}),
    ("repetition_penalty", -2.0, "-2.0", "a normal float32", {"prompt_ids": HISTORY}),
    ("temperature", NAN, "nan", "0 \\(greedy\\) or a normal float32", {}),
]


@pytest.fixture(autouse=True)
def _checks_on(monkeypatch):
  monkeypatch.setenv("FSJ_TRACED_CHECKS", "1")


def _dtype(name):
  return jnp.int32 if name == "top_k" else jnp.float32


@pytest.mark.parametrize("name, bad, shown, want, extra", BAD,
                         ids=[f"{b[0]}={b[1]}" for b in BAD])
def test_traced_control_out_of_range_fails_a_checkify_check(name, bad, shown, want, extra):
  f = jax.jit(lambda v: fs.sample(H, W, KEY, backend="xla", **{name: v}, **extra))
  checked = checkify.checkify(f, errors=checkify.user_checks)
  # A scalar: the control's name; a [B] row: the first bad entry.
  err, _ = checked(jnp.asarray(bad, _dtype(name)))
  assert err.get() is not None and re.search(rf"{name}={shown}\S* must be {want}", err.get())
  good = {"top_k": 5, "softcap": 3.0, "repetition_penalty": 2.0,
          "temperature": 0.5}.get(name, 0.5)
  if name == "softcap":                    # a scalar only
    f(jnp.float32(bad))
    assert checked(jnp.float32(good))[0].get() is None
    return
  rows = jnp.asarray([good, good, bad, good], _dtype(name))
  err, _ = checked(rows)
  assert err.get() is not None and re.search(rf"{name}\[2\]={shown}\S* must be {want}",
                                             err.get())
  f(rows)                                  # unchecked: the call runs (no check)
  err, _ = checked(jnp.full((B,), good, _dtype(name)))
  assert err.get() is None


@pytest.mark.parametrize("name", ["prompt_ids", "output_ids"])
def test_traced_history_ids_out_of_range_fail_a_checkify_check(name):
  f = jax.jit(lambda ids: fs.sample(H, W, KEY, backend="xla", repetition_penalty=2.0,
                                    **{name: ids}))
  checked = checkify.checkify(f, errors=checkify.user_checks)
  ids = np.full((B, 3), -1, np.int32)
  ids[1, 1] = 7
  err, out = checked(jnp.asarray(ids))
  assert err.get() is None
  np.testing.assert_array_equal(out, fs.reference.sample(H, W, KEY, repetition_penalty=2.0,
                                                         **{name: jnp.asarray(ids)}))
  for bad in (V, -2):
    ids[2, 2] = bad
    err, _ = checked(jnp.asarray(ids))
    assert err.get() is not None and re.search(
        rf"{name} entry 8 \(flat, shape \(4, 3\)\)={bad} must be an id in \[0, {V}\) "
        r"or -1", err.get())
    f(jnp.asarray(ids))                    # unchecked: ignored, as the reference does


def test_checks_reach_sample_logits_and_params():
  logits = jnp.zeros((B, V), jnp.float32)
  f = jax.jit(lambda p: fs.sample_logits(logits, KEY, p))
  err, _ = checkify.checkify(f, errors=checkify.user_checks)(fs.SamplingParams(
      top_p=jnp.float32(1.5)))
  assert err.get() is not None and "top_p=1.5 must be in (0.0, 1.0]" in err.get()


def test_traced_draft_ids_out_of_range_fail_a_checkify_check():
  h = jnp.stack([H, H], axis=1)                             # [B, K + 1 = 2, D]
  f = jax.jit(lambda d: fs.verify_drafts(h, W, KEY, d, backend="xla"))
  checked = checkify.checkify(f, errors=checkify.user_checks)
  assert checked(jnp.full((B, 1), 3, jnp.int32))[0].get() is None
  err, _ = checked(jnp.full((B, 1), V, jnp.int32))
  assert err.get() is not None and f"draft_ids must hold an id in [0, {V}) or -1" in err.get()


@pytest.mark.parametrize("dtype", [jnp.uint32, jnp.uint8])
def test_traced_unsigned_ids_are_checked_against_the_vocabulary_alone(dtype):
  # Found by review: ``ids >= -1`` converted -1 to the dtype's largest
  # value, so every valid unsigned id failed the check.
  hist = jax.jit(lambda ids: fs.sample(H, W, KEY, backend="xla", repetition_penalty=2.0,
                                       output_ids=ids))
  h = jnp.stack([H, H], axis=1)
  drafts = jax.jit(lambda d: fs.verify_drafts(h, W, KEY, d, backend="xla").tokens)
  for f, width, name in ((hist, 2, "output_ids"), (drafts, 1, "draft_ids")):
    checked = checkify.checkify(f, errors=checkify.user_checks)
    assert checked(jnp.full((B, width), 3, dtype))[0].get() is None
    err, _ = checked(jnp.full((B, width), V, dtype))
    assert err.get() is not None and name in err.get()


# The default: no checks in the trace, so no effect, which would take every
# call of a jitted program off JAX's fast dispatch path
# (flashsample_jax/checks.py, docs/design.md, "Checks of traced values").
_TRACED_CALLS = {
    "sample": lambda t, k, d: fs.sample(H, W, KEY, temperature=t, top_k=k, top_p=t / 2,
                                        backend="xla"),
    "score_tokens": lambda t, k, d: fs.score_tokens(H, W, d[:, 0], temperature=t, top_k=k,
                                                    backend="xla"),
    "verify_drafts": lambda t, k, d: fs.verify_drafts(jnp.stack([H, H], axis=1), W, KEY, d,
                                                      temperature=t, top_k=k, backend="xla"),
}
_TRACED_ARGS = (jnp.full((B,), 0.7, jnp.float32), jnp.full((B,), 5, jnp.int32),
                jnp.full((B, 1), 3, jnp.int32))


@pytest.mark.parametrize("call", sorted(_TRACED_CALLS))
def test_traced_checks_are_off_by_default_and_leave_no_effect(call, monkeypatch):
  monkeypatch.delenv("FSJ_TRACED_CHECKS", raising=False)
  f = _TRACED_CALLS[call]
  effects = lambda g: jax.make_jaxpr(g)(*_TRACED_ARGS).effects
  assert effects(f) == set()
  # A block is in JAX's cache key: the same function is traced again in it.
  with fs.traced_checks():
    assert effects(f) != set()
    with fs.traced_checks(False):                      # the innermost block decides
      assert effects(f) == set()
  assert effects(f) == set()
  # The environment is read at each trace (not a cache key: a new function).
  monkeypatch.setenv("FSJ_TRACED_CHECKS", "1")
  assert effects(lambda *a: f(*a)) != set()


def test_unchecked_bad_traced_value_reports_nothing_and_turning_checks_on_reports_it(
    monkeypatch):
  monkeypatch.delenv("FSJ_TRACED_CHECKS", raising=False)
  f = lambda tp: fs.sample(H, W, KEY, top_p=tp, backend="xla")
  err, _ = checkify.checkify(jax.jit(f), errors=checkify.user_checks)(jnp.float32(1.5))
  assert err.get() is None                                 # off: nothing was traced in
  with fs.traced_checks():
    err, _ = checkify.checkify(jax.jit(f), errors=checkify.user_checks)(jnp.float32(1.5))
  assert err.get() is not None and "top_p=1.5 must be in (0.0, 1.0]" in err.get()
  with pytest.raises(TypeError, match=r"enabled=1 must be a bool"):
    with fs.traced_checks(1):
      pass


def test_traced_weight_scale_that_is_not_finite_fails_a_checkify_check():
  # A traced scale cannot be checked eagerly (a concrete one raises:
  # tests/test_quantized.py): the first NaN or infinite entry is named.
  w8, scale = fs.quantize_weight(W, "int8")
  f = jax.jit(lambda s: fs.sample(H, w8, KEY, backend="xla", weight_scale=s))
  checked = checkify.checkify(f, errors=checkify.user_checks)
  err, _ = checked(scale.at[3].set(jnp.nan))
  assert err.get() is not None and re.search(r"weight_scale\[3\]=nan must be a finite float32",
                                             err.get())
  err, _ = checked(jnp.float32(jnp.inf))
  assert err.get() is not None and re.search(r"weight_scale=inf must be a finite", err.get())
  assert checked(scale)[0].get() is None


def test_sample_sharded_checks_are_read_once_the_error_is_replicated():
  # Found by review: on an Explicit mesh checkify hands the error back
  # sharded over the mesh and err.get() fails inside JAX; replicated as the
  # README says, it names the bad scale.
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((4,), ("tp",))
  w8, _ = fs.quantize_weight(W, "int8")
  wg = jax.device_put(w8, NamedSharding(mesh, P("tp", None)))
  f = jax.jit(lambda s: fs.sample_sharded(H, wg, KEY, mesh=mesh, vocab_axis="tp",
                                          weight_scale=s))
  err, _ = checkify.checkify(f, errors=checkify.user_checks)(jnp.float32(jnp.nan))
  err = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), err)
  assert err.get() is not None and re.search(r"weight_scale=nan must be a finite", err.get())


def test_traced_draft_probs_that_are_no_distribution_fail_a_checkify_check():
  h = jnp.stack([H, H], axis=1)                                    # [B, 2, D]
  q = jnp.full((B, 1, V), 1.0 / V, jnp.float32)
  drafts = jnp.zeros((B, 1), jnp.int32)
  f = jax.jit(lambda q: fs.verify_drafts(h, W, KEY, drafts, method="probabilistic",
                                         draft_probs=q, backend="xla").tokens)
  checked = checkify.checkify(f, errors=checkify.user_checks)
  err, _ = checked(q.at[2, 0, 7].set(-1.0))
  assert err.get() is not None and re.search(r"draft_probs row 2 .* is no distribution",
                                             err.get())
  err, _ = checked(q * 3)
  assert err.get() is not None and "row 0" in err.get()
  assert checked(q)[0].get() is None

