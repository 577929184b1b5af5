"""Candidate lists from the plain kernel's pass (pallas_kernels.sm90_slots,
MosaicBackend.slot_lists): each tile's four largest tempered logits, the
fifth value and the sum, then the Triton entry kernel's lists.

* interpret mode (CPU): the Mosaic epilogue's entries against
  :func:`tests.test_triton_lists.slot_entries_of` on exact logits (8-bit
  heads, per-row and per-tensor scales, greedy rows, a last tile that
  overlaps the one before it, ids past the vocabulary); the route's
  tokens equal the reference with the entry kernel's launch replaced by
  its NumPy contract, rows it cannot certify taking the exact path.
* routing (CPU): which calls take the route.
* gpu (marked ``gpu``): the real kernels against the contracts and the
  reference. The slot kernel's CUDA lowering is tested with the other
  8-bit kernels' (tests/test_quantized_mosaic.py, on both ends of the jax
  range).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")

import flashsample_jax as fs  # noqa: E402
from flashsample_jax import api, controls, problem, stage2  # noqa: E402
from flashsample_jax.backends import xla as xla_backend  # noqa: E402
from flashsample_jax.backends.mosaic import MosaicBackend  # noqa: E402
from pallas_kernels import rowdata, sm90_config  # noqa: E402
from pallas_kernels import triton_lists as tls  # noqa: E402
from tests import inputs  # noqa: E402
from tests.test_triton_lists import expected_entry_lists, slot_entries_of  # noqa: E402

INTERPRET = MosaicBackend(interpret=True)


def _entries(backend, h, w, scale, temperature, vocab_size=None):
  """The slot kernel's entries as the route runs it (``backend``'s
  target), with the tiles' size."""
  from pallas_kernels import sm90_slots  # pylint: disable=import-outside-toplevel
  b = h.shape[0]
  z = jnp.zeros((b,), jnp.uint32)
  rows = rowdata.pack_rows(k0=z, k1=z, temperature=temperature, ctr_hi=z[None],
                           ctr_lo=z[None])
  v = w.shape[0]
  run = jax.jit(functools.partial(sm90_slots.slot_entries, layout="vd",
                                  vocab_size=vocab_size or v,
                                  target=backend._target()))  # pylint: disable=protected-access
  got = run(h, w, rows, 0, scale=scale)
  cfg, n = sm90_config.slot_entries_config(b, h.shape[1], v, 2, 1, "vd")
  assert all(x.shape[0] == n for x in got.values())   # the launch's padded rows
  return {k: np.asarray(x)[:b] for k, x in got.items()}, cfg.tile_v


def _tempered(h, w, scale, temperature, vocab_size=None):
  """The exact logits' tempered values in NumPy (power-of-two scales and
  temperatures: every product and quotient exact), ``-inf`` past
  ``vocab_size``."""
  x = (np.asarray(h, np.float32) @ np.asarray(w.astype(jnp.float32)).T) * np.asarray(scale)
  t = np.asarray(temperature, np.float32)
  x = x / np.where(t == 0, 1, t)[:, None]
  if vocab_size is not None:
    x[:, vocab_size:] = -np.inf
  return x.astype(np.float32)


def _check_entries(got, want):
  for k in tls.ENTRY_FIELDS:
    if k == "sum":
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
    else:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("dtype, per_row", [(jnp.float8_e4m3fn, True), (jnp.int8, False),
                                            (jnp.float8_e5m2, True)])
def test_entries_in_interpret_mode(dtype, per_row):
  # 1000 rows: 8 tiles of 128, the last overlapping the one before it; the
  # last 3 ids past the vocabulary (-inf, no id); a greedy row and
  # power-of-two temperatures.
  b, d, v = 3, 256, 1000
  h, w, s = inputs.quantized_inputs(b, d, v, dtype=dtype, per_row=per_row, seed=2)
  t = jnp.asarray([1.0, 0.5, 0.0], jnp.float32)
  got, vt = _entries(INTERPRET, h, w, s, t, vocab_size=v - 3)
  x = _tempered(h, w, s, t, v - 3)
  want = slot_entries_of(x, vt)
  # Past the vocabulary the kernel lists no id (the NumPy rows list every
  # column): the last tile's last three entries.
  for e in range(1, 5):
    want[f"i{e}"] = np.where(want[f"v{e}"] == -np.inf, np.iinfo(np.int32).max, want[f"i{e}"])
  _check_entries(got, want)


# -- the route, the entry kernel's launch replaced by its contract ---------


def _contract_launch(fields, m, rows):
  """:func:`tls.entry_launch`'s contract, computed on the host."""
  b = rows
  fields = tuple(f[:rows] for f in fields)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  shapes = dict(cand_vals=f32(b, m), cand_ids=jax.ShapeDtypeStruct((b, m), jnp.int32),
                cand_bound=f32(b), lse_max=f32(b), lse_sum=f32(b), best_t=f32(b),
                best_id=jax.ShapeDtypeStruct((b,), jnp.int32))
  run = lambda *f: expected_entry_lists(dict(zip(tls.ENTRY_FIELDS, f)), m)
  return dict(jax.pure_callback(run, shapes, *fields))


@pytest.fixture
def entry_contract(monkeypatch):
  """The route on the CPU: the Mosaic kernel in interpret mode, the entry
  kernel's launch replaced by its contract. The API's jit cache is cleared
  around it (a trace by another test must not answer for this one)."""
  monkeypatch.setattr(tls, "entry_launch", _contract_launch)
  api.run.clear_cache()
  yield
  api.run.clear_cache()


# 520 tiles of 128 ids: lists of up to 65 entries (8 tiles per entry).
B, D, V = 4, 64, 128 * 520
# 168 tiles: 21 entries, just past top_k = 20 (with 40 tiles the short
# lists alone flag every row). Interpret mode's time grows with the tiles.
V_K20 = 128 * 168


def _route(h, w, s, temperature, **kw):
  p = problem.prepare(h, w, jax.random.key(0), temperature=temperature, weight_scale=s)
  c = controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size, rows=p.weight_rows,
                                **kw)
  return p, c


@pytest.mark.parametrize("kw, temperature", [
    (dict(top_k=20, top_p=0.9), "pow2"), (dict(top_k=50), "pow2"),
    (dict(top_k=np.array([20, 5, 56, 1], np.int32), min_p=0.2), "pow2"),
    # 1 / T rounds (0.6, 0.7, 1.3) and a greedy row: the lists' t must be
    # the reference's l / T bit for bit (docs/design.md, "Division").
    (dict(top_k=20, top_p=0.9), [0.6, 0.7, 1.3, 0.0])],
    ids=["k-p", "k", "k-rows-minp", "k-p-rounding-T"])
def test_route_equals_reference(entry_contract, kw, temperature):
  del entry_contract
  h, w, s = inputs.quantized_inputs(B, D, V, seed=3)
  t = (inputs.pow2_temperatures(B, greedy_every=3, seed=3) if temperature == "pow2"
       else jnp.asarray(temperature, jnp.float32))
  keys = inputs.row_keys(B, seed=4)
  p, c = _route(h, w, s, t, **kw)
  assert INTERPRET.slot_lists(p, c) and INTERPRET.prefers(p, c)
  got = fs.sample(h, w, keys, temperature=t, weight_scale=s, backend=INTERPRET, **kw)
  want = fs.reference.sample(h, w, keys, temperature=t, weight_scale=s, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_rows_the_entries_cannot_certify_take_the_exact_path(entry_contract):
  # Row 0's 20 largest logits in one tile (the fifth bounds its list
  # inside its top 20), row 1 all equal (more entries reach tau than the
  # kernel holds): both redone on the exact path, the same tokens.
  del entry_contract
  h, w, s = inputs.quantized_inputs(B, D, V_K20, seed=5)
  w = np.array(w.astype(jnp.float32))
  w[256:276] = 3 * np.sign(np.asarray(h[0], np.float32))
  h = np.array(h, np.float32)
  h[1] = 0
  h, w = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.float8_e4m3fn)
  t = jnp.ones((B,), jnp.float32)
  keys = inputs.row_keys(B, seed=6)
  kw = dict(top_k=20, top_p=0.9)
  p, c = _route(h, w, s, t, **kw)
  st = stage2.per_sample(INTERPRET.controls_state(p, c.for_pass()), c.samples)
  flagged = np.asarray(stage2.finish(p, c, st)[2])
  np.testing.assert_array_equal(flagged, [True, True, False, False])
  assert np.isfinite(np.asarray(st.cand_bound)[0])
  got = fs.sample(h, w, keys, temperature=t, weight_scale=s, backend=INTERPRET, **kw)
  want = fs.reference.sample(h, w, keys, temperature=t, weight_scale=s, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_which_calls_take_the_route(monkeypatch):
  h, w, s = inputs.quantized_inputs(B, D, V, seed=3)
  t = jnp.ones((B,), jnp.float32)
  on = lambda be=INTERPRET, **kw: be.slot_lists(*_route(h, w, s, t, **kw))
  assert on(top_k=20, top_p=0.9) and on(top_p=0.9, top_k=56) and on(min_p=0.1, top_k=3)
  # Not: a rule on only some rows (k = 0), lists longer than 8 tiles per
  # entry allow (top-p alone, or k past 56: 128 entries), floats reported,
  # transforms, penalties.
  assert not on(top_k=np.array([20, 0, 5, 5], np.int32))
  assert not on(top_p=0.9) and not on(top_k=57)
  assert not on(top_k=20, return_logprobs=True)
  assert not on(top_k=20, top_logprobs=3)
  assert not on(top_k=20, softcap=30.0)
  assert not on(top_k=20, logit_bias=jnp.zeros((V,)))
  assert not on(top_k=20, repetition_penalty=1.2, output_ids=jnp.zeros((B, 3), jnp.int32))
  # Past slot_rows rows (16 by default) the dense route; a bf16 head keeps
  # the controls kernel; without jax-triton on a GPU, the dense route.
  h17, _, _ = inputs.quantized_inputs(17, D, 8, seed=3)
  t17 = jnp.ones((17,), jnp.float32)
  assert not INTERPRET.slot_lists(*_route(h17, w, s, t17, top_k=20))
  assert MosaicBackend(interpret=True, slot_rows=17).slot_lists(*_route(h17, w, s, t17,
                                                                        top_k=20))
  assert not MosaicBackend(interpret=True, slot_rows=0).slot_lists(*_route(h, w, s, t,
                                                                           top_k=20))
  with pytest.raises(ValueError, match="slot_rows=-1"):
    MosaicBackend(slot_rows=-1)
  p, c = _route(h, w.astype(jnp.bfloat16), None, t, top_k=20)
  assert not INTERPRET.slot_lists(p, c)
  monkeypatch.setattr(xla_backend, "lists_kernel_usable", lambda: False)
  assert not on(MosaicBackend(assume_sm90=True), top_k=20)
  monkeypatch.setattr(xla_backend, "lists_kernel_usable", lambda: True)
  assert on(MosaicBackend(assume_sm90=True), top_k=20)


def test_the_config_is_the_plain_launch():
  # The slot kernel runs the plain kernel's own config where that is one
  # vocabulary-major launch; batch blocks and the batch-major schedule no.
  for b in (1, 16, 48, 128):
    cfg, n = sm90_config.slot_entries_config(b, 4096, 151936, 2, 1, "vd")
    assert cfg == sm90_config.pick_config(n, 4096, 151936, 2, w_itemsize=1, layout="vd")
  assert sm90_config.slot_entries_config(256, 4096, 151936, 2, 1, "vd") is None
  assert sm90_config.slot_entries_config(128, 4096, 151936, 2, 2, "vd") is None


# -- on the GPU --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16, 48])
def test_gpu_entries_of_a_vocabulary_wide_head(b):
  # The S head's shape with exact logits.
  h, w, s = inputs.quantized_inputs(b, 4096, 151936, seed=b)
  t = inputs.pow2_temperatures(b, greedy_every=4, seed=b)
  got, vt = _entries(MosaicBackend(), h, w, s, t)
  _check_entries(got, slot_entries_of(_tempered(h, w, s, t), vt))


@pytest.mark.gpu
@pytest.mark.parametrize("b, kw", [(1, dict(top_k=50, top_p=0.9)), (16, dict(top_k=50, top_p=0.9)),
                                   (48, dict(top_k=20, top_p=0.95)), (16, dict(top_k=50)),
                                   (16, dict(top_k=50, min_p=0.05))])
def test_gpu_route_equals_reference(b, kw):
  # Through auto up to 16 rows, the S head's shape with exact logits,
  # per-row keys; at 48 rows (the wide steps' last batch) by slot_rows.
  h, w, s = inputs.quantized_inputs(b, 4096, 151936, seed=b + 1)
  t = inputs.pow2_temperatures(b, greedy_every=4, seed=b)
  keys = inputs.row_keys(b, seed=b)
  be = MosaicBackend(slot_rows=48)
  assert be.slot_lists(*_route(h, w, s, t, **kw))
  if b <= 16:
    assert fs.which_backend(h, w, keys, temperature=t, weight_scale=s, **kw) == "mosaic"
  got = jax.jit(lambda h, w, s, k: fs.sample(h, w, k, temperature=t, weight_scale=s,
                                             backend=be, **kw))(h, w, s, keys)
  want = fs.reference.sample(h, w, keys, temperature=t, weight_scale=s, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16])
def test_gpu_route_with_temperatures_that_round(b):
  # Temperatures whose 1 / T rounds, through auto on the S head's shape.
  h, w, s = inputs.quantized_inputs(b, 4096, 151936, seed=b + 3)
  t = jnp.asarray(np.resize(np.float32([0.6, 0.7, 1.3, 0.0]), b))
  keys = inputs.row_keys(b, seed=b + 3)
  kw = dict(top_k=50, top_p=0.9)
  assert MosaicBackend().slot_lists(*_route(h, w, s, t, **kw))
  got = jax.jit(lambda h, w, s, k: fs.sample(h, w, k, temperature=t, weight_scale=s, **kw))(
      h, w, s, keys)
  want = fs.reference.sample(h, w, keys, temperature=t, weight_scale=s, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
def test_gpu_rows_the_entries_cannot_certify_take_the_exact_path():
  # As on the CPU, with the real kernels.
  b = 4
  h, w, s = inputs.quantized_inputs(b, 4096, 151936, seed=9)
  w = np.array(w.astype(jnp.float32))
  w[256:276] = 3 * np.sign(np.asarray(h[0], np.float32))
  h = np.array(h, np.float32)
  h[1] = 0
  h, w = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.float8_e4m3fn)
  keys = inputs.row_keys(b, seed=6)
  kw = dict(top_k=20, top_p=0.9)
  got = fs.sample(h, w, keys, weight_scale=s, **kw)
  want = fs.reference.sample(h, w, keys, weight_scale=s, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
