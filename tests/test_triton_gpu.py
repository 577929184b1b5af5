"""The ``triton`` backend on a CUDA GPU (every test marked ``gpu``).

Run on the GPU with ``PYTHONPATH=. python3 -m pytest -m gpu tests/test_triton_gpu.py``
(jax-triton importable); tests/conftest.py skips these without a GPU. The
kernels' own CPU tests (compilation to PTX, Triton's interpreter) are in
tests/test_triton_kernels.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import controls, problem, stage2
from flashsample_jax.backends.triton import TritonBackend
from tests import inputs
from tests.backend_suite import BackendSuite

pytestmark = pytest.mark.gpu


class TestTritonGPU(BackendSuite):
  backend = "triton"
  dtypes = [jnp.bfloat16, jnp.float16]


def _device_random_inputs(b, d, v, seed, logit_std=3.0):
  kh, kw = jax.random.split(jax.random.key(seed))
  h = jax.random.normal(kh, (b, d), jnp.bfloat16)
  w = (jax.random.normal(kw, (v, d), jnp.float32) * (logit_std / np.sqrt(d))
       ).astype(jnp.bfloat16)
  return h, w


@pytest.mark.parametrize("b", [1, 16, 100, 300])
def test_exact_scores_non_power_of_two_temperatures(b):
  # XLA's division and log in the kernel: the winning scores, not only the
  # tokens, equal the xla backend's on the same GPU for any temperature.
  d, v = 512, 5003
  h, w = inputs.exact_inputs(b, d, v, seed=b)
  t = jnp.asarray(np.r_[0.0, np.linspace(0.3, 3.0, b - 1)] if b > 1 else [0.7],
                  jnp.float32)
  for key in (jax.random.key(b), inputs.row_keys(b, seed=b)):
    p = problem.prepare(h, w, key, temperature=t, vocab_size=4990)
    # The problem is an argument of both programs: a temperature that is a
    # constant of the program has its reciprocal folded at compile time.
    got = jax.jit(lambda p: TritonBackend().candidates(p))(p)
    want = jax.jit(lambda p: fs.backends.get("xla").candidates(p))(p)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.parametrize("d,v", [(4096, 151936), (8192, 128256)])
def test_benchmark_shapes_random(d, v):
  agree = total = 0
  _, w = _device_random_inputs(1, d, v, seed=d)
  for b in (1, 64, 256):
    h, _ = _device_random_inputs(b, d, 64, seed=b)
    t = jnp.asarray(np.random.default_rng(b).uniform(0.5, 1.5, b), jnp.float32)
    for key in (jax.random.key(b), inputs.row_keys(b, seed=b)):
      got = np.asarray(fs.sample(h, w, key, temperature=t, backend="triton"))
      want = np.asarray(fs.reference.sample(h, w, key, temperature=t))
      agree += int((got == want).sum())
      total += got.size
  assert agree / total >= 0.999, f"{agree}/{total} rows agree"


def test_controls_benchmark_shape_random():
  d, v, b = 4096, 151936, 100
  h, w = _device_random_inputs(b, d, v, seed=5)
  key = jax.random.key(5)
  r = np.random.default_rng(5)
  bias = jnp.asarray(r.normal(size=v), jnp.float32)
  mask = jnp.asarray(r.integers(0, 2**32, (b, -(-v // 32)), dtype=np.uint32)
                     | r.integers(0, 2**32, (b, -(-v // 32)), dtype=np.uint32))
  t = jnp.asarray(r.uniform(0.5, 1.5, b), jnp.float32).at[::9].set(0.0)
  cases = [dict(top_k=50, top_p=0.9), dict(min_p=0.05), dict(top_p=0.95),
           dict(logit_bias=bias, allowed_mask=mask), dict(softcap=30.0),
           dict(top_k=20, softcap=30.0, logit_bias=bias, allowed_mask=mask)]
  agree = total = 0
  for kw in cases:
    got = fs.sample(h, w, key, temperature=t, backend="triton",
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


def test_controls_are_certified_on_llm_like_rows():
  d, v, b = 4096, 151936, 64
  h, w = _device_random_inputs(b, d, v, seed=6)
  p = problem.prepare(h, w, jax.random.key(6), temperature=1.0)
  c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, top_k=50, top_p=0.9)
  st = TritonBackend().controls_state(p, c)
  _, _, fallback = stage2.finish(p, c, st)
  assert int(np.asarray(fallback).sum()) == 0
