"""The ``mosaic`` backend on a real Hopper GPU (every test marked ``gpu``).

Run on the H100 with ``PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu.py``;
tests/conftest.py skips these without a GPU. They exist because CPU interpret
mode misses races and lowering problems (docs/design.md, "Mosaic GPU facts").
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import flashsample_jax as fs
from flashsample_jax import controls, noise, problem
from flashsample_jax.backends import xla as xla_backend
from flashsample_jax.backends.mosaic import MosaicBackend
from pallas_kernels.sm90_config import Schedule, TuningConfig
from tests import cases, inputs
from tests.backend_suite import (BackendSuite, GpuSuite, check_exact_top, check_fused_penalties,
                                 check_top_lists,
                                 device_random_inputs, every_uniform_bits,
                                 mosaic_gumbel, penalty_kwargs)

pytestmark = pytest.mark.gpu


class TestMosaicGPU(BackendSuite, GpuSuite):
  backend = "mosaic"
  dtypes = [jnp.bfloat16, jnp.float16]


def _winning_scores(p, token, offset=0):
  """Exact f32 score of each row's token (see tests/test_mosaic.py)."""
  tok = np.asarray(token)
  l = np.asarray(jax.lax.dot_general(
      p.hidden.astype(jnp.float32), p.weight.astype(jnp.float32),
      (((1,), (1 if p.layout == "vd" else 0,)), ((), ())),
      precision=jax.lax.Precision.HIGHEST))
  rows = np.arange(tok.size)
  l_win = l[rows, tok - offset]
  hi, lo = noise.add_u32(p.ctr_hi, p.ctr_lo, jnp.asarray(tok, jnp.uint32))
  g = np.asarray(noise.gumbel(p.k0, p.k1, hi, lo))
  t = np.asarray(p.temperature)
  with np.errstate(divide="ignore", invalid="ignore"):
    sampled = (l_win / np.where(t == 0, np.float32(1), t)).astype(np.float32) + g
  return np.where(t == 0, l_win, sampled).astype(np.float32)


def test_kernel_noise_equals_xla_for_every_u():
  # The kernels' log (libdevice's logf core without its special-case
  # branches) against XLA's log, through the whole noise, on all 2**23
  # values of u: both logs see every input they can see.
  bits = every_uniform_bits()
  got = np.asarray(jax.jit(lambda b: mosaic_gumbel(b, interpret=False))(bits))
  want = np.asarray(jax.jit(noise.gumbel_from_bits)(bits))
  bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
  assert bad.size == 0, (bad.size, bad[:5], got.ravel()[bad[:5]], want.ravel()[bad[:5]])


# -- exact inputs at the sizes that matter for the traps --------------------


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("b", [8, 64, 130, 256, 300, 600])
def test_exact_large_batches(layout, b):
  # N=256 (trap 2's size), N=136 (Vt=64), B > 256 (chunks of 256).
  d, v = 512, 5000
  h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=b)
  t = inputs.pow2_temperatures(b, greedy_every=5, seed=b)
  for key in (jax.random.key(b), inputs.row_keys(b, seed=b)):
    got = fs.sample(h, w, key, temperature=t, weight_layout=layout,
                    backend="mosaic")
    want = fs.reference.sample(h, w, key, temperature=t, weight_layout=layout)
    np.testing.assert_array_equal(got, want)


_CONFIGS = [
    TuningConfig(tile_v=64, tile_d=64, max_concurrent_steps=2, epi_cols=8),
    TuningConfig(tile_v=64, tile_d=128, max_concurrent_steps=3, epi_cols=16,
                 epi_unroll=2),
    TuningConfig(tile_v=128, tile_d=128, max_concurrent_steps=2, epi_cols=16),
    TuningConfig(tile_v=128, tile_d=64, max_concurrent_steps=4, epi_cols=8,
                 epi_unroll=4, num_ctas=7),
    # Two compute warpgroups (per-warpgroup reduction scratch: docs/design.md).
    TuningConfig(tile_v=128, tile_d=64, max_concurrent_steps=3, epi_cols=16,
                 epi_unroll=2, compute_wgs=2, epi_passes=3),
    TuningConfig(tile_v=256, tile_d=64, max_concurrent_steps=2, epi_cols=8,
                 compute_wgs=2, epi_passes=2, num_ctas=5),
    # Ping-pong (two warpgroups on alternate tiles, one ring of slots):
    # 16 steps per tile over 3 slots; 24 tiles on 5 CTAs; unrolled twice.
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=128, tile_d=64,
                 max_concurrent_steps=3, epi_cols=16, epi_unroll=2,
                 num_ctas=5),
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=128, tile_d=128,
                 max_concurrent_steps=2, epi_cols=8),
    # Batch on the wgmma M side (N=96 padded to 128), 24 tiles on 5 CTAs.
    TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128, tile_d=64,
                 max_concurrent_steps=3, epi_cols=16, num_ctas=5),
    TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=64, tile_d=128,
                 max_concurrent_steps=2, epi_cols=8, epi_unroll=2),
    # The heuristic's N = 128 settings: chunks of [128, 8], each slot
    # released as soon as its wgmma is done.
    TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128, tile_d=64,
                 max_concurrent_steps=4, epi_cols=8, mma_in_flight=0),
    # Ping-pong with a buffer per warpgroup (the N > 128 schedule), in
    # uneven passes (2 + 3 + 3 chunks of N = 128).
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=64, tile_d=64,
                 max_concurrent_steps=4, epi_cols=16, epi_passes=3),
]


@pytest.mark.parametrize("cfg", _CONFIGS, ids=str)
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_configs_exact_scores(cfg, layout):
  # Scores, not only tokens, bit for bit against the xla backend on the
  # same GPU, for power-of-two temperatures and the others (the kernel
  # multiplies by XLA's reciprocal, which equals XLA's division:
  # docs/design.md, "Division"), with libdevice logf against XLA's log.
  b = 128 if cfg.tile_v == 64 else 96
  d, v = 1024, 3001
  h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=7)
  pow2 = inputs.pow2_temperatures(b, greedy_every=5, seed=7)
  other = jnp.asarray(np.r_[0.0, np.linspace(0.3, 3.0, b - 1)], jnp.float32)
  for t in (pow2, other):
    p = problem.prepare(h, w, inputs.row_keys(b, seed=7), temperature=t,
                        weight_layout=layout, vocab_size=2990)
    # The problem is an argument of both programs: a temperature that is a
    # constant of the program has its reciprocal folded at compile time.
    got = jax.jit(lambda p: MosaicBackend(config=cfg).candidates(p))(p)
    want = jax.jit(lambda p: xla_backend.candidates(p))(p)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


_PENALTY_SETS = {"all": ("repetition_penalty", "presence_penalty", "frequency_penalty"),
                 "frequency": ("frequency_penalty",),
                 "repetition_frequency": ("repetition_penalty", "frequency_penalty"),
                 "presence": ("presence_penalty",)}


@pytest.mark.parametrize("penalties", list(_PENALTY_SETS))
@pytest.mark.parametrize("b,out_width", [(1, 30), (64, 256), (200, 30)])
def test_penalties_in_the_kernel_bit_for_bit(b, out_width, penalties):
  # The kernel's penalties divide and round as XLA does on the GPU
  # (div.full.f32, no fma): best scores, tempered logits and listed
  # candidates equal the dense penalized logits' bit for bit, at common
  # temperatures, with history ids among the winners; B = 200 runs in
  # blocks of 64 with lists.
  d, v = 512, 4001
  h, w = inputs.exact_inputs(b, d, v, seed=b)
  t = jnp.asarray(np.resize([0.7, 0.6, 1.3, 0.0, 1.0], b), jnp.float32)
  kw = penalty_kwargs(b, v, seed=b, out_width=out_width)
  kw = {k: x for k, x in kw.items()
        if k.endswith("_ids") or k in _PENALTY_SETS[penalties]}
  won = check_fused_penalties(MosaicBackend(), h, w, jax.random.key(b), t, kw)
  if b >= 64:   # history ids among the winners (many where r < 1 boosts them)
    assert won >= (b // 8 if "repetition_penalty" in kw else 1)


def _controls_best_matches_xla(h, w, key, t):
  """The controls kernel's and the xla backend's states for top_k=40 with
  log-probabilities (with the pass's noise: ``c``, not ``c.for_pass()``),
  after checking that each row's best id, score and tempered logit agree
  bit for bit."""
  b, v = h.shape[0], w.shape[0]
  p = problem.prepare(h, w, key, temperature=t)
  c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, top_k=40,
                                return_logprobs=True)
  got = jax.jit(lambda p, c: MosaicBackend().controls_state(p, c))(p, c)
  want = jax.jit(lambda p, c: xla_backend.controls_state(p, c))(p, c)
  for name in ("best_id", "best_score", "best_t"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                  np.asarray(getattr(want, name)), err_msg=name)
  return got, want


@pytest.mark.parametrize("t", [0.6, 0.7, 1.3])
def test_controls_scores_with_common_temperatures(t):
  # The controls kernel's best scores and tempered logits equal the xla
  # backend's bit for bit at the temperatures people use.
  b, d, v = 64, 512, 4001
  h, w = inputs.exact_inputs(b, d, v, seed=8)
  got, want = _controls_best_matches_xla(h, w, jax.random.key(8), t)
  # The kernel's candidate lists are bounded (values at or below its bound
  # are -inf); above the bound and above the last listed value (whose
  # equals may be cut at the list's end differently) they hold the exact
  # lists' entries, bit for bit. Equal values may come in another order
  # (the lists are ordered by value only), so each row's entries are
  # compared sorted by (t, id).
  bound = np.maximum(np.asarray(got.cand_bound), np.asarray(got.cand_vals)[:, -1])[:, None]
  for vals, ids, name in ((got.cand_vals, got.cand_ids, "kernel"),
                          (want.cand_vals, want.cand_ids, "xla")):
    vals, ids = np.asarray(vals), np.asarray(ids)
    above = vals > bound
    order = np.lexsort((np.where(above, ids, np.iinfo(np.int32).max),
                        -np.where(above, vals, -np.inf)), axis=1)
    sorted_ = (np.take_along_axis(np.where(above, vals, -np.inf), order, axis=1),
               np.take_along_axis(np.where(above, ids, -1), order, axis=1))
    if name == "kernel":
      kernel = sorted_
  np.testing.assert_array_equal(kernel[0], sorted_[0])
  np.testing.assert_array_equal(kernel[1], sorted_[1])


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("b", [200, 512, 1024])
def test_batch_blocks_exact_scores(layout, b):
  # The heuristic's batch blocks (2, 4 and 8 blocks of 128 rows; Dt = 64
  # and 128): tokens and scores bit for bit against the xla backend at the
  # temperatures people use, with greedy rows.
  d, v = 512, 5003
  h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=b)
  from pallas_kernels import sm90_sampler
  assert sm90_sampler.launches(b, d, v + 5, 2)[0][2].batch_blocks == -(-b // 128)
  for t in (0.6, 0.7, 1.3):
    temp = jnp.full((b,), t, jnp.float32).at[::9].set(0.0)
    p = problem.prepare(h, w, inputs.row_keys(b, seed=b), temperature=temp,
                        weight_layout=layout, vocab_size=5000)
    got = jax.jit(lambda p: MosaicBackend().candidates(p))(p)
    want = jax.jit(lambda p: xla_backend.candidates(p))(p)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("b,passes,in_flight", [(256, 2, 0), (256, 4, 1), (512, 4, 1)])
def test_epilogue_passes_exact_scores(layout, b, passes, in_flight):
  # The batch-major epilogue in passes (a smaller accumulator buffer, more
  # slots), with and without a wgmma in flight: tokens and scores bit for
  # bit against the xla backend, greedy rows among them.
  import dataclasses
  from pallas_kernels import sm90_config
  d, v = 512, 5003
  h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=b + passes)
  cfg = dataclasses.replace(sm90_config.pick_blocked_config(b, d, v + 5),
                            epi_passes=passes, mma_in_flight=in_flight)
  cfg = max((dataclasses.replace(cfg, max_concurrent_steps=s) for s in range(2, 9)
             if dataclasses.replace(cfg, max_concurrent_steps=s).smem_bytes(128)
             <= sm90_config.SMEM_BUDGET), key=lambda c: c.max_concurrent_steps)
  for t in (0.6, 1.3):
    temp = jnp.full((b,), t, jnp.float32).at[::9].set(0.0)
    p = problem.prepare(h, w, inputs.row_keys(b, seed=b), temperature=temp,
                        weight_layout=layout, vocab_size=5000)
    got = jax.jit(lambda p: MosaicBackend(config=cfg).candidates(p))(p)
    want = jax.jit(lambda p: xla_backend.candidates(p))(p)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.parametrize("b", [130, 256])
def test_controls_batch_blocks_match_xla(b):
  # Truncation at B > 64: one launch of ceil(B / 64) blocks; the best of
  # each row (with the noise: c itself, not c.for_pass()) equals the xla
  # backend's, and the tokens (without the noise, and with it: rows with
  # top-k off) the reference's.
  d, v = 512, 4001
  h, w = inputs.exact_inputs(b, d, v, seed=b)
  _controls_best_matches_xla(h, w, jax.random.key(b), 0.7)
  some_off = jnp.asarray(np.where(np.arange(b) % 7 == 3, 0, 40), jnp.int32)
  for kw in (dict(top_k=40, top_p=0.9), dict(top_k=some_off)):
    np.testing.assert_array_equal(
        fs.sample(h, w, jax.random.key(b), temperature=0.7, backend="mosaic", **kw),
        fs.reference.sample(h, w, jax.random.key(b), temperature=0.7, **kw))


@pytest.mark.parametrize("b,runs", [(256, 5), (16, 10)])
def test_repeated_runs_identical(b, runs):
  # A race shows as results that move between runs. B = 16: one launch of
  # 2 x 132 warpgroups, each with its running best over its tiles.
  d, v = 4096, 151936
  h, w = device_random_inputs(b, d, v, seed=11)
  f = jax.jit(lambda h, w: MosaicBackend().candidates(
      problem.prepare(h, w, jax.random.key(11), temperature=0.8)))
  first = jax.device_get(f(h, w))
  for _ in range(runs):
    again = jax.device_get(f(h, w))
    np.testing.assert_array_equal(again[0], first[0])
    np.testing.assert_array_equal(again[1], first[1])


@pytest.mark.parametrize("b", [1, 5, 8, 9, 16, 17, 33, 48])
def test_running_best_per_warpgroup_equals_xla_scores(b):
  # Up to 48 rows (three chunks of columns) each compute warpgroup keeps its
  # best over its tiles (sm90_sampler.per_warpgroup): scores and ids bit for bit against the
  # xla backend, with greedy rows, a NaN row, a row of equal logits (zero
  # hidden, greedy: the tie rule's lowest id) and a cut vocabulary.
  p = inputs.edge_rows_problem(b, 1024, 3001, seed=20 + b)
  got = jax.jit(lambda p: MosaicBackend().candidates(p))(p)
  want = jax.jit(lambda p: xla_backend.candidates(p))(p)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert int(got[1][0]) == 0


def test_traced_vocab_offset():
  b, d, v = 40, 256, 3000
  h, w = inputs.exact_inputs(b, d, v, seed=12)
  p = problem.prepare(h, w, jax.random.key(12), vocab_size=v)
  p = dataclasses.replace(p, vocab_size=7000)
  for offset in (0, 2000, 5000):
    off = jnp.int32(offset)
    got = jax.jit(lambda o: MosaicBackend().candidates(p, vocab_offset=o))(off)
    want = jax.jit(lambda o: xla_backend.candidates(p, vocab_offset=o))(off)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    if offset <= 4000:
      np.testing.assert_array_equal(np.asarray(got[0]),
                                    _winning_scores(p, got[1], offset))


# -- distribution: chi-square against softmax ----------------------------------


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_chi_square_against_softmax(layout):
  # 256 identical hidden rows with per-row keys: 256 independent draws per
  # call, 48 calls (12288 draws) from one softmax over an odd V. Bins with
  # expected count < 5 are pooled. Threshold p > 1e-3: with fixed seeds the
  # test is deterministic, and a real bias of the size a wrong counter or
  # key gives (whole rows of correlated noise) yields p ~ 0.
  b, d, v = 256, 128, 1001
  h1, w = inputs.random_inputs(1, d, v, layout=layout, seed=21, logit_std=2.0)
  h = jnp.broadcast_to(h1, (b, d))
  temp = 0.9
  f = jax.jit(lambda k: fs.sample(h, w, k, temperature=temp,
                                  weight_layout=layout, backend="mosaic"))
  counts = np.zeros(v, np.int64)
  for i in range(48):
    keys = jax.random.split(jax.random.key(1000 + i), b)
    counts += np.bincount(np.asarray(f(keys)), minlength=v)
  contract = 1 if layout == "vd" else 0
  l = jax.lax.dot_general(h1, w, (((1,), (contract,)), ((), ())),
                          preferred_element_type=jnp.float32)[0]
  prob = np.asarray(jax.nn.softmax(l / temp), np.float64)
  expected = prob * counts.sum()
  order = np.argsort(expected)
  # Pool the smallest bins together until each pooled bin expects >= 5.
  obs_bins, exp_bins, acc_o, acc_e = [], [], 0, 0.0
  for i in order:
    acc_o += counts[i]
    acc_e += expected[i]
    if acc_e >= 5:
      obs_bins.append(acc_o)
      exp_bins.append(acc_e)
      acc_o, acc_e = 0, 0.0
  if acc_e > 0:
    obs_bins[-1] += acc_o
    exp_bins[-1] += acc_e
  res = stats.chisquare(obs_bins, np.asarray(exp_bins) * sum(obs_bins) / sum(exp_bins))
  assert res.pvalue > 1e-3, (res, len(obs_bins))


@pytest.mark.parametrize("b", [1, 16, 64])
def test_balanced_grid_on_llama_vocabulary(b):
  # L's vocabulary: 1002 tiles of 128 rows, which the heuristic spreads over
  # 126 CTAs on a 132-SM GPU (sm90_config.balanced_ctas): vocabulary on M
  # at B <= 16, batch on M at 64; exact inputs, shared and per-row keys.
  from pallas_kernels.sm90_config import balanced_ctas
  from pallas_kernels.sm90_common import device_num_sms
  d, v = 512, 128256
  assert balanced_ctas(-(-v // 128), device_num_sms()) < device_num_sms()
  h, w = inputs.exact_inputs(b, d, v, seed=b)
  t = inputs.pow2_temperatures(b, greedy_every=5, seed=b)
  for key in (jax.random.key(b), inputs.row_keys(b, seed=b)):
    got = fs.sample(h, w, key, temperature=t, backend="mosaic")
    want = fs.reference.sample(h, w, key, temperature=t)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("b", [16, 100, 200])
def test_rl_outputs_equal_reference(b):
  # The controls kernel's RL fields: 64-row launches with lists, 128-row
  # ones without (B = 100, 200), batch blocks (B = 200), and a penalty.
  cases.check_rl_on_exact_inputs("mosaic", b, penalty=True)


def test_float_outputs_are_batch_invariant():
  # The batch-invariant split (docs/design.md, "Determinism and RL"): a
  # row's tokens and float bits in calls of 1 to 200 rows as in one of 260
  # (five blocks of 64, two launches with lists).
  cases.check_batch_invariance("mosaic")


def test_kept_log_probabilities_are_batch_invariant_on_a_qwen3_head():
  # Qwen3-1.7B's head with its top-k 20 + top-p 0.95: the kept set's
  # log-sum-exp and entropy over the candidates are summed in a fixed
  # order (stage2.fixed_logsumexp); with jnp.sum, XLA's reduction on a
  # GPU followed the batch's shape and 1-2 rows in 100 lost bits of
  # logprob_truncated (docs/performance.md, "RL outputs and batch
  # invariance").
  cases.check_batch_invariance("mosaic", batches=(64, 100), full=512, dim=2048,
                               vocab=151936, modes=("qwen3_topk_topp",))


def test_heuristic_runs_every_bucket():
  # Compile and run every N bucket once on a small head (exact inputs).
  d, v = 256, 1000
  _, w = inputs.exact_inputs(1, d, v, seed=30)
  for n in range(8, 257, 8):
    b = n - 5 if n > 8 else 3
    h, _ = inputs.exact_inputs(b, d, 8, seed=n)
    key = jax.random.key(n)
    got = fs.sample(h, w, key, temperature=2.0, backend="mosaic")
    want = fs.reference.sample(h, w, key, temperature=2.0)
    np.testing.assert_array_equal(got, want, err_msg=f"N={n}")


# -- sampling controls at the benchmark shape ---------------------------------


@pytest.mark.parametrize("b", [1, 64])
def test_controls_fallback_stays_in_the_cuda_graph(b):
  # The exact fallback sits in a lax.cond. A CUB radix sort (XLA's rewrite
  # of a one-key sort of 1-2 operands at these sizes) cannot be held in a
  # CUDA graph, and then XLA decides the conditional on the host on every
  # call (up to ~150 us per call at B=64). keep_mask sorts with two keys to
  # keep XLA's own sort kernel; this checks the compiled program.
  d, v = 4096, 151936
  h, w = device_random_inputs(b, d, v, seed=7)
  f = jax.jit(lambda h, w, k: fs.sample(h, w, k, top_k=50, top_p=0.9, backend="mosaic"))
  hlo = f.lower(h, w, jax.random.key(7)).compile().as_text()
  assert "conditional(" in hlo
  targets = re.findall(r'custom_call_target="([^"]*)"', hlo)
  assert "mosaic_gpu_v2" in targets        # the check reads real call targets
  # A CUB sort ("__cub$DeviceRadixSort...", "...cub_sort..."); cuBLAS calls
  # ("__cublas$lt$matmul", the exact path's GEMM) live in graphs.
  cub = re.compile(r"(^|[^a-z])cub([^a-z]|$)")
  assert not [t for t in targets if cub.search(t.lower()) or "sort" in t.lower()], targets


@pytest.mark.parametrize("b,d,v,kw", [
    (64, 4096, 151936, {}),
    (37, 256, 5000, dict(logit_bias=1, allowed_mask=1)),
    (37, 256, 5000, dict(logit_bias=1, allowed_mask=1, softcap=20.0)),
    (200, 256, 5000, dict(repetition_penalty=1.3, presence_penalty=0.5,
                          frequency_penalty=0.25)),
], ids=["S_B64", "bias_mask", "softcap", "penalties_blocks"])
def test_exact_top_bit_for_bit(b, d, v, kw):
  # top_logprobs' early-exit exact path (the controls kernel materializing
  # t, then the top-N kernel) with some rows flagged: ids and values equal
  # XLA's top_n of the reference's tempered logits bit for bit, with
  # temperatures that round (0.6, 0.7, 1.3), greedy rows, and NaN / inf
  # logits from the bias. The soft-cap is not bit for bit (docs/design.md,
  # "Soft-capping"): its values within 2 ulp.
  h, w = inputs.exact_inputs(b, d, v, seed=b)
  t = jnp.asarray(np.resize([0.7, 0.6, 1.3, 0.0, 1.0], b), jnp.float32)
  r = np.random.default_rng(b)
  kw = dict(kw)
  if "logit_bias" in kw:
    kw["logit_bias"] = (jnp.asarray(r.normal(size=v), jnp.float32)
                        .at[3].set(jnp.inf).at[7].set(jnp.nan))
    kw["allowed_mask"] = jnp.asarray(r.integers(0, 2**32, (b, -(-v // 32)), dtype=np.uint32))
  if "repetition_penalty" in kw:
    kw["prompt_ids"] = jnp.asarray(r.integers(-1, v, (b, 40)), jnp.int32)
    kw["output_ids"] = jnp.asarray(r.integers(0, 300, (b, 64)), jnp.int32)
  check_exact_top(MosaicBackend(), h, w, jax.random.key(b), t, kw,
                  rows=np.arange(0, b, 3), exact_values="softcap" not in kw)


@pytest.mark.parametrize("b", [1, 16, 64])
def test_exact_top_bit_for_bit_with_an_fp8_head(b):
  # An 8-bit head's exact top N runs the pass's config (the wide epilogue
  # where the pass takes it; the weight's Dt follows it): ids and values
  # equal XLA's top_n of the reference's tempered logits bit for bit.
  h, w, scale = inputs.quantized_inputs(b, 4096, 151936, seed=b)
  t = jnp.asarray(np.resize([0.7, 0.6, 1.3, 0.0, 1.0], b), jnp.float32)
  check_exact_top(MosaicBackend(), h, w, jax.random.key(b), t, {},
                  rows=np.arange(0, b, 3), weight_scale=scale)


@pytest.mark.parametrize("length,m", [(924, 28), (1000, 21), (20, 28)])
def test_top_lists_kernel_equals_the_two_key_sort(length, m):
  # The selection kernel compiled for the GPU, bit for bit against XLA's
  # two-key sort (the edge rows of check_top_lists).
  from pallas_kernels import sm90_common
  check_top_lists(length, m, sm90_common.Target())


def test_top_logprobs_compiles_without_a_conditional():
  # top_logprobs alone takes the early-exit kernels, not lax.cond: the
  # compiled program has no conditional (its CUDA graph node alone cost
  # more than the two launches).
  h, w = device_random_inputs(64, 4096, 151936, seed=8)
  f = jax.jit(lambda h, w, k: fs.sample(h, w, k, top_logprobs=20, backend="mosaic"))
  hlo = f.lower(h, w, jax.random.key(8)).compile().as_text()
  assert "conditional(" not in hlo
  # The controls kernel, the lists' selection, the materializing launch
  # and the top-N kernel.
  targets = re.findall(r'custom_call_target="([^"]*)"', hlo)
  assert targets.count("mosaic_gpu_v2") == 4, targets
