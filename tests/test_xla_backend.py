"""The streaming ``xla`` backend against the reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import problem
from flashsample_jax.backends import xla as xla_backend
from pallas_kernels import rules
from tests import inputs
from tests.backend_suite import BackendSuite


class TestXlaBackend(BackendSuite):
  backend = "xla"
  # Per-row keys with a per-row truncation rule of each kind, every control
  # together, vLLM's order, top_logprobs and the penalties (CI time: the
  # key kind is independent of the rule; the scalar key runs every case).
  row_key_cases = frozenset({"top_k", "top_p", "min_p", "p_minp_vllm", "all",
                             "top_logprobs_truncated", "penalties_all"})
  # Several samples with logprobs: every truncation rule together ("all").
  covered_sample_cases = {"top_k": "all", "top_p": "all"}
  # Scores of the tokens sample drew, bit for bit, on one case (CI time;
  # the GPU suites run every score case).
  score_cases = ("k_p_minp",)


@pytest.mark.parametrize("chunk", [128, 384, 1000, 4096])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("unroll", [False, True])
def test_chunk_size_does_not_change_tokens(chunk, per_row, unroll, monkeypatch):
  # unroll: static slices ordered by barriers (the GPU walk), else fori_loop.
  monkeypatch.setattr(xla_backend, "MAX_UNROLLED", {jax.default_backend(): 32} if unroll else {})
  # V = 2999 is a multiple of no chunk: exercises the static tail chunk.
  b, d, v = 11, 64, 2999
  h, w = inputs.exact_inputs(b, d, v, seed=1)
  key = inputs.row_keys(b) if per_row else jax.random.key(5)
  t = inputs.pow2_temperatures(b, greedy_every=5)
  p = problem.prepare(h, w, key, temperature=t, vocab_size=2990)
  _, tok = xla_backend.candidates(p, chunk=chunk)
  want = fs.reference.sample(h, w, key, temperature=t, vocab_size=2990)
  np.testing.assert_array_equal(tok, want)


def test_vocab_offset_scores_equal_unsharded():
  # Two halves of the vocabulary with global offsets combine to the whole.
  b, d, v = 7, 64, 1200
  h, w = inputs.exact_inputs(b, d, v, seed=2)
  key = jax.random.key(9)
  # Jitted as the samplers run it; the offsets concrete, as before.
  cand = jax.jit(lambda p, offset: xla_backend.candidates(p, vocab_offset=offset),
                 static_argnums=1)
  whole = cand(problem.prepare(h, w, key, vocab_size=1100), 0)
  parts = []
  for lo, hi in ((0, 600), (600, 1200)):
    p = problem.prepare(h, w[lo:hi], key, vocab_size=None)
    # Counters use the logical vocabulary of the whole head.
    p = dataclasses.replace(p, vocab_size=1100, ctr_hi=whole_ctr(b, 1100)[0],
                            ctr_lo=whole_ctr(b, 1100)[1])
    parts.append(cand(p, lo))
  got = rules.combine(*parts)
  np.testing.assert_array_equal(got[1], whole[1])
  np.testing.assert_array_equal(got[0], whole[0])


def whole_ctr(b, vocab):
  from flashsample_jax import noise
  return noise.mul_u32_wide(jnp.arange(b, dtype=jnp.uint32), np.uint32(vocab))


def _temp_bytes(f, b, d, v):
  h = jax.ShapeDtypeStruct((b, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((v, d), jnp.bfloat16)
  return jax.jit(f).lower(h, w).compile().memory_analysis().temp_size_in_bytes


def test_never_materializes_logits():
  b, d = 16, 64
  xla = lambda h, w: fs.sample(h, w, jax.random.key(0), backend="xla")
  ref = lambda h, w: fs.reference.sample(h, w, jax.random.key(0))
  for v in (1 << 22, 1 << 23):
    full = b * v * 4
    # The reference holds at least the [B, V] f32 logits.
    assert _temp_bytes(ref, b, d, v) >= full
    # The streaming backend's temporaries are a few [B, chunk] blocks,
    # independent of V.
    chunk_bytes = b * xla_backend.chunk_size(b, v) * 4
    assert _temp_bytes(xla, b, d, v) <= 5 * chunk_bytes < full // 3


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU compiler")
@pytest.mark.parametrize("kw", [dict(min_p=0.05), dict(top_k=50, top_p=0.9)])
@pytest.mark.parametrize("v", [4096, 65536])   # one chunk; a loop of chunks
def test_truncation_keeps_xla_cpu_topk_call(kw, v):
  # The candidates' top_k must stay XLA CPU's TopK call, not a sort of each
  # [B, chunk] block: reading single entries of its values folded them into
  # the sort and kept the whole sort (2.6 -> 0.7 ms at B=4, V=4096; 29 ->
  # 10 ms at V=65536; stage2.finish).
  h = jax.ShapeDtypeStruct((4, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((v, 256), jnp.bfloat16)
  f = lambda h, w: fs.sample(h, w, jax.random.key(0), backend="xla", **kw)
  hlo = jax.jit(f).lower(h, w).compile().as_text()
  assert 'custom_call_target="TopK"' in hlo
  # (The exact fallback's sort of the materialized rows is another sort.)
  assert not [ln for ln in hlo.splitlines() if " sort(" in ln and "/top_k" in ln]


def test_nan_and_inf_match_reference():
  b, d, v = 6, 64, 900
  h, w = inputs.exact_inputs(b, d, v, dtype=jnp.float32, seed=3)
  h = h.at[0, 0].set(jnp.nan)              # row 0: every logit NaN
  w = w.at[417, :].set(jnp.inf)            # id 417: +-inf or NaN per row
  w = w.at[700, 3].set(jnp.nan)            # id 700: NaN in every row
  for t in (1.0, 0.0):
    for key in (jax.random.key(0), inputs.row_keys(b)):
      got = fs.sample(h, w, key, temperature=t, backend="xla")
      want = fs.reference.sample(h, w, key, temperature=t)
      np.testing.assert_array_equal(got, want)


def test_all_minus_inf_row_returns_id_0():
  h, w = inputs.exact_inputs(3, 64, 500, dtype=jnp.float32, seed=4)
  w = jnp.full_like(w, -jnp.inf).at[:, 0].set(1.0)
  h = jnp.ones_like(h)
  got = fs.sample(h, w, jax.random.key(0), backend="xla")
  want = fs.reference.sample(h, w, jax.random.key(0))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, 0)


@pytest.mark.parametrize("kw", [{}, dict(top_k=20, top_p=0.9, return_logprobs=True),
                                dict(num_samples=3, min_p=0.05)])
def test_dense_route_equals_reference(kw):
  # The dense route is the streaming backend with one chunk (whose chunk
  # sizes test_chunk_size_does_not_change_tokens covers, a chunk above V
  # included): the same tokens, plain and with controls.
  h, w = inputs.exact_inputs(9, 64, 3001, scale=1, seed=7)
  t = inputs.pow2_temperatures(9, greedy_every=4, seed=7) * 4
  for key in (jax.random.key(7), inputs.row_keys(9, seed=7)):
    got = fs.sample(h, w, key, temperature=t, backend="dense", **kw)
    want = fs.reference.sample(h, w, key, temperature=t, **kw)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
  # One chunk of the streaming backend is this program: auto keeps its name.
  assert fs.which_backend(h, w, jax.random.key(7)) != "dense"


def _auto_pick(b, v, d=1024, **kw):
  # which_backend on shapes alone: no [B, D] or [V, D] array is made.
  picked = []

  def probe(h, w):
    picked.append(fs.which_backend(h, w, jax.random.key(0), **kw))
    return h

  jax.eval_shape(probe, jax.ShapeDtypeStruct((b, d), jnp.bfloat16),
                 jax.ShapeDtypeStruct((v, d), jnp.bfloat16))
  return picked[0]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="auto's route on a CPU")
@pytest.mark.parametrize("kw", [{}, dict(temperature=0.6, top_k=20, top_p=0.95)])
def test_auto_on_cpu_takes_dense_up_to_its_bound(kw):
  # The demo's head (Qwen3-0.6B, V = 151936): dense where it measured faster
  # than streaming (benchmarks/experiments/exp_cpu_route.py), up to
  # DENSE_CPU_MAX_LOGIT_BYTES of [rows, V] f32 logits; the streaming backend
  # within one chunk (the same program) and above the bound.
  v = 151936
  b_max = xla_backend.DENSE_CPU_MAX_LOGIT_BYTES // (4 * v)
  assert b_max == 55
  assert _auto_pick(4, v, **kw) == "xla"     # one chunk: 4 x V < 2**20
  assert _auto_pick(8, v, **kw) == "dense"   # small: the demo's B
  assert _auto_pick(b_max, v, **kw) == "dense"
  assert _auto_pick(b_max + 1, v, **kw) == "xla"
  assert _auto_pick(4096, v, **kw) == "xla"  # huge: 2.5 GB of logits
  # Several samples are rows of the pass: 16 rows x 4 samples is over the bound.
  assert _auto_pick(4, v, num_samples=4, **kw) == "dense"
  assert _auto_pick(16, v, num_samples=4, **kw) == "xla"
