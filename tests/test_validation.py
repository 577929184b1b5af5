"""Bad input gets a TypeError/ValueError naming the argument and its value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    (dict(weight_layout="kv"), ValueError, r"weight_layout='kv'"),
    (dict(vocab_size=0), ValueError, r"vocab_size=0 must be in \[1, 100\]"),
    (dict(vocab_size=101), ValueError, r"vocab_size=101"),
    (dict(vocab_size=50.0), TypeError, r"vocab_size=50.0"),
    (dict(vocab_size=True), TypeError, r"vocab_size=True"),
    (dict(temperature=-1.0), ValueError, r"temperature=-1.0 must be >= 0"),
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
