"""The public API: backend selection and the every-backend contract."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from tests import inputs
from tests.conftest import is_sm90


def test_backend_names_are_one_literal():
  from typing import get_args
  assert fs.BACKENDS == get_args(fs.Backend)
  assert "xla" in fs.BACKENDS and "mosaic" in fs.BACKENDS
  # Every name resolves to an adapter of that name.
  for name in fs.BACKENDS:
    assert fs.backends.get(name).name == name


def test_api_names_no_backend():
  # The registry is the only place that knows the backends: the API module
  # dispatches through it.
  import inspect
  from flashsample_jax import api
  src = inspect.getsource(api)
  for name in fs.BACKENDS:
    assert f'"{name}"' not in src and f"'{name}'" not in src, name


def test_static_argnames_make_sample_jittable():
  h, w = inputs.exact_inputs(5, 64, 300)
  key = jax.random.key(1)
  f = jax.jit(fs.sample, static_argnames=fs.STATIC_ARGNAMES)
  np.testing.assert_array_equal(
      f(h, w, key, temperature=0.5, backend="xla", num_samples=2),
      fs.reference.sample(h, w, key, temperature=0.5, num_samples=2))


def test_validation_runs_once_per_call(monkeypatch):
  from flashsample_jax import problem
  calls = []
  real = problem.prepare
  monkeypatch.setattr(problem, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
  h, w = inputs.exact_inputs(5, 64, 300)
  jax.clear_caches()
  fs.sample(h, w, jax.random.key(0), temperature=0.5, backend="xla", top_k=3)
  assert len(calls) == 1


@pytest.mark.parametrize("backend", ("auto", *fs.BACKENDS))
def test_every_backend_equals_reference_or_declines(backend):
  # On this device each backend either returns the reference's tokens or
  # raises NotImplementedError (and then "auto" must not pick it).
  h, w = inputs.exact_inputs(5, 64, 300)
  key = jax.random.key(1)
  want = fs.reference.sample(h, w, key, temperature=0.5)
  try:
    got = fs.sample(h, w, key, temperature=0.5, backend=backend)
  except NotImplementedError:
    assert backend != "auto"
    assert fs.which_backend(h, w, key) != backend
    return
  np.testing.assert_array_equal(got, want)


def test_auto_picks_mosaic_only_on_hopper():
  h, w = inputs.exact_inputs(5, 64, 300)
  assert fs.which_backend(h, w, jax.random.key(0)) == ("mosaic" if is_sm90() else "xla")


def test_d_not_multiple_of_64_is_not_mosaic():
  # The Hopper kernel needs D % 64 == 0: auto moves on (to the Triton kernel
  # on a CUDA GPU with jax-triton, else to the streaming backend).
  h, w = inputs.exact_inputs(5, 40, 300)
  assert fs.which_backend(h, w, jax.random.key(0)) in ("triton", "xla")
  np.testing.assert_array_equal(fs.sample(h, w, jax.random.key(0)),
                                fs.reference.sample(h, w, jax.random.key(0)))


def test_traced_static_option_says_how_to_make_it_static():
  # Issue #42, defect 8: jax.jit(fs.sample) traces every keyword; the error
  # must point to fs.STATIC_ARGNAMES, not only say what type it wants.
  h, w = inputs.exact_inputs(5, 64, 300)
  with pytest.raises(TypeError, match=r"vocab_size=.*must be a Python int or None, "
                                      r"static under jax.jit, but is traced: .*"
                                      r"static_argnames=fs.STATIC_ARGNAMES"):
    jax.jit(fs.sample)(h, w, jax.random.key(0), vocab_size=200)


def test_traced_option_of_sample_logits_gets_a_hint_that_works():
  # Found by review: the hint named fs.STATIC_ARGNAMES, which holds options
  # sample_logits does not take (jax.jit refused them as argnames).
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)), jnp.float32)
  key = jax.random.key(0)
  with pytest.raises(TypeError, match=r"return_kept=.*is traced: .*"
                                      r"static_argnames=\('return_kept',\)"):
    jax.jit(fs.sample_logits)(logits, key, return_kept=2)
  got = jax.jit(fs.sample_logits, static_argnames=("return_kept",))(logits, key, return_kept=2)
  np.testing.assert_array_equal(got.kept_ids, fs.sample_logits(logits, key, return_kept=2).kept_ids)


@pytest.mark.parametrize("option", [dict(return_logprobs=True), dict(num_samples=2),
                                    dict(top_logprobs=3)])
def test_traced_control_option_says_how_to_make_it_static(option):
  h, w = inputs.exact_inputs(5, 64, 300)
  (name,) = option
  with pytest.raises(TypeError, match=rf"{name}=.*static under jax.jit, but is traced: "
                                      r".*static_argnames=fs.STATIC_ARGNAMES"):
    jax.jit(fs.sample)(h, w, jax.random.key(0), **option)
