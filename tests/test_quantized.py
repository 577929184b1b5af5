"""Quantized LM heads (``weight_scale``): the meaning, the checks, the mesh.

The backends are held to ``fs.reference.sample`` by the shared suite
(tests/backend_suite.py, ``test_quantized_heads*``); here the reference
itself is held to ``jax.random.categorical`` on logits written out by hand
(``f32(h @ W.astype(bf16).T) * scale``), and the API's checks, f16 hidden
states, speculative verification and vocabulary sharding are covered.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import flashsample_jax as fs
from flashsample_jax import api, problem
from tests import inputs
from tests.conftest import has_gpu

DTYPES = inputs.QUANTIZED_DTYPES


def hand_logits(h, w, scale, layout="vd", compute=jnp.bfloat16):
  """The issue's definition, written out: f32 product of the converted
  operands, times the scale."""
  wv = w if layout == "vd" else w.T
  l = jnp.dot(h.astype(compute), wv.astype(compute).T, preferred_element_type=jnp.float32)
  return l * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
def test_reference_is_categorical_on_the_scaled_logits(dtype, per_row):
  b, d, v = 7, 64, 500
  for layout in ("vd", "dv"):
    h, w, s = inputs.quantized_inputs(b, d, v, dtype=dtype, layout=layout,
                                      per_row=per_row, seed=3)
    l = hand_logits(h, w, s, layout)
    key = jax.random.key(11)
    want = jax.random.categorical(key, l / 0.5)
    got = fs.reference.sample(h, w, key, temperature=0.5, weight_layout=layout,
                              weight_scale=s)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        fs.sample(h, w, key, temperature=0.5, weight_layout=layout, weight_scale=s),
        want)


def test_scale_changes_the_distribution():
  # A per-row scale that is not uniform must matter: rows scaled by 0 can
  # only win where every logit is 0, and the greedy token follows the scale.
  h, w, _ = inputs.quantized_inputs(5, 64, 300, seed=4)
  l = hand_logits(h, w, 1.0)
  top = np.asarray(jnp.argmax(l, axis=1))
  s = np.ones(300, np.float32)
  s[top] = 0.0
  s = jnp.asarray(s)
  tok = np.asarray(fs.sample(h, w, jax.random.key(0), temperature=0.0, weight_scale=s))
  np.testing.assert_array_equal(tok, np.asarray(jnp.argmax(hand_logits(h, w, s), axis=1)))
  assert not np.array_equal(tok, top)


def test_f16_hidden_multiplies_in_f16_and_f32_hidden_in_bf16():
  # 1 + 2**-9 is exact in f16 but rounds to 1 in bf16: the product's dtype
  # shows in the logits.
  d, v = 64, 128
  h = np.zeros((2, d), np.float32)
  h[:, 0] = 1 + 2**-9
  w = np.zeros((v, d), np.float32)
  w[:, 0] = np.arange(v) % 3
  w8 = jnp.asarray(w, jnp.int8)
  s = jnp.float32(1.0)
  for hd, compute in ((jnp.float16, jnp.float16), (jnp.float32, jnp.bfloat16),
                      (jnp.bfloat16, jnp.bfloat16)):
    hh = jnp.asarray(h, hd)
    out = fs.sample(hh, w8, jax.random.key(1), weight_scale=s, return_logprobs=True)
    l = hand_logits(hh, w8, s, compute=compute)
    want_lse = jax.nn.logsumexp(l, axis=1)
    np.testing.assert_allclose(out.logsumexp, want_lse, rtol=1e-6)
  lse16 = fs.sample(jnp.asarray(h, jnp.float16), w8, jax.random.key(1), weight_scale=s,
                    return_logprobs=True).logsumexp
  lse_bf = fs.sample(jnp.asarray(h, jnp.bfloat16), w8, jax.random.key(1), weight_scale=s,
                     return_logprobs=True).logsumexp
  assert not np.allclose(lse16, lse_bf, rtol=1e-7, atol=0)


def test_traced_scale_under_jit_and_in_a_scan():
  h, w, s = inputs.quantized_inputs(6, 64, 400, dtype=jnp.float8_e5m2, seed=6)
  f = jax.jit(lambda h, w, k, s: fs.sample(h, w, k, weight_scale=s, top_k=10))
  for scale in (s, jnp.float32(0.5)):
    want = fs.reference.sample(h, w, jax.random.key(2), weight_scale=scale, top_k=10)
    np.testing.assert_array_equal(f(h, w, jax.random.key(2), scale), want)


def test_params_and_which_backend_take_weight_scale():
  h, w, s = inputs.quantized_inputs(4, 64, 256, seed=7)
  params = fs.SamplingParams(temperature=0.7, top_p=0.9)
  want = fs.reference.sample(h, w, jax.random.key(3), weight_scale=s, temperature=0.7,
                             top_p=0.9)
  np.testing.assert_array_equal(
      fs.sample(h, w, jax.random.key(3), params, weight_scale=s), want)
  assert fs.which_backend(h, w, jax.random.key(3), weight_scale=s) in fs.BACKENDS


def test_verify_drafts_with_a_quantized_head():
  b, k, d, v = 3, 3, 64, 300
  r = np.random.default_rng(8)
  h = jnp.asarray(r.integers(-3, 4, (b, k + 1, d)), jnp.bfloat16)
  _, w, s = inputs.quantized_inputs(1, d, v, dtype=jnp.int8, seed=8)
  drafts = jnp.asarray(r.integers(0, v, (b, k)), jnp.int32)
  for method in ("strict", "one_hot"):
    kw = dict(method=method, temperature=0.8, top_k=20, weight_scale=s,
              return_logprobs=True)
    got = fs.verify_drafts(h, w, jax.random.key(4), drafts, **kw)
    want = fs.reference.verify_drafts(h, w, jax.random.key(4), drafts, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=2e-5, atol=2e-5)


# -- bad input: errors that name the argument ---------------------------------


def test_errors_name_weight_scale():
  h, w, s = inputs.quantized_inputs(2, 64, 100, seed=9)
  key = jax.random.key(0)
  with pytest.raises(TypeError, match=r"weight.dtype=float8_e4m3fn is quantized and "
                                      r"needs weight_scale"):
    fs.sample(h, w, key)
  with pytest.raises(TypeError, match=r"weight_scale is for quantized weights"):
    fs.sample(h, w.astype(jnp.bfloat16), key, weight_scale=s)
  with pytest.raises(TypeError, match=r"weight_scale.dtype=bfloat16 must be float32"):
    fs.sample(h, w, key, weight_scale=s.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match=r"weight_scale.shape=\(99,\) must be \(\) "
                                       r"\(per tensor\) or \[V\]=\(100,\)"):
    fs.sample(h, w, key, weight_scale=s[:99])
  with pytest.raises(ValueError, match=r"weight_scale.shape=\(1, 100\)"):
    fs.sample(h, w, key, weight_scale=s[None])
  with pytest.raises(TypeError, match=r"weight_scale must be a float or a float32 array"):
    fs.sample(h, w, key, weight_scale="1.0")
  with pytest.raises(TypeError, match=r"weight.dtype=uint8 must be one of .*int8"):
    fs.sample(h, w.view(jnp.uint8), key, weight_scale=s)
  with pytest.raises(TypeError, match=r"hidden.dtype=float8_e4m3fn"):
    fs.sample(h.astype(jnp.float8_e4m3fn), w, key, weight_scale=s)
  # Values: NaN and infinite scales (also Python numbers beyond float32)
  # are refused, naming the first bad entry; 0 and negative scales are the
  # formula's (logits = f32(dot) * weight_scale) and run.
  for bad, shown in ((float("nan"), r"weight_scale=nan"), (1e300, r"weight_scale=1e\+300"),
                     (10**400, r"weight_scale=1000+"), (float("-inf"), r"weight_scale=-inf"),
                     (s.at[5].set(jnp.inf), r"weight_scale\[5\]=inf")):
    with pytest.raises(ValueError, match=shown + r".* must be a finite float32"):
      fs.sample(h, w, key, weight_scale=bad)
  closed = s.at[2].set(jnp.nan)                 # a constant of the trace: checked too
  with pytest.raises(ValueError, match=r"weight_scale\[2\]=nan must be a finite float32"):
    jax.jit(lambda h: fs.sample(h, w, key, weight_scale=closed))(h)
  host = np.asarray(s).copy()
  host[7] = np.nan
  with pytest.raises(ValueError, match=r"weight_scale\[7\]=nan must be a finite float32"):
    fs.sample(h, w, key, weight_scale=host)
  for ok in (0.0, -s):
    np.testing.assert_array_equal(fs.sample(h, w, key, weight_scale=ok),
                                  fs.reference.sample(h, w, key, weight_scale=ok))
  # A Python number is a per-tensor scale.
  np.testing.assert_array_equal(fs.sample(h, w, key, weight_scale=2),
                                fs.reference.sample(h, w, key, weight_scale=2.0))


# -- vocabulary sharding: the scale is split with the weight ------------------


@pytest.mark.skipif(has_gpu(), reason="needs 8 CPU devices as jax.devices()")
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
def test_sharded_quantized_head_on_1_2_4_8_shards(per_row):
  # Per-row scales are split with the weight at every shard count (plain
  # sampling: the scale's slicing is the same for every route), then with
  # controls on 8; a per-tensor scale is replicated, the same at any count.
  b, d, v = 9, 64, 1024
  h, w, s = inputs.quantized_inputs(b, d, v, dtype=jnp.float8_e4m3fn, per_row=per_row,
                                    seed=10)
  t = inputs.pow2_temperatures(b, greedy_every=4, seed=10)
  key = jax.random.key(5)
  controlled = dict(temperature=t, top_k=30, top_p=0.9)
  runs = [(n, dict(temperature=t)) for n in ((1, 2, 4) if per_row else ())]
  for n, kw in runs + [(8, controlled)]:
    want = np.asarray(fs.reference.sample(h, w, key, weight_scale=s, **kw))
    mesh = jax.make_mesh((n,), ("tp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:n])
    f = jax.shard_map(
        lambda h, w, s, kw=kw: fs.sample(h, w, key, weight_scale=s, vocab_axis="tp",
                                         **kw)[None],
        mesh=mesh, in_specs=(P(), P("tp", None), P("tp") if per_row else P()),
        out_specs=P("tp"), check_vma=False)
    for row in np.asarray(jax.jit(f)(h, w, s)):
      np.testing.assert_array_equal(row, want)
  got = fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis="tp", weight_scale=s, **controlled)
  np.testing.assert_array_equal(got, want)


# -- quantize_weight: per-row absmax ------------------------------------------


@pytest.mark.parametrize("name", ["fp8", "float8_e5m2", "int8"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_quantize_weight_per_row_absmax(name, layout):
  r = np.random.default_rng(12)
  w = r.standard_normal((300, 64)).astype(np.float32) * (r.uniform(0.1, 3, 300)[:, None])
  w[7] = 0.0                                      # a zero row: scale 1, zeros
  wl = w if layout == "vd" else w.T
  w8, s = fs.quantize_weight(jnp.asarray(wl, jnp.bfloat16), name, weight_layout=layout)
  dt, qmax = fs.quantize.QUANT_DTYPES[fs.quantize._dtype_name(name)]
  assert w8.dtype == jnp.dtype(dt) and w8.shape == wl.shape and s.shape == (300,)
  back = np.asarray(w8, np.float32)
  back = back if layout == "vd" else back.T
  wb = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
  amax = np.abs(wb).max(axis=1)
  np.testing.assert_allclose(np.asarray(s), np.where(amax > 0, amax / qmax, 1.0), rtol=1e-6)
  # Every row's largest magnitude maps to qmax; the rest within half a step
  # of the 8-bit grid (relative 2**-4 for e4m3, 2**-3 for e5m2, 0.5/127 int8).
  assert np.all(np.abs(back).max(axis=1)[amax > 0] == qmax)
  assert np.all(back[7] == 0) and s[7] == 1.0
  rel = {"int8": 0.5 / 127, "float8_e5m2": 2**-3, "float8_e4m3fn": 2**-4}[
      fs.quantize._dtype_name(name)]
  err = np.abs(back * np.asarray(s)[:, None] - wb)
  assert np.all(err <= rel * amax[:, None] * (1 + 2**-16))   # XLA may divide by a reciprocal
  # Sampling from it: the quantized head's tokens are the reference's.
  h = jnp.asarray(r.standard_normal((5, 64)), jnp.bfloat16)
  np.testing.assert_array_equal(
      fs.sample(h, w8, jax.random.key(0), weight_scale=s, weight_layout=layout),
      fs.reference.sample(h, w8, jax.random.key(0), weight_scale=s, weight_layout=layout))


def test_quantize_weight_errors():
  w = jnp.ones((10, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"dtype='fp4' must be one of"):
    fs.quantize_weight(w, "fp4")
  with pytest.raises(TypeError, match=r"weight must be a float array"):
    fs.quantize_weight(w.astype(jnp.int8), "int8")
  with pytest.raises(ValueError, match=r"weight_layout='x'"):
    fs.quantize_weight(w, "int8", weight_layout="x")
  with pytest.raises(ValueError, match=r"weight.shape=\(10, 0\) has no entries"):
    fs.quantize_weight(w[:, :0], "int8")
  # A NaN or infinite entry: its row's scale would be NaN or infinite, or
  # (int8) the entry silently 0. Named by its vocabulary row, either layout.
  for bad in (jnp.nan, jnp.inf):
    for dtype in ("int8", "fp8"):
      with pytest.raises(ValueError, match=r"NaN or infinite entries in vocabulary row 3 "
                                           r"\(1 rows in all\)"):
        fs.quantize_weight(w.at[3, 2].set(bad), dtype)
    with pytest.raises(ValueError, match=r"vocabulary row 3"):
      fs.quantize_weight(w.at[3, 2].set(bad).T, "int8", weight_layout="dv")
  # A row whose absmax / qmax is below float32's smallest normal: that
  # quotient was flushed to 0, the row became 0 / 0 (NaN in FP8, which won
  # every argmax) (found by review). Its scale is now the smallest normal.
  tiny = np.finfo(np.float32).tiny
  wt = np.asarray(w, np.float32).copy()
  wt[5] = 0.0
  wt[5, 0] = 1e-36
  for dtype in ("int8", "fp8", "float8_e5m2"):
    w8, scale = fs.quantize_weight(jnp.asarray(wt), dtype)
    assert np.isfinite(np.asarray(w8, np.float32)).all() and float(scale[5]) == tiny
    logits = problem.logits(jnp.ones((3, 64), jnp.bfloat16), w8, "vd", scale)
    assert np.isfinite(np.asarray(logits)).all() and np.abs(np.asarray(logits)[:, 5]).max() < 1e-30
  # Under jax.jit the head is traced: not checked, the formula's result.
  w8, scale = jax.jit(lambda w: fs.quantize_weight(w, "int8"))(w.at[3, 2].set(jnp.inf))
  assert not np.isfinite(np.asarray(scale)[3]) and np.isfinite(np.asarray(scale)[4])


def test_quantized_heads_prefer_xla_gemm_but_for_the_register_path_and_float_reports():
  # Measured on an H200 (docs/performance.md, "Quantized heads", "Quantized
  # heads at B = 17-128", "Candidate lists of the dense route"): XLA's GEMM
  # reading the 8-bit weight beats the fused kernels for plain sampling but
  # where the mosaic kernel runs its register path ("vd"): its wide 8-bit
  # steps (D that they cover: sm90_config.wide_8bit_steps; B <= 48, but
  # B <= 16 below D = 2048, not measured past 16 rows), and up to B = 128
  # at D = 2048-4096, from B = 80 at D = 8192 (8320: no wide steps, dense
  # at B = 17-79); and with
  # candidate lists (truncation) the dense route's lists from slots beat the
  # controls kernel. Calls that report floats keep the kernels' invariant
  # split; controls without lists stay on the kernels (not measured).
  from flashsample_jax import backends, controls, problem
  mosaic, triton = backends.get("mosaic"), backends.get("triton")

  def calls(b, d, layout="vd"):
    h, w, s = inputs.quantized_inputs(b, d, 256, seed=13, layout=layout)
    p = problem.prepare(h, w, jax.random.key(0), weight_scale=s, weight_layout=layout)
    plain = controls.prepare_controls(batch=b, vocab_size=256, rows=256)
    trunc = controls.prepare_controls(batch=b, vocab_size=256, rows=256, top_k=5, top_p=0.9)
    return p, plain, trunc

  p, plain, trunc = calls(16, 64)
  floats = controls.prepare_controls(batch=16, vocab_size=256, rows=256, top_k=5,
                                     return_logprobs=True)
  bias = controls.prepare_controls(batch=16, vocab_size=256, rows=256,
                                   logit_bias=jnp.zeros((256,)))
  for impl in (mosaic, triton):
    assert impl.prefers(p, plain) is False
    assert impl.prefers(p, trunc) is False
    assert impl.prefers(p, bias) is True
  assert mosaic.prefers(p, floats) is True
  assert dataclasses.replace(mosaic, batch_invariant=False).prefers(p, floats) is False
  for b, d, layout, want in ((1, 512, "vd", True), (16, 256, "vd", True),
                             (17, 256, "vd", False), (16, 256, "dv", False),
                             (16, 384, "vd", False), (32, 4096, "vd", True),
                             (128, 2880, "vd", True), (129, 4096, "vd", False),
                             (48, 4096, "dv", False), (64, 8192, "vd", False),
                             (80, 8192, "vd", True), (16, 8192, "vd", True),
                             (32, 8192, "vd", True), (48, 8192, "vd", True),
                             (32, 8320, "vd", False), (80, 8320, "vd", True),
                             (16, 1024, "vd", True), (32, 1024, "vd", False)):
    p, plain, _ = calls(b, d, layout)
    assert mosaic.prefers(p, plain) is want, (b, d, layout)
    assert triton.prefers(p, plain) is False
  h, w, _ = inputs.quantized_inputs(16, 64, 256, seed=13)
  pb = problem.prepare(h, w.astype(jnp.bfloat16), jax.random.key(0))
  assert mosaic.prefers(pb, plain) is True
  assert mosaic.prefers(pb, trunc) is True


@pytest.mark.parametrize("b,layout", [(1, "vd"), (5, "dv"), (20, "vd")])
def test_dense_gemm_of_an_8bit_head_takes_at_least_16_rows_on_a_gpu(monkeypatch, b, layout):
  # XLA's GEMM of an 8-bit head runs slower for one row than for 16 on a GPU
  # (docs/performance.md, "Candidate lists of the dense route"): the dense
  # route pads the hidden states to 16 rows there and drops the extra ones.
  # The GPU's program, traced here: its dot's rows, and the same tokens.
  from flashsample_jax.backends import xla as xla_backend
  h, w, s = inputs.quantized_inputs(b, 64, 512, seed=3, layout=layout)
  kw = dict(weight_scale=s, weight_layout=layout, top_k=20, top_p=0.9,
            temperature=0.5, backend="dense")
  key = jax.random.key(4)
  want = fs.reference.sample(h, w, key, weight_scale=s, weight_layout=layout, top_k=20,
                             top_p=0.9, temperature=0.5)
  dots = lambda: _dot_rows(jax.make_jaxpr(lambda h: fs.sample(h, w, key, **kw))(h).jaxpr)
  monkeypatch.setattr(xla_backend, "lists_kernel_usable", lambda: False)

  def dots_on(platform):
    monkeypatch.setattr(xla_backend, "_platform", lambda: platform)
    # The platform is read when the API's jit traces: its cache alone is
    # cleared (jax.clear_caches would make every later test in the process
    # compile again).
    api.run.clear_cache()
    return dots()
  try:
    on_cpu, on_gpu = dots_on("cpu"), dots_on("gpu")
    got = fs.sample(h, w, key, **kw)
  finally:
    api.run.clear_cache()     # no program traced for another platform left for the next tests
  # The pass's GEMM (the exact path's, in its conditional, keeps its rows).
  assert max(b, 16) in on_gpu and (b >= 16 or 16 not in on_cpu)
  np.testing.assert_array_equal(got, want)


def _dot_rows(jaxpr) -> set[int]:
  """The row counts of the first operands of ``jaxpr``'s dots, nested
  jaxprs (conditionals, loops, jitted calls) included."""
  rows = set()
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      rows.add(e.invars[0].aval.shape[0])
    for v in e.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          rows |= _dot_rows(sub)
  return rows
