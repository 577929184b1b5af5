"""Bad input gets a TypeError/ValueError naming the argument and its value."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import flashsample_jax as fs
from tests import inputs

H, W = inputs.exact_inputs(4, 64, 100)
KEY = jax.random.key(0)
SAMPLERS = [fs.sample, fs.reference.sample]


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(hidden=H.astype(jnp.int32)), TypeError, r"hidden.dtype=int32"),
    (dict(weight=np.asarray(W, np.int8)), TypeError, r"weight.dtype=int8"),
    (dict(hidden=[[1.0]]), TypeError, r"hidden must be a JAX or NumPy array"),
    (dict(hidden=H[0]), ValueError, r"hidden must be 2-D.*\(64,\)"),
    (dict(weight=W[:, :32]), ValueError, r"D=64 vs 32"),
    (dict(weight_layout="vd", weight=W.T), ValueError, r"weight.shape=\(64, 100\)"),
    # A Flax kernel [D, V] passed as "vd" (the default), and the converse.
    (dict(weight=W.T), ValueError,
     r"weight.shape=\(64, 100\).*D=64 vs 100; weight looks like \[D, V\]: pass "
     r"weight_layout='dv'"),
    (dict(weight_layout="dv"), ValueError,
     r"weight.shape=\(100, 64\).*pass weight_layout='vd'"),
    (dict(weight_layout="kv"), ValueError, r"weight_layout='kv'"),
    (dict(vocab_size=0), ValueError, r"vocab_size=0 must be in \[1, 100\]"),
    (dict(vocab_size=101), ValueError, r"vocab_size=101"),
    (dict(vocab_size=50.0), TypeError, r"vocab_size=50.0"),
    (dict(vocab_size=True), TypeError, r"vocab_size=True"),
    (dict(temperature=-1.0), ValueError,
     r"temperature=-1.0 must be 0 \(greedy\) or a normal float32 in \[2\*\*-126, 2\*\*126\)"),
    (dict(temperature=float("nan")), ValueError, r"temperature=nan"),
    (dict(temperature=jnp.array([1.0, -2.0, 1.0, 1.0])), ValueError,
     r"temperature\[1\]=-2.0"),
    (dict(temperature=jnp.ones(3)), ValueError, r"temperature.shape=\(3,\)"),
    (dict(temperature="hot"), TypeError, r"temperature"),
    (dict(temperature=jnp.array([True] * 4)), TypeError, r"temperature.dtype=bool"),
    (dict(key=0), TypeError, r"key must be a JAX key"),
    (dict(key=jnp.zeros(2, jnp.int32)), TypeError, r"key.dtype=int32"),
    (dict(key=jnp.zeros(3, jnp.uint32)), ValueError, r"key.shape=\(3,\)"),
    (dict(key=jax.random.split(KEY, 3)), ValueError, r"key has 3 keys, hidden has B=4"),
    (dict(key=jax.random.split(KEY, (2, 2))), ValueError, r"key.shape=\(2, 2\)"),
    (dict(key=jax.random.key(0, impl="rbg")), ValueError, r"'rbg'"),
    (dict(backend="cuda"), ValueError, r"backend='cuda'"),
])
def test_bad_input(sampler, kwargs, exc, match):
  args = dict(hidden=H, weight=W, key=KEY)
  args.update(kwargs)
  with pytest.raises(exc, match=match):
    sampler(args.pop("hidden"), args.pop("weight"), args.pop("key"), **args)


def test_sample_logits_errors_name_logits():
  # found by review: a per-row key count mismatch named hidden, an argument
  # sample_logits does not have.
  logits = jnp.zeros((4, 100))
  with pytest.raises(ValueError, match=r"one key per row of logits: key has 3 keys, logits has B=4"):
    fs.sample_logits(logits, jax.random.split(KEY, 3))


def test_raw_key_data_equals_typed_key():
  typed = jax.random.key(7)
  raw = jax.random.key_data(typed)
  np.testing.assert_array_equal(fs.sample(H, W, raw), fs.sample(H, W, typed))
  rows = inputs.row_keys(4)
  np.testing.assert_array_equal(fs.sample(H, W, jax.random.key_data(rows)),
                                fs.sample(H, W, rows))
  np.testing.assert_array_equal(fs.sample(H, W, raw),
                                fs.reference.sample(H, W, raw))


def test_integer_and_array_temperatures_are_accepted():
  np.testing.assert_array_equal(fs.sample(H, W, KEY, temperature=2),
                                fs.sample(H, W, KEY, temperature=2.0))
  np.testing.assert_array_equal(fs.sample(H, W, KEY, temperature=jnp.float32(2)),
                                fs.sample(H, W, KEY, temperature=2.0))


def test_traced_invalid_temperature_is_not_checked_and_matches_reference():
  # Under jit a temperature cannot be inspected: a negative one samples from
  # -logits/|T| (what categorical(l / T) does); NaN gives id 0 like argmax.
  # (Only checkify.checkify reports them: see the checkify tests below.)
  f = jax.jit(lambda t: fs.sample(H, W, KEY, temperature=t))
  g = jax.jit(lambda t: fs.reference.sample(H, W, KEY, temperature=t))
  for t in (jnp.float32(-1.0), jnp.float32(jnp.nan)):
    np.testing.assert_array_equal(f(t), g(t))
  np.testing.assert_array_equal(f(jnp.float32(jnp.nan)), 0)


def test_empty_batch():
  out = fs.sample(H[:0], W, KEY)
  assert out.shape == (0,) and out.dtype == jnp.int32
  out = fs.sample(H[:0], W, KEY, num_samples=3, return_logprobs=True)
  assert out.tokens.shape == (3, 0) and out.logprob.shape == (3, 0)


# -- values the kernels' arithmetic does not cover (issue #42, defect 9) -------
#
# The kernels multiply by 1/T (docs/design.md, "Division"): a subnormal T
# (XLA:CPU compares it equal to 0, so the row turned greedy where
# categorical(key, l / T) samples; GPUs flush it, and 1/T is inf) and
# T >= 2**126 (1/T subnormal) are refused: eagerly when concrete, by a
# checkify check when traced.

_LARGEST_SUBNORMAL = float(np.nextafter(np.float32(2.0**-126), np.float32(0)))
_BELOW_BOUND = float(np.nextafter(np.float32(2.0**126), np.float32(0)))
_RANGE = r"must be 0 \(greedy\) or a normal float32 in \[2\*\*-126, 2\*\*126\)"


@pytest.mark.parametrize("t", [2.0**-126, 1e-37, 1e37, _BELOW_BOUND])
def test_temperatures_just_inside_equal_the_reference(t):
  logits = jnp.asarray(H, jnp.float32) @ jnp.asarray(W, jnp.float32).T
  got = fs.sample(H, W, KEY, temperature=t, backend="xla")
  np.testing.assert_array_equal(got, fs.reference.sample(H, W, KEY, temperature=t))
  np.testing.assert_array_equal(got, jax.random.categorical(KEY, logits / jnp.float32(t)))
  rows = jnp.array([t, 0.0, 1.0, t], jnp.float32)
  keys = inputs.row_keys(4)
  np.testing.assert_array_equal(fs.sample(H, W, keys, temperature=rows, backend="xla"),
                                fs.reference.sample(H, W, keys, temperature=rows))
  f = jax.jit(lambda t: fs.sample(H, W, KEY, temperature=t, backend="xla"))
  with fs.traced_checks():
    err, out = checkify.checkify(f)(rows)
  assert err.get() is None
  np.testing.assert_array_equal(out, fs.reference.sample(H, W, KEY, temperature=rows))


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("t, shown", [
    (_LARGEST_SUBNORMAL, r"1.17549\d*e-38"), (1e-45, r"1e-45"),
    (1e-50, r"1e-50"),                       # not 0, but a float32 0
    (2.0**126, r"8.50705\d*e\+37"), (1e300, r"1e\+300"), (float("inf"), "inf")])
def test_temperatures_just_outside_are_refused(sampler, t, shown):
  with pytest.raises(ValueError, match=rf"temperature={shown} {_RANGE}.*: the kernels "
                                       r"multiply by its reciprocal"):
    sampler(H, W, KEY, temperature=t)
  # Per row: the float32 value is shown (1e-45 is 1.4e-45 in float32).
  with pytest.raises(ValueError, match=rf"temperature\[2\]=\S+ {_RANGE}.*1 of 4 invalid"):
    sampler(H, W, KEY, temperature=np.array([1.0, 0.0, t, 1.0], np.float64))


@pytest.mark.parametrize("t", [_LARGEST_SUBNORMAL, 1e-45, 2.0**126, float("inf"),
                               -1.0, float("nan")])
def test_traced_temperatures_outside_fail_a_checkify_check(t):
  f = jax.jit(lambda t: fs.sample(H, W, KEY, temperature=t, backend="xla"))
  with fs.traced_checks():
    f(jnp.float32(t))                      # unchecked: a no-op, as before
    err, _ = checkify.checkify(f)(jnp.float32(t))
  assert err.get() is not None and re.search(rf"temperature=\S+ {_RANGE}", err.get())
  rows = jnp.array([1.0, 0.0, 1.0, t], jnp.float32)
  with fs.traced_checks():
    err, _ = checkify.checkify(f)(rows)
  assert err.get() is not None and re.search(rf"temperature\[3\]=\S+ {_RANGE}", err.get())


# The repetition penalty divides like the temperature (x / r is x times XLA's
# 1 / r): the same range, eager and traced; and ranges read as text, not as
# "(0.0, 3.4028234663852886e+38]". Its checks live in controls.py.
_HISTORY = jnp.zeros((4, 2), jnp.int32)


@pytest.mark.parametrize("r", [0.0, -1.0, _LARGEST_SUBNORMAL, 1e-45, 2.0**126,
                               float("inf")])
def test_repetition_penalty_outside_the_normal_range_is_refused(r):
  normal = r"must be a normal float32 in \[2\*\*-126, 2\*\*126\)"
  with pytest.raises(ValueError, match=rf"repetition_penalty=\S+ {normal}") as e:
    fs.sample(H, W, KEY, repetition_penalty=r, prompt_ids=_HISTORY)
  assert "3.4028" not in str(e.value)
  f = jax.jit(lambda r: fs.sample(H, W, KEY, repetition_penalty=r, prompt_ids=_HISTORY,
                                  backend="xla"))
  with fs.traced_checks():
    err, _ = checkify.checkify(f)(jnp.float32(r))
  assert err.get() is not None and re.search(rf"repetition_penalty=\S+ {normal}", err.get())


def test_penalty_ranges_read_as_text():
  with pytest.raises(ValueError, match=r"presence_penalty=inf must be finite") as e:
    fs.sample(H, W, KEY, presence_penalty=float("inf"), output_ids=_HISTORY)
  assert "3.4028" not in str(e.value)
