"""Property-based tests: ``fs.sample`` against ``fs.reference.sample`` on random problems.

Hypothesis draws the problem: shapes (B 1..9, D 1..70, V 1..300, padded
weight rows with ``vocab_size``), dtypes (bf16/f16/f32, hidden and weight
independently), layouts, key kinds (scalar or per-row, typed or raw uint32),
temperatures (scalars and ``[B]`` arrays, zeros and non-powers of two), every
sampling control, ``num_samples`` and ``return_logprobs``, and whether the
call is jitted whole (with the documented static options) or not.

Inputs are exact (small integers, tests/inputs.py): every logit is an exact
integer in f32 whatever the summation order. On the CPU the backend and the
reference divide by the temperature and apply the soft-cap with the same XLA
ops, so the tempered logits are bit-identical even for non-power-of-two
temperatures, and the tokens must match on 100% of rows. Log-probabilities
are sums of exponentials taken in different orders; they are compared with
the tolerance of tests/test_controls.py.

The example budget is fixed and the generation derandomized, so a run is
reproducible and its time bounded: each example compiles the sampler and the
reference for new shapes, and compilation is what the budget pays for.
"""

from __future__ import annotations

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings, strategies as st

import flashsample_jax as fs

# The options that must be static when fs.sample itself is jitted (README,
# "API"; tests/test_readme.py checks the README's list).
STATIC_ARGNAMES = ("weight_layout", "vocab_size", "backend", "vocab_axis",
                   "batch_axis", "num_samples", "return_logprobs", "top_logprobs")

# Backends checked here, by name. The kernels are not drawn here: in CPU
# interpret mode each example would compile a kernel (seconds each), and
# they decline much of what hypothesis draws (D not a multiple of 64, f32
# weights). They run the shared BackendSuite instead (tests/backend_suite.py:
# interpret mode on the CPU, natively on the GPU), whose cases cover the
# same controls.
PROPERTY_BACKENDS = ("xla",)


def backend_context(name: str):
  """The context a backend's calls run in here (interpret mode, for kernels)."""
  del name
  return contextlib.nullcontext()


def test_property_backends_are_real_backends():
  assert set(PROPERTY_BACKENDS) <= set(fs.BACKENDS)


PROPERTY_SETTINGS = dict(
    deadline=None,                # each example compiles; times vary with load
    derandomize=True,             # the same examples on every run and machine
    database=None,                # nothing written into the checkout
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True)

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Zeros (greedy rows), powers of two and the non-powers of two people use.
_TEMPERATURES = (0.0, 0.25, 0.5, 1.0, 2.0, 0.3, 0.6, 0.7, 0.95, 1.3, 3.7)


def _choice(rng, options):
  return options[int(rng.integers(len(options)))]


@st.composite
def problems(draw, *, max_b=9, max_d=70, max_v=300):
  """An exact sampling problem: the arguments of ``fs.sample`` but the options.

  Hypothesis draws the sizes (so B, D or V = 1 and other edges come up) and
  a seed; the categorical choices (layout, dtypes, key kind, temperatures)
  come from that seed. Drawn one by one by hypothesis, they were skewed to
  the first option in a budget of a few dozen examples (per-row typed keys
  came up once in 40).
  """
  b = draw(st.integers(1, max_b))
  d = draw(st.integers(1, max_d))
  v = draw(st.integers(1, max_v))
  seed = draw(st.integers(0, 2**32 - 1))
  r = np.random.default_rng(seed)
  pad = _choice(r, (0, 1, 7, 32, 40))
  layout = _choice(r, ("vd", "dv"))
  w_dtype, h_dtype = _choice(r, _DTYPES), _choice(r, _DTYPES)
  # Small scales make ties and near-uniform rows common: the hard cases.
  scale = int(r.integers(1, 4))
  hidden = jnp.asarray(r.integers(-scale, scale + 1, (b, d)), h_dtype)
  weight = r.integers(-scale, scale + 1, (v + pad, d))
  weight = jnp.asarray(weight if layout == "vd" else np.ascontiguousarray(weight.T), w_dtype)

  key_kind = _choice(r, ("typed", "typed_rows", "raw", "raw_rows"))
  key = jax.random.key(seed)
  if key_kind.endswith("rows"):
    key = jax.random.split(key, b)
  if key_kind.startswith("raw"):
    key = jax.random.key_data(key)  # uint32 [2] or [B, 2]

  if r.random() < 0.5:
    temperature = _choice(r, _TEMPERATURES)
  else:
    temperature = jnp.asarray(r.choice(_TEMPERATURES, b), jnp.float32)
  vocab_size = v if pad or r.random() < 0.5 else None
  note(f"B={b} D={d} V={v} rows={v + pad} vocab_size={vocab_size} {layout=} "
       f"hidden {jnp.dtype(h_dtype).name}, weight {jnp.dtype(w_dtype).name}, "
       f"key {key_kind}, {temperature=}")
  return dict(hidden=hidden, weight=weight, key=key, temperature=temperature,
              weight_layout=layout, vocab_size=vocab_size)


def _scalar_or_rows(draw, r, b, values, dtype):
  if r.random() < 0.5:
    return draw(values)
  return jnp.asarray(draw(st.lists(values, min_size=b, max_size=b)), dtype)


@st.composite
def controls(draw, b: int, vocab_size: int, rows: int):
  """Any subset of the sampling controls, valid for a ``[b, vocab_size]`` problem.

  The seed decides which controls are on (each half of the time, for the
  reason given in :func:`problems`); hypothesis draws their values, edges
  (top_k 0, top_p 1, min_p 0 or 1) included.
  """
  r = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  kw = {}
  if r.random() < 0.5:
    kw["top_k"] = _scalar_or_rows(draw, r, b, st.integers(0, vocab_size + 2), jnp.int32)
  if r.random() < 0.5:
    kw["top_p"] = _scalar_or_rows(
        draw, r, b, st.floats(0.0, 1.0, exclude_min=True, width=32), jnp.float32)
  if r.random() < 0.5:
    kw["min_p"] = _scalar_or_rows(draw, r, b, st.floats(0.0, 1.0, width=32), jnp.float32)
  if r.random() < 0.5:
    # Integer biases keep the logits exact; either documented length.
    n = _choice(r, (vocab_size, rows))
    kw["logit_bias"] = jnp.asarray(r.integers(-4, 5, n), jnp.float32)
  if r.random() < 0.5:
    words = -(-vocab_size // 32)
    density = _choice(r, (0.0, 0.05, 0.5, 1.0))  # 0: rows that allow nothing
    bits = r.random((b, words, 32)) < density
    # Bit j of word w allows id 32 w + j.
    mask = (bits * (np.uint64(1) << np.arange(32, dtype=np.uint64))).sum(-1).astype(np.uint32)
    kw["allowed_mask"] = jax.lax.bitcast_convert_type(
        jnp.asarray(mask), _choice(r, (jnp.uint32, jnp.int32)))
  if r.random() < 0.5:
    kw["softcap"] = _choice(r, (0.5, 3.0, 7.3, 30.0))
  if r.random() < 0.5:
    # Exact penalties (powers of two, quarters); histories with repeats,
    # padding and rows without any.
    kw["repetition_penalty"] = _scalar_or_rows(
        draw, r, b, st.sampled_from([0.25, 0.5, 1.0, 2.0]), jnp.float32)
    kw["presence_penalty"] = _choice(r, (0.0, 0.5, -1.0))
    kw["frequency_penalty"] = _scalar_or_rows(
        draw, r, b, st.sampled_from([0.0, 0.25, 2.0]), jnp.float32)
    for name in ("prompt_ids", "output_ids"):
      if r.random() < 0.7:
        n = int(r.integers(0, 12))
        kw[name] = jnp.asarray(r.integers(-1, min(vocab_size, 40), (b, n)), jnp.int32)
  if r.random() < 0.5:
    kw["num_samples"] = int(r.integers(1, 5))
  kw["return_logprobs"] = bool(r.random() < 0.5)
  if r.random() < 0.3:
    kw["top_logprobs"] = int(r.integers(1, min(vocab_size, 128) + 1))
  note(f"controls: { {k: getattr(x, 'shape', x) for k, x in kw.items()} }")
  return kw


def _call(backend: str, jit: bool, args: dict, options: dict):
  f = jax.jit(fs.sample, static_argnames=STATIC_ARGNAMES) if jit else fs.sample
  with backend_context(backend):
    return f(**args, **options, backend=backend)


def _assert_matches_reference(got, want):
  if isinstance(want, fs.SampleOutput):
    assert isinstance(got, fs.SampleOutput)
    chex.assert_trees_all_equal(got.tokens, want.tokens)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
  else:
    chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("backend", PROPERTY_BACKENDS)
@settings(max_examples=20, **PROPERTY_SETTINGS)
@given(problem=problems(), jit=st.booleans())
def test_sample_matches_reference(backend, problem, jit):
  got = _call(backend, jit, problem, {})
  want = fs.reference.sample(**problem)
  _assert_matches_reference(got, want)
  assert got.dtype == jnp.int32 and got.shape == (problem["hidden"].shape[0],)
  rows = problem["weight"].shape[0 if problem["weight_layout"] == "vd" else 1]
  vocab = problem["vocab_size"] or rows
  assert ((np.asarray(got) >= 0) & (np.asarray(got) < vocab)).all()


@st.composite
def problems_with_controls(draw):
  problem = draw(problems(max_v=200))
  b = problem["hidden"].shape[0]
  rows = problem["weight"].shape[0 if problem["weight_layout"] == "vd" else 1]
  options = draw(controls(b, problem["vocab_size"] or rows, rows))
  return problem, options


@pytest.mark.parametrize("backend", PROPERTY_BACKENDS)
@settings(max_examples=10, **PROPERTY_SETTINGS)
@given(case=problems_with_controls(), jit=st.booleans())
def test_controls_match_reference(backend, case, jit):
  problem, options = case
  got = _call(backend, jit, problem, options)
  want = fs.reference.sample(**problem, **options)
  _assert_matches_reference(got, want)
