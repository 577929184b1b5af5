"""The ``triton`` backend's adapter on a CPU, its kernels replaced by their
XLA references.

tests/test_triton_kernels.py checks those references against the kernels
(under Triton's interpreter, compiled to PTX, and on the GPU). Here the rest
of the backend runs in CI: packing the rows, grouping samples into launches,
pairing the tiles' candidate lists, and stage 2, against
``flashsample_jax.reference`` through the shared backend suite.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")

import flashsample_jax as fs  # noqa: E402
from flashsample_jax import controls, problem  # noqa: E402
from flashsample_jax.backends import triton as triton_backend  # noqa: E402
from pallas_kernels import triton_controls  # noqa: E402
from tests import inputs  # noqa: E402
from tests.backend_suite import BackendSuite  # noqa: E402
from tests.test_triton_kernels import (  # noqa: E402
    xla_controls_reference, xla_tile_reference)

# The kernels' tile width at small B (the lists' pairing groups 2 ** r tiles).
BLOCK_V = 64


def _rows(weight, layout):
  return weight.shape[0] if layout == "vd" else weight.shape[1]


class _Sampler:
  """``triton_sampler.candidates``'s outputs, computed by XLA."""

  @staticmethod
  def candidates(hidden, weight, rows, vocab_offset=0, *, layout, vocab_size,
                 weight_scale=None, config=None):
    del config
    return xla_tile_reference(hidden, weight, rows, vocab_offset, layout=layout,
                              vocab_size=vocab_size,
                              rows_valid=_rows(weight, layout), block_v=BLOCK_V,
                              scale=weight_scale)


class _Controls:
  """``triton_controls.control_candidates``'s outputs, computed by XLA."""

  Controls = triton_controls.Controls
  has_invariant_config = staticmethod(triton_controls.has_invariant_config)

  @staticmethod
  def control_candidates(hidden, weight, rows, vocab_offset=0, *, layout,
                         vocab_size, controls, bias=None, allowed_mask=None,
                         given_ids=None, weight_scale=None, config=None,
                         batch_invariant=False):
    triton_controls.check_controls(controls)
    assert config is None and isinstance(batch_invariant, bool)
    assert controls.given == (given_ids is not None)
    out = xla_controls_reference(
        hidden, weight, rows, vocab_offset, controls, layout=layout,
        vocab_size=vocab_size, rows_valid=_rows(weight, layout),
        block_v=BLOCK_V, bias=bias, mask=allowed_mask, scale=weight_scale,
        given=given_ids)
    stack = lambda name: jnp.stack(out[name], axis=1)
    lists = controls.top_k > 0
    asked = lambda flag, name: out[name] if flag else None
    return triton_controls.ControlsCandidates(
        stack("best_score"), stack("best_index"),
        stack("best_t") if controls.t_best else None,
        asked(controls.lse, "lse_max"), asked(controls.lse, "lse_sum"),
        stack("cand_vals") if lists else None,
        stack("cand_ids") if lists else None,
        asked(lists, "bound"), asked(controls.entropy, "ent_sum"),
        asked(controls.raw, "raw_max"), asked(controls.raw, "raw_sum"),
        asked(controls.finite, "finite_count"), asked(controls.given, "given_t"))


@dataclasses.dataclass(frozen=True)
class CpuTritonBackend(triton_backend.TritonBackend):
  """The triton backend with no GPU check (its kernels are patched)."""

  def check(self, p, c):
    del p, c


@pytest.fixture(autouse=True)
def _xla_kernels(monkeypatch):
  monkeypatch.setattr(triton_backend, "_kernels", lambda: (_Sampler, _Controls))


class TestTritonAdapter(BackendSuite):
  backend = CpuTritonBackend()
  dtypes = [jnp.bfloat16, jnp.float16]
  # truncation_order="vllm" is stage 2's rule on the lists (the same for
  # every backend); the adapter's lists for top-p with min-p are k_p_minp's.
  # The bias, the soft-cap and the mask reach the kernel's stand-in as in
  # "all", a scalar top-k as in "k_p_minp"; per-row keys run with a per-row
  # rule, every control and the penalties; several samples with "all" (CI
  # time: the kernels themselves are tests/test_triton_kernels.py's).
  covered_cases = {"p_minp_vllm": "k_p_minp", "bias": "all", "softcap": "all",
                   "mask": "all", "top_k_scalar": "k_p_minp"}
  row_key_cases = frozenset({"top_k", "top_p", "all", "penalties_all"})
  covered_sample_cases = {"top_k": "all", "top_p": "all"}
  # Scores of the tokens sample drew, bit for bit, on one case (CI time;
  # the GPU suites run every score case).
  score_cases = ("k_p_minp",)


@functools.cache
def _jitted_state(pairings):
  """The backend's controls_state jitted, as its sampler runs it (op by op
  each call would compile its ops again; the 0-pairing base is shared)."""
  return jax.jit(CpuTritonBackend(list_pairings=pairings).controls_state)


@pytest.mark.parametrize("pairings", [1, 2, 3])
def test_list_pairings_leave_the_certified_lists_unchanged(pairings):
  # Pairing rounds only drop candidates below a row's M best or raise its
  # bound: a row whose kept lists are certified with and without them lists
  # the same values and ids. V = 4096 (64 tiles), top-k 8.
  b, d, v = 24, 64, 4096
  h, w = inputs.exact_inputs(b, d, v, seed=3)
  key = jax.random.key(4)
  p = problem.prepare(h, w, key, temperature=jnp.full((b,), 0.5, jnp.float32))
  c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, top_k=8)
  base, got = [_jitted_state(r)(p, c) for r in (0, pairings)]
  m = 8
  # A row is certified when its m-th value lies above the bound.
  ok = np.asarray(got.cand_vals[:, m - 1] > got.cand_bound)
  assert ok.mean() > 0.5, ok.mean()
  # Equal values may come in another order (stage 2 does not rely on it),
  # and the m-th value's ties may be another of its equals: the values must
  # agree, and the ids above the m-th value as a set.
  gv, gi = np.asarray(got.cand_vals)[:, :m], np.asarray(got.cand_ids)[:, :m]
  bv, bi = np.asarray(base.cand_vals)[:, :m], np.asarray(base.cand_ids)[:, :m]
  np.testing.assert_array_equal(gv[ok], bv[ok])
  for row in np.flatnonzero(ok):
    above = lambda v, i: sorted(i[v > v[m - 1]])
    assert above(gv[row], gi[row]) == above(bv[row], bi[row]), row
  assert np.all(np.asarray(got.cand_bound) >= np.asarray(base.cand_bound))
  # The rounds did drop candidates: some row's bound rose.
  assert np.any(np.asarray(got.cand_bound) > np.asarray(base.cand_bound))


def test_truncation_with_pairings_equals_reference_on_crowded_rows():
  # Rows whose top ids crowd into one tile (where those scaled logits come
  # out positive: the exact path must take them) next to rows spread out:
  # every pairing count gives the reference's tokens.
  b, d, v = 8, 64, 2048
  h, w = inputs.exact_inputs(b, d, v, seed=7)
  w = w.at[64:72].multiply(8)     # ids 64..71: logits 8x larger in magnitude
  for r in (0, 1, 2, 3):
    got = fs.sample(h, w, jax.random.key(1), temperature=0.5, top_k=10,
                    backend=CpuTritonBackend(list_pairings=r))
    want = fs.reference.sample(h, w, jax.random.key(1), temperature=0.5, top_k=10)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_list_pairings_must_be_a_count(bad):
  with pytest.raises(ValueError, match="list_pairings"):
    triton_backend.TritonBackend(list_pairings=bad)


@pytest.mark.parametrize("platform,capability,want",
                         [("gpu", "9.0", (9, 0)), ("gpu", "8.6", (8, 6)), ("gpu", "gfx90a", None),
                          ("gpu", "", None), ("cpu", "", None)])
def test_cuda_capability_of_cuda_devices_only(monkeypatch, platform, capability, want):
  # A ROCm device is a "gpu" too, with a "gfx..." capability: the backend
  # cannot run there (NotImplementedError, so that auto moves on), where
  # int("gfx90a") raised a ValueError (found by review).
  device = type("Device", (), dict(platform=platform, compute_capability=capability,
                                   device_kind="test"))()
  monkeypatch.setattr(triton_backend.jax, "devices", lambda *a: [device])
  if want is None:
    with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
      triton_backend._cuda_capability()
  else:
    assert triton_backend._cuda_capability() == want


def test_check_takes_quantized_heads_with_their_scale(monkeypatch):
  # The GPU checks pass as on an H100 (sm90, triton and jax_triton present);
  # what remains is the dtype rule: an 8-bit weight needs its scale and
  # bf16/f16 hidden states.
  monkeypatch.setattr(triton_backend, "_cuda_capability", lambda: (9, 0))
  monkeypatch.setattr(triton_backend.importlib.util, "find_spec", lambda name: object())
  b, d, v = 4, 64, 300
  backend = triton_backend.TritonBackend()
  c = controls.prepare_controls(batch=b, vocab_size=v, rows=v)
  for dt in inputs.QUANTIZED_DTYPES:
    for per_row in (True, False):
      h, w, s = inputs.quantized_inputs(b, d, v, dtype=dt, per_row=per_row)
      p = problem.prepare(h, w, jax.random.key(0), weight_scale=s)
      backend.check(p, c)
      with pytest.raises(NotImplementedError, match="only with its weight_scale"):
        backend.check(dataclasses.replace(p, weight_scale=None), c)
      with pytest.raises(NotImplementedError, match="hidden.dtype=float32"):
        backend.check(dataclasses.replace(p, hidden=p.hidden.astype(jnp.float32)), c)
  h, w = inputs.exact_inputs(b, d, v, dtype=jnp.float32)
  with pytest.raises(NotImplementedError, match="weight.dtype=float32"):
    backend.check(problem.prepare(h, w, jax.random.key(0)), c)


def test_float_calls_prefer_the_invariant_configs_at_every_batch():
  # Past ROUTE_MAX_ROWS the dense route is faster, but its GEMM's bits
  # follow the batch: calls that report floats stay on the kernel's
  # batch-invariant configs unless the instance opts out or has none (an
  # 8-bit [D, V] head, an explicit config).
  b, d, v = 512, 64, 300
  h, w = inputs.exact_inputs(b, d, v)
  p = problem.prepare(h, w, jax.random.key(0))
  backend = triton_backend.TritonBackend()
  plain = controls.prepare_controls(batch=b, vocab_size=v, rows=v)
  floats = controls.prepare_controls(batch=b, vocab_size=v, rows=v, return_logprobs=True)
  assert backend.prefers(p, plain) is False
  assert backend.prefers(p, floats) is True
  assert dataclasses.replace(backend, batch_invariant=False).prefers(p, floats) is False
  assert dataclasses.replace(backend, controls_config=object()).prefers(p, floats) is False
  hq, wq, s = inputs.quantized_inputs(b, d, v, dtype=jnp.int8, per_row=True)
  pq = problem.prepare(hq, wq.T, jax.random.key(0), weight_scale=s, weight_layout="dv")
  assert backend.prefers(pq, floats) is False
  pq = problem.prepare(hq, wq, jax.random.key(0), weight_scale=s)
  assert backend.prefers(pq, floats) is True


@pytest.mark.parametrize("per_row", [True, False])
def test_scale_reaches_the_kernels_unbroadcast(monkeypatch, per_row):
  # A per-tensor scale reaches the kernels as the f32 scalar it is (the
  # kernels read it as one element, no [V] broadcast); a per-row scale as
  # the [V] array.
  seen = []
  real = _Sampler.candidates

  def spy(*args, weight_scale=None, **kw):
    seen.append(weight_scale)
    return real(*args, weight_scale=weight_scale, **kw)

  monkeypatch.setattr(_Sampler, "candidates", staticmethod(spy))
  b, d, v = 4, 64, 300
  h, w, s = inputs.quantized_inputs(b, d, v, per_row=per_row)
  key = jax.random.key(2)
  p = problem.prepare(h, w, key, weight_scale=s)
  _, got = CpuTritonBackend().candidates(p)
  logits = np.asarray(h, np.float32) @ np.asarray(w, np.float32).T * np.asarray(s)
  want = jax.random.categorical(key, jnp.asarray(logits))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert seen and all(x.shape == ((v,) if per_row else ()) for x in seen)
  assert all(x.dtype == jnp.float32 for x in seen)


def _record_launches(monkeypatch, argument: str) -> list:
  """The list that each launch of the controls kernel's stand-in appends
  its keyword ``argument`` to."""
  seen = []
  real = _Controls.control_candidates

  def spy(*args, **kw):
    seen.append(kw[argument])
    return real(*args, **kw)

  monkeypatch.setattr(_Controls, "control_candidates", staticmethod(spy))
  return seen


def test_rl_fields_come_from_the_first_launch_only(monkeypatch):
  # Six samples take two launches (MAX_KERNEL_SAMPLES = 4): the log-sum-exp,
  # the lists and the RL fields do not depend on the samples, so only the
  # first computes them; the outputs are the reference's.
  specs = _record_launches(monkeypatch, "controls")
  from tests import cases  # pylint: disable=import-outside-toplevel
  kw = dict(return_entropy=True, return_raw_logprobs=True, return_kept=16,
            return_logprobs=True, num_samples=6, top_k=jnp.asarray(
                np.where(np.arange(cases.B) % 3, 20, 0), jnp.int32))
  got = fs.sample(cases.H, cases.W, cases.KEYS["per_row"], temperature=cases.T,
                  backend=CpuTritonBackend(), **kw)
  want = fs.reference.sample(cases.H, cases.W, cases.KEYS["per_row"],
                             temperature=cases.T, **kw)
  assert [s.samples for s in specs] == [4, 2]
  assert specs[0].entropy and specs[0].raw and specs[0].finite and specs[0].lse
  assert not any((specs[1].entropy, specs[1].raw, specs[1].finite, specs[1].lse,
                  specs[1].given, specs[1].top_k))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.kept_ids, want.kept_ids)
  np.testing.assert_array_equal(got.kept_count, want.kept_count)
  for name in ("logprob", "logprob_raw", "entropy", "entropy_truncated"):
    np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-5,
                               atol=1e-5, err_msg=name)


def test_calls_reporting_floats_run_the_batch_invariant_configs(monkeypatch):
  # docs/design.md, "Determinism and RL": log-probabilities, entropies and
  # scores come from the batch-invariant launches; calls for tokens and
  # kept sets (the same on every config) keep the faster table.
  seen = _record_launches(monkeypatch, "batch_invariant")
  from tests import cases  # pylint: disable=import-outside-toplevel
  run = lambda **kw: fs.sample(cases.H, cases.W, cases.KEYS["per_row"], temperature=cases.T,
                               backend=CpuTritonBackend(), **kw)
  for kw, want in ((dict(top_k=20, top_p=0.9), False), (dict(return_logprobs=True), True),
                   (dict(top_k=20, top_logprobs=3), True), (dict(return_entropy=True), True),
                   (dict(return_raw_logprobs=True), True),
                   (dict(top_p=0.9, return_kept=8), False)):
    seen.clear()
    run(**kw)
    assert seen == [want], kw
  seen.clear()
  fs.score_tokens(cases.H, cases.W, jnp.zeros((cases.B,), jnp.int32), temperature=cases.T,
                  backend=CpuTritonBackend())
  assert seen == [True]
  # batch_invariant=False: the per-B table for every call.
  seen.clear()
  fs.sample(cases.H, cases.W, cases.KEYS["per_row"], temperature=cases.T,
            backend=CpuTritonBackend(batch_invariant=False), return_logprobs=True)
  assert seen == [False]
  with pytest.raises(TypeError, match="batch_invariant"):
    CpuTritonBackend(batch_invariant="yes")


def test_invariant_configs_share_the_vocabulary_tiles():
  # One vocabulary tile on the M side for every batch size (what makes a
  # row's log-sum-exp the same bits); the batch block grows with B.
  cfgs = [triton_controls.invariant_config(b, 4096, 151936) for b in (1, 16, 17, 64, 65, 512)]
  assert {(c.block_v, c.vocab_on_m, c.block_d) for c in cfgs} == {(64, True, 128)}
  assert [c.block_b for c in cfgs] == [16, 16, 32, 64, 128, 128]
  c = triton_controls.pick_controls_config(
      3, 4096, 151936, (9, 0), triton_controls.Controls(samples=1, t_best=True, lse=True),
      batch_invariant=True)
  assert c == cfgs[0]
  # Every family's shared memory holds them, f32 hidden states included:
  # fewer stages first, the same vocabulary tiles.
  from pallas_kernels import triton_sampler as ts  # pylint: disable=import-outside-toplevel
  for cap in ((8, 0), (8, 9), (9, 0), (10, 0)):
    for itemsize, w_itemsize in ((2, 2), (4, 4), (2, 1)):
      c = triton_controls.invariant_config(512, 4096, 151936, capability=cap,
                                           itemsize=itemsize, w_itemsize=w_itemsize)
      assert c.smem_bytes(itemsize, w_itemsize) <= ts.SMEM_BYTES[ts.gpu_family(cap)], (cap, c)
      assert (c.block_v, c.vocab_on_m) == (64, True)
  assert triton_controls.invariant_config(512, 4096, 151936).num_stages == 4
  # An 8-bit [D, V] weight keeps its own table (no transposes in registers).
  c = triton_controls.pick_controls_config(
      3, 4096, 151936, (9, 0), triton_controls.Controls(samples=1, t_best=True, lse=True),
      w_itemsize=1, layout="dv", batch_invariant=True)
  assert not c.vocab_on_m


def test_score_tokens_is_bit_for_bit_what_sample_returned():
  # The same kernel outputs and stage 2 for both calls (tests/test_rl.py's
  # test on the streaming backends): random inputs, so that any other
  # summation order would show in the bits; the given ids reach the
  # kernel's launch. One case here (CI time); tests/test_triton_gpu.py runs
  # more on the kernels themselves.
  b, d, v = 16, 64, 1000
  h, w = inputs.random_inputs(b, d, v, seed=3, logit_std=3.0)
  t = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, b), jnp.float32).at[:2].set(0)
  keys = inputs.row_keys(b, seed=1)
  backend = CpuTritonBackend()
  for kw in (dict(top_k=50, top_p=0.9, softcap=20.0),):
    out = fs.sample(h, w, keys, temperature=t, backend=backend, return_logprobs=True,
                    return_entropy=True, return_raw_logprobs=True, **kw)
    sc = fs.score_tokens(h, w, out.tokens, temperature=t, backend=backend, **kw)
    for name in ("logprob", "logprob_truncated", "logprob_raw", "entropy",
                 "entropy_truncated"):
      a, c = np.asarray(getattr(out, name)), np.asarray(getattr(sc, name))
      np.testing.assert_array_equal(a.view(np.uint32), c.view(np.uint32), err_msg=name)
    assert np.all(np.asarray(sc.in_kept))
