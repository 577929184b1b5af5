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
from flashsample_jax import problem
from flashsample_jax.backends.triton import TritonBackend
from tests import inputs
from tests.backend_suite import BackendSuite, GpuSuite

pytestmark = pytest.mark.gpu


class TestTritonGPU(BackendSuite, GpuSuite):
  backend = "triton"
  dtypes = [jnp.bfloat16, jnp.float16]


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


@pytest.mark.parametrize("b", [1, 64])
def test_quantized_scores_equal_xla_backend(b):
  # 8-bit heads with scales and temperatures that are not powers of two: the
  # kernel's scaled logits are one f32 multiply of the exact product, as
  # the xla backend's, so the winning scores are equal bit for bit.
  d, v = 512, 5003
  r = np.random.default_rng(b)
  t = jnp.asarray(np.r_[0.0, np.linspace(0.3, 3.0, b - 1)] if b > 1 else [0.7],
                  jnp.float32)
  for i, dt in enumerate(inputs.QUANTIZED_DTYPES):
    layout = ("vd", "dv")[(i + b) % 2]
    h, w, _ = inputs.quantized_inputs(b, d, v, dtype=dt, layout=layout, seed=b + i)
    s = (jnp.asarray(r.uniform(0.01, 0.2, v), jnp.float32) if i % 2 == 0
         else jnp.float32(r.uniform(0.01, 0.2)))
    key = jax.random.key(b) if i % 2 else inputs.row_keys(b, seed=i)
    p = problem.prepare(h, w, key, temperature=t, vocab_size=4990,
                        weight_layout=layout, weight_scale=s)
    got = jax.jit(lambda p: TritonBackend().candidates(p))(p)
    want = jax.jit(lambda p: fs.backends.get("xla").candidates(p))(p)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
