"""Candidate lists read off slots of ids (flashsample_jax.dense_lists): the
lists' contract on random, tied, crowded and masked rows, and the xla /
dense backends' results with them equal to the reference's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import api, controls, dense_lists, problem, stage2
from flashsample_jax.backends.xla import DenseBackend, XlaBackend
from tests import inputs

M, SLOT = 8, 16          # lists of 8 from slots of 16 ids: rows of >= 128 ids


def _check_contract(t, vals, ids, bound):
  """The lists' contract (pallas_kernels.state.ControlsState): listed values
  lie above the bound, every unlisted value at or below it, each listed
  value is its id's, and the listed ones are the row's largest."""
  t, vals, ids, bound = map(np.asarray, (t, vals, ids, bound))
  for r in range(t.shape[0]):
    listed = np.isfinite(vals[r])
    assert np.all(vals[r][listed] > bound[r])
    np.testing.assert_array_equal(t[r, ids[r][listed]], vals[r][listed])
    rest = np.delete(t[r], ids[r][listed])
    assert np.all(rest <= bound[r])
    np.testing.assert_array_equal(vals[r][listed], np.sort(t[r])[::-1][:listed.sum()])


def _lists(t, **kw):
  gid = jnp.arange(t.shape[1], dtype=jnp.int32)
  return jax.jit(lambda t: dense_lists.slot_lists(t, gid, M, slot=SLOT, **kw))(t)


def test_random_rows_list_their_top_m_exactly():
  t = jax.random.normal(jax.random.key(0), (16, 1000)) * 3
  vals, ids, bound = _lists(t)
  _check_contract(t, vals, ids, bound)
  assert np.all(np.isfinite(np.asarray(vals)))           # every row's whole top 8


def test_ties_and_crowded_slots_keep_the_bound_above_what_is_unlisted():
  # Integer logits in [-2, 2]: each top slot holds more 2s than its depth,
  # so the bound is 2 and nothing is listed (stage 2's exact path takes such
  # rows).
  t = jnp.asarray(np.random.default_rng(1).integers(-2, 3, (4, 512)), jnp.float32)
  vals, ids, bound = _lists(t)
  _check_contract(t, vals, ids, bound)
  np.testing.assert_array_equal(np.asarray(bound), 2.0)
  # A row whose 6 largest values share one slot: listed down to the 4th
  # (depth 4), the bound at the 5th.
  r = np.random.default_rng(2).normal(size=(1, 512)).astype(np.float32)
  r[0, 40:46] = 10.0 + np.arange(6)[::-1]
  vals, ids, bound = _lists(jnp.asarray(r))
  _check_contract(r, vals, ids, bound)
  assert float(bound[0]) == 11.0
  np.testing.assert_array_equal(np.asarray(ids)[0, :4], [40, 41, 42, 43])
  # Depth 8 lists all six.
  vals, ids, bound = _lists(jnp.asarray(r), depth=8)
  _check_contract(r, vals, ids, bound)
  assert np.isfinite(np.asarray(vals)[0]).sum() == M


def test_masked_rows_with_few_finite_values():
  r = np.random.default_rng(2)
  t = np.full((3, 640), -np.inf, np.float32)
  t[0, r.choice(640, 5, replace=False)] = r.normal(size=5)   # fewer finite than M
  t[1, :] = r.normal(size=640)                               # a full row
  # row 2: every id -inf
  vals, ids, bound = _lists(jnp.asarray(t))
  _check_contract(t, vals, ids, bound)
  assert np.isfinite(np.asarray(vals)[0]).sum() == 5
  assert np.asarray(bound)[0] == -np.inf and not np.any(np.isfinite(np.asarray(vals)[2]))


def test_slot_size():
  assert dense_lists.slot_size(151936, 128) == 128
  assert dense_lists.slot_size(128256, 128) == 64
  assert dense_lists.slot_size(16500, 128) == 16
  assert dense_lists.slot_size(8191, 128) is None


def test_top_slots_bound_every_other_slot():
  t = jax.random.normal(jax.random.key(3), (8, 2048))
  slots, top, below = dense_lists.top_slots(t, M, SLOT)
  maxima = np.asarray(slots).max(axis=2)
  for r in range(8):
    others = np.delete(maxima[r], np.asarray(top)[r])
    assert others.max() == float(below[r]) and np.all(maxima[r][np.asarray(top)[r]] >= others.max())


def _exact_flags(h, w, keys, backend, temperature, weight_scale=None, traced=False, **kw):
  """Stage 2's fallback flags: bool ``[B]``, the rows it sends to the exact
  path. ``traced``: ``top_k`` passed into the jit as a ``[B]`` array (the
  full lists: ``Controls.top_k_max`` is 0)."""
  p = problem.prepare(h, w, keys, temperature=temperature, weight_scale=weight_scale)

  def flags(top_k):
    c = controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size,
                                  rows=p.weight_rows, **dict(kw, top_k=top_k))
    # The pass as the API runs it (Controls.for_pass: no noise where every
    # row truncates), which decides whether the list kernels serve.
    return stage2.finish(p, c, stage2.per_sample(
        backend.controls_state(p, c.for_pass()), c.samples))[2]

  return np.asarray(_with_top_k(flags, kw.get("top_k"), traced, p.batch))


def _with_top_k(f, top_k, traced: bool, batch: int):
  """``f(top_k)`` jitted, ``top_k`` a traced ``[B]`` argument if ``traced``
  (else a constant of the trace)."""
  if traced:
    return jax.jit(f)(jnp.full((batch,), top_k, jnp.int32))
  return jax.jit(lambda: f(top_k))()


def _exact_rows(h, w, keys, backend, temperature, weight_scale=None, **kw):
  """How many rows stage 2 sends to the exact path."""
  return int(_exact_flags(h, w, keys, backend, temperature, weight_scale, **kw).sum())


# End to end: lists of M ids need chunks of >= 64 M ids (slots of 8). With
# top_k=40 on every row M is 64 (stage2.candidate_count): a vocabulary of
# 16500 has slots of 32 in one dense chunk, and in two xla chunks of 16384
# (slots of 32) and 116 (top_k).
B, D, V = 6, 32, 16500


# The Triton list kernels (pallas_kernels.triton_lists) on a GPU; on the
# CPU their contract is tested through stage 2 in tests/test_triton_lists.py.
_KERNEL = pytest.param(DenseBackend(list_select="kernel"), id="dense-kernel",
                       marks=pytest.mark.gpu)


@pytest.mark.parametrize("backend", [DenseBackend(list_select="slots"),
                                     XlaBackend(chunk=16384, list_select="slots"), _KERNEL],
                         ids=["dense", "xla", "dense-kernel"])
@pytest.mark.parametrize("logits, exact_rows, top_k", [
    ("exact", 0, "traced"), ("ties", "sampled", "traced"), ("random", 0, "traced"),
    ("ties", "sampled", "concrete")])
def test_sample_with_slot_lists_equals_reference(backend, logits, exact_rows, top_k):
  # "exact": integer logits of std ~20, a few ties near the top; "ties":
  # integers in [-8, 8], so top slots hold more of a row's largest value
  # than their depth and rows take the exact path (which ones follow how
  # the ties fall into the slots); "random": bf16 inputs. exact_rows: the
  # rows stage 2 sends to the exact path. A traced top_k keeps lists of
  # stage2.CANDIDATES, top_k=40 given concretely lists of 64 (in slots
  # twice as wide).
  h, w = inputs.list_inputs(logits, B, D, V)
  t = inputs.pow2_temperatures(B, greedy_every=4, seed=7)
  traced = top_k == "traced"
  kw = dict(top_k=40, top_p=0.9, return_logprobs=True, top_logprobs=5, return_kept=20)
  keys = inputs.row_keys(B, seed=8)
  flags = _exact_flags(h, w, keys, backend, t, traced=traced, **kw)
  if exact_rows == "sampled" and backend.list_select == "kernel":
    # More values reach tau than the kernels gather: every row is handed
    # over (greedy ones too: the kept sets and log-probabilities need each
    # row's kept set).
    assert flags.all(), flags
  elif exact_rows == "sampled":
    assert flags.sum() >= 2, flags
  else:
    assert not flags.any(), flags
  got = _with_top_k(lambda k: fs.sample(h, w, keys, backend=backend, temperature=t,
                                        **dict(kw, top_k=k)), 40, traced, B)
  want = fs.reference.sample(h, w, keys, temperature=t, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.kept_ids, want.kept_ids)
  np.testing.assert_array_equal(got.kept_count, want.kept_count)
  np.testing.assert_array_equal(got.top_ids, want.top_ids)
  np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-5, atol=1e-5)


def test_list_select_is_checked():
  with pytest.raises(ValueError, match="list_select='sort'"):
    XlaBackend(list_select="sort")


@pytest.mark.parametrize("backend", [DenseBackend(list_select="slots"), "auto", _KERNEL],
                         ids=["dense", "auto", "dense-kernel"])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8], ids=["fp8", "int8"])
def test_quantized_head_with_slot_lists_equals_reference(dtype, backend):
  # On a GPU auto takes the dense route with slot lists for 8-bit heads with
  # truncation (docs/performance.md, "Candidate lists of the dense route").
  h, w, s = inputs.quantized_inputs(B, D, V, dtype=dtype, seed=9)
  t = inputs.pow2_temperatures(B, greedy_every=3, seed=10)
  keys = inputs.row_keys(B, seed=11)
  kw = dict(temperature=t, weight_scale=s, top_k=50, top_p=0.8)
  got = fs.sample(h, w, keys, backend=backend, **kw)
  want = fs.reference.sample(h, w, keys, **kw)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("platform, want", [("gpu", "slots"), ("cpu", "top_k"), ("tpu", "top_k")])
def test_list_select_auto_takes_slots_on_a_gpu_only(platform, want, monkeypatch):
  # Without jax-triton (with it a GPU takes the kernels: test_triton_lists).
  from flashsample_jax.backends import xla as xla_backend
  monkeypatch.setattr(xla_backend, "_platform", lambda: platform)
  monkeypatch.setattr(xla_backend, "lists_kernel_usable", lambda: False)
  assert DenseBackend().list_select == "auto"
  assert XlaBackend().list_select == "top_k"
  assert DenseBackend().lists_by() == want
  assert XlaBackend(list_select="auto").lists_by() == want
  assert DenseBackend(list_select="slots").lists_by() == "slots"
  assert DenseBackend(list_select="top_k").lists_by() == "top_k"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs 8 CPU devices as jax.devices()")
@pytest.mark.parametrize("logits", ["exact", "ties"])
def test_slot_lists_of_vocabulary_shards_equal_reference(logits):
  # Each shard reads its lists off its own slots (M = 64 for top_k=40: 2
  # shards of 8250 ids, slots of 16; 4 of 4125, slots of 8) and the shards' bounds
  # merge; with "ties" every sampled row takes the exact path, which
  # gathers the shards' logits.
  from jax.sharding import AxisType, PartitionSpec as P
  h, w, s = inputs.quantized_inputs(B, D if logits == "exact" else 2, V, seed=12,
                                    per_row=logits == "exact")
  if logits == "ties":  # logits in {-2, ..., 2} times one scale: hundreds of 2s a row
    h, w = (jnp.clip(x.astype(jnp.float32), -1, 1).astype(x.dtype) for x in (h, w))
  t = inputs.pow2_temperatures(B, greedy_every=4, seed=13)
  key = jax.random.key(14)
  kw = dict(temperature=t, weight_scale=s, top_k=40, top_p=0.9)
  want = np.asarray(fs.reference.sample(h, w, key, **kw))
  # Two chunks of one shard's width read the same lists as two shards.
  flagged = _exact_rows(h, w, key, XlaBackend(chunk=V // 2, list_select="slots"), **kw)
  assert flagged == (int(np.sum(np.asarray(t) > 0)) if logits == "ties" else 0)
  be = DenseBackend(list_select="slots")
  for n in (2, 4):
    mesh = jax.make_mesh((n,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    f = jax.shard_map(
        lambda h, w, s: fs.sample(h, w, key, backend=be, vocab_axis="tp",
                                  **dict(kw, weight_scale=s))[None],
        mesh=mesh, in_specs=(P(), P("tp", None), P(*("tp",)[:s.ndim])), out_specs=P("tp"),
        check_vma=False)
    for row in np.asarray(jax.jit(f)(h, w, s)):
      np.testing.assert_array_equal(row, want)


@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
@pytest.mark.parametrize("logits", ["exact", "random"])
def test_kernel_lists_at_any_temperature_equal_xlas_lists(logits, per_row, monkeypatch):
  # Temperatures that are not powers of two (1 / T rounds): the kernels read
  # the GEMM's product and temper it as XLA does (docs/design.md,
  # "Division"), so the route with their lists equals the route with XLA's
  # top_k lists bit for bit (tokens, kept sets, top ids; log-probabilities
  # within the log-sum-exp's summation order).
  from pallas_kernels import triton_lists as tls
  scales = []
  launch = tls.launch
  def recording(t, scale, *args):
    scales.append(tuple(scale.shape))
    return launch(t, scale, *args)
  monkeypatch.setattr(tls, "launch", recording)
  if logits == "exact":
    h, w, s = inputs.quantized_inputs(B, D, V, seed=9, per_row=per_row)
  else:
    r = np.random.default_rng(15)
    h = jnp.asarray(r.standard_normal((B, D)), jnp.bfloat16)
    w = jnp.asarray(r.standard_normal((V, D)) * 2, jnp.float8_e4m3fn)
    s = jnp.asarray(r.uniform(0.05, 0.2, V if per_row else ()), jnp.float32)
  t = jnp.asarray([0.6, 0.7, 0.0, 1.3, 0.9, 0.35], jnp.float32)
  keys = inputs.row_keys(B, seed=16)
  kw = dict(temperature=t, weight_scale=s, top_k=50, top_p=0.8, return_logprobs=True,
            top_logprobs=5, return_kept=20)
  # The launch is recorded when the API's jit traces: a trace of another
  # test with the same shapes must not answer for this call.
  api.run.clear_cache()
  got = fs.sample(h, w, keys, backend=DenseBackend(list_select="kernel"), **kw)
  assert scales == [(V,) if per_row else (1,)]      # the kernels read the GEMM's product
  want = fs.sample(h, w, keys, backend=DenseBackend(list_select="top_k"), **kw)
  for name in ("tokens", "kept_ids", "kept_count", "top_ids"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
  np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-5, atol=1e-5)


def test_kernel_scopes_name_stage_2s_steps():
  # The map from a trace's kernel names to the package's code: every kernel
  # of the compiled program listed (the exact path's branches too), and
  # stage 2's steps found by their named scopes.
  # (benchmarks/experiments/hlo_scopes.py; here, not with the benchmarks'
  # smoke runs, so that CI runs it.)
  from benchmarks.experiments.hlo_scopes import kernel_scopes, scope_of
  assert scope_of("jit(f)/jit(run)/stage2.certify/controls.prefix_sums/add") == (
      "stage2.certify/controls.prefix_sums")
  r = np.random.default_rng(0)
  h = jnp.asarray(r.standard_normal((2, 64)), jnp.bfloat16)
  w, s = fs.quantize_weight(jnp.asarray(r.standard_normal((2048, 64)), jnp.bfloat16), "int8")
  f = jax.jit(lambda h, w: fs.sample(h, w, jax.random.key(0), backend=DenseBackend(),
                                     top_k=50, top_p=0.9, weight_scale=s))
  kernels = kernel_scopes(f.lower(h, w).compile().as_text())
  scopes = {sc for k in kernels for sc, _ in k["scopes"]}
  assert {"stage2.certify/controls.nucleus_terms/controls.prefix_sums",
          "stage2.pick_kept"} <= scopes
  # One scan serves top-p's normalizer and the masses (controls.mass_before).
  assert not any(sc.startswith("stage2.certify/controls.mass_before/controls.prefix_sums")
                 for sc in scopes)
  # Top-k on every row: no readings of top-p's edge (stage2._truncate_decision).
  assert not any(sc.startswith("stage2.top_p_edge") for sc in scopes)
  assert any(k["opcode"] == "conditional" for k in kernels)
  assert any(k["where"] != "entry" and k["scopes"] for k in kernels)   # inside the branches
  assert len({k["kernel"] for k in kernels}) == len(kernels)
