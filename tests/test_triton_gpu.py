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
from tests import cases, inputs
from tests.backend_suite import BackendSuite, GpuSuite

pytestmark = pytest.mark.gpu


class TestTritonGPU(BackendSuite, GpuSuite):
  backend = "triton"
  dtypes = [jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("b", [1, 16, 100, 300])
def test_exact_scores_non_power_of_two_temperatures(b):
  # XLA's division and log in the kernel: the winning scores, not only the
  # tokens, equal the xla backend's on the same GPU for any temperature.
  # Integers in [-1, 1] at D = 128: logits of magnitude ~30, where f32's
  # rounding of the raw log-sum-exp (the largest value) stays below 1e-5
  # (at D = 512 with [-3, 3] it reached 256, one ulp 1.5e-5).
  d, v = 128, 5003
  h, w = inputs.exact_inputs(b, d, v, seed=b, scale=1)
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


@pytest.mark.parametrize("b", [64, 100])
def test_rl_outputs_equal_reference(b):
  cases.check_rl_on_exact_inputs("triton", b)


def test_float_outputs_are_batch_invariant():
  # The invariant config family (docs/design.md, "Determinism and RL"): a
  # row's tokens and float bits in calls of 1 to 200 rows as in one of 260.
  cases.check_batch_invariance("triton")


def test_kept_log_probabilities_are_batch_invariant_on_a_qwen3_head():
  # Qwen3-1.7B's head with its top-k 20 + top-p 0.95: the kept set's
  # log-sum-exp and entropy over the candidates are summed in a fixed
  # order (stage2.fixed_logsumexp); with jnp.sum, XLA's reduction on a
  # GPU followed the batch's shape and 1-2 rows in 100 lost bits of
  # logprob_truncated (docs/performance.md, "RL outputs and batch
  # invariance").
  cases.check_batch_invariance("triton", batches=(64, 100), full=512, dim=2048,
                               vocab=151936, modes=("qwen3_topk_topp",))


@pytest.mark.parametrize("b", [48, 100])
def test_score_tokens_is_bit_for_bit_what_sample_returned(b):
  # tests/test_rl.py's test on the triton backend: random bf16 inputs, so
  # that any other summation order would show in the bits; B = 100 runs the
  # 16-warp configs of sm90.
  h, w = inputs.random_inputs(b, 1024, 8191, seed=3, logit_std=3.0)
  t = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, b), jnp.float32).at[:4].set(0)
  keys = inputs.row_keys(b, seed=1)
  hist = jnp.asarray(np.random.default_rng(1).integers(0, 8191, (b, 16)), jnp.int32)
  differ = []
  for i, kw in enumerate((dict(), dict(top_k=50, top_p=0.9),
                          dict(min_p=0.05, softcap=20.0),
                          dict(top_p=0.95, repetition_penalty=1.2, output_ids=hist))):
    out = fs.sample(h, w, keys, temperature=t, backend="triton", return_logprobs=True,
                    return_entropy=True, return_raw_logprobs=True, **kw)
    sc = fs.score_tokens(h, w, out.tokens, temperature=t, backend="triton", **kw)
    assert np.all(np.asarray(sc.in_kept))
    # Every case and field is compared before failing, so that one run
    # shows which outputs lose their bits.
    for name in ("logprob", "logprob_truncated", "logprob_raw", "entropy",
                 "entropy_truncated"):
      a = np.asarray(getattr(out, name)).view(np.uint32)
      c = np.asarray(getattr(sc, name)).view(np.uint32)
      if np.any(a != c):
        differ.append(f"case {i} {name}: {int(np.sum(a != c))}/{b} rows, "
                      f"at most {int(np.max(np.abs(a.astype(np.int64) - c)))} ulp")
  assert not differ, "; ".join(differ)
