"""The ``mosaic`` backend on the CPU: interpret mode, CUDA lowering, configs.

Interpret mode runs the real Pallas Mosaic GPU kernels on the CPU
(``MosaicBackend(interpret=True)``; it misses races and accepts some ops that
do not lower), so the CUDA lowering of every config the heuristic can pick
is checked separately (``MosaicBackend(assume_sm90=True)`` under
``h100_lowering``), and the GPU tests (tests/test_mosaic_gpu.py) run the same
suite on an H100.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import backends, controls, noise, problem, stage2
from flashsample_jax.backends import mosaic as mosaic_backend
from flashsample_jax.backends import xla as xla_backend
from flashsample_jax.backends.mosaic import MosaicBackend, h100_lowering
from pallas_kernels import sm90_common, sm90_config, sm90_controls, sm90_sampler, sm90_top
from pallas_kernels.sm90_config import Schedule, TuningConfig
from tests import inputs
from tests.backend_suite import (BackendSuite, check_exact_top, check_fused_penalties,
                                 check_top_lists, every_uniform_bits,
                                 mosaic_gumbel, penalty_kwargs)
from tests.cases import B, CASES, D, H, KEYS, T, V, W
from tests.conftest import has_gpu

INTERPRET = MosaicBackend(interpret=True)
LOWER = MosaicBackend(assume_sm90=True)


class TestMosaicInterpret(BackendSuite):
  backend = INTERPRET
  # f32 weights raise NotImplementedError (tested below); D a multiple of 64.
  dtypes = [jnp.bfloat16, jnp.float16]
  # The suite's shapes, with V kept small where interpretation is slow; still
  # B not a multiple of 8 and V a multiple of no tile.
  shapes = [(1, 64, 200), (5, 64, 1000), (16, 128, 517), (37, 64, 650)]
  random_shapes = [(64, 128, 1500), (29, 256, 1100)]
  # top_logprobs with truncation and penalties reach the kernel as candidate
  # lists and an allowed mask, which "penalties_all" runs together (with
  # every other control); on the GPU every case runs. top_logprobs alone
  # runs: its uncertified rows take the early-exit kernels, not lax.cond.
  # truncation_order="vllm" is stage 2's rule on the lists (the same for
  # every backend); the kernel's lists for top-p with min-p are k_p_minp's.
  # The bias, the soft-cap and the mask reach the kernel as they do in
  # "all" (CI time), a scalar top-k as "k_p_minp"'s.
  covered_cases = {"top_logprobs_truncated": "penalties_all", "penalties": "penalties_all",
                   "p_minp_vllm": "k_p_minp", "bias": "all", "softcap": "all",
                   "mask": "all", "top_k_scalar": "k_p_minp"}
  # "penalties_all" runs top-k, top-p and min-p with every other control
  # (CI time).
  covered_sample_cases = {"top_k": "penalties_all", "top_p": "penalties_all",
                          "all": "penalties_all"}
  # Per-row keys with a per-row truncation rule, with every control
  # together, and with the penalties (CI time; on the GPU every case runs).
  row_key_cases = frozenset({"top_k", "all", "penalties_all"})
  # The greedy top 128 of test_top_logprobs_edges on 8 rows (every row
  # flagged to the early-exit top-N kernel, one CTA per row; CI time).
  greedy_top_rows = 8
  # The suite's quantized heads on e4m3 here (CI time): every 8-bit dtype
  # runs through every path and schedule in tests/test_quantized_mosaic.py
  # (interpret mode, scores against the xla backend); on the GPU all three.
  quantized_dtypes = (jnp.float8_e4m3fn,)
  # Scores of the tokens sample drew, bit for bit, on one case (CI time;
  # the GPU suites run every score case).
  score_cases = ("k_p_minp",)


SUITE = TestMosaicInterpret()


def _interpret_candidates(p, **kw):
  # Jitted, as the samplers run it: one interpret-mode program (called
  # op by op, the kernel would be compiled again on every call).
  return jax.block_until_ready(
      jax.jit(MosaicBackend(interpret=True, **kw).candidates)(p))


# The xla backend's candidates, as its sampler runs them (jitted).
_xla_candidates = jax.jit(xla_backend.candidates)


def _winning_scores(p, token, offset=0):
  """f32 score of each row's returned token, divided by T in NumPy (IEEE).

  Exact inputs make the logits exact, so the kernel's score must equal this
  bit for bit. (XLA on the CPU may turn ``l / T`` into ``l * (1 / T)``, which
  is 1 ulp off for some T: seen with the xla backend's scores, never with its
  tokens on these inputs.)
  """
  tok = np.asarray(token)
  # Exact in float64 (small integers), so exactly XLA's f32 logits (NaN and
  # inf as well).
  w = np.asarray(p.weight, np.float64)
  with np.errstate(invalid="ignore"):
    l = (np.asarray(p.hidden, np.float64) @ (w.T if p.layout == "vd" else w)
         ).astype(np.float32)
  rows = np.arange(tok.size)
  l_win = l[rows, tok - offset]
  hi, lo = noise.add_u32(p.ctr_hi, p.ctr_lo, jnp.asarray(tok, jnp.uint32))
  g = np.asarray(noise.gumbel(p.k0, p.k1, hi, lo))
  t = np.asarray(p.temperature)
  with np.errstate(divide="ignore", invalid="ignore"):
    sampled = (l_win / np.where(t == 0, np.float32(1), t)).astype(np.float32) + g
  return np.where(t == 0, l_win, sampled).astype(np.float32)


def _assert_same_candidates(got, want, p, offset=0):
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]),
                                _winning_scores(p, got[1], offset))


# Each config is run once on exact inputs whose V is a multiple of no tile,
# with non-power-of-two temperatures (true division must match bit for bit).
_CONFIGS = [
    TuningConfig(tile_v=64, tile_d=64, max_concurrent_steps=2, epi_cols=8),
    TuningConfig(tile_v=128, tile_d=128, max_concurrent_steps=3, epi_cols=8,
                 epi_unroll=3),
    TuningConfig(tile_v=192, tile_d=64, max_concurrent_steps=1, epi_cols=8),
    # Two compute warpgroups, the accumulator in uneven passes (1 + 2 chunks).
    TuningConfig(tile_v=128, tile_d=64, max_concurrent_steps=2, epi_cols=8,
                 compute_wgs=2, epi_passes=2),
    # Ping-pong: 4 steps per tile over 3 slots (a tile's steps change owner
    # mid-ring); 6 tiles on 4 CTAs (one or two tiles per CTA).
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=128, tile_d=64,
                 max_concurrent_steps=3, epi_cols=8),
    # Ping-pong, 11 tiles on 3 CTAs (4, 4, 3 tiles: both warpgroups end on
    # either parity), 3 chunks per unrolled iteration, 2 steps per tile over
    # 2 slots.
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=64, tile_d=128,
                 max_concurrent_steps=2, epi_cols=8, epi_unroll=3,
                 num_ctas=3),
    # Batch on M (N=21 padded to 64): running best over chunks and tiles.
    TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128, tile_d=64,
                 max_concurrent_steps=3, epi_cols=8),
    # Batch on M, 11 tiles of 64 on 3 CTAs, two chunks per iteration.
    TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=64, tile_d=128,
                 max_concurrent_steps=2, epi_cols=16, epi_unroll=2,
                 num_ctas=3),
    # Each slot released as soon as its wgmma is done: a ring of one slot
    # (vocabulary on M) and, batch on M, of two.
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=64, tile_d=64,
                 max_concurrent_steps=1, epi_cols=8, num_ctas=3,
                 mma_in_flight=0),
    TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128, tile_d=64,
                 max_concurrent_steps=2, epi_cols=16, mma_in_flight=0),
    # Ping-pong with a buffer per warpgroup, in uneven passes (1 + 2 chunks
    # of N=24), 11 tiles on 3 CTAs.
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=64, tile_d=64,
                 max_concurrent_steps=3, epi_cols=8, epi_passes=2,
                 num_ctas=3, mma_in_flight=0),
    # Batch on M in 2 blocks of 64 rows (N=21 in the first, the second all
    # padding), 11 tiles over 2 CTAs per block (num_ctas 5 -> 2 x 2).
    TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=64, tile_d=64,
                 max_concurrent_steps=2, epi_cols=8, mma_in_flight=0,
                 batch_blocks=2, num_ctas=5),
]


# "dv" (W stored [D, V]) on every other config (CI time: its transposed
# tiles are the same shared-memory descriptors whatever the schedule).
@pytest.mark.parametrize("layout,cfg", [
    (layout, cfg) for i, cfg in enumerate(_CONFIGS)
    for layout in (("vd", "dv") if i % 2 == 0 else ("vd",))], ids=str)
def test_configs_match_xla_scores(cfg, layout):
  b, d, v = 21, 256, 700
  h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=3)
  t = jnp.asarray(np.r_[0.0, np.linspace(0.3, 3.0, b - 1)], jnp.float32)
  p = problem.prepare(h, w, jax.random.key(3), temperature=t,
                      weight_layout=layout, vocab_size=690)
  got = _interpret_candidates(p, config=cfg)
  _assert_same_candidates(got, _xla_candidates(p), p)


def test_balanced_grid_keeps_the_rounds_with_the_fewest_ctas():
  from pallas_kernels import sm90_common
  from pallas_kernels.sm90_config import balanced_ctas
  # L's head: 1002 tiles take 8 rounds over 132 SMs, and so do 126 CTAs;
  # S's 1187 and gpt-oss's 1571 tiles are balanced already.
  assert balanced_ctas(1002, 132) == 126
  assert balanced_ctas(1187, 132) == 132 and balanced_ctas(1571, 132) == 131
  for tiles in range(1, 400):
    for ctas in (1, 3, 4, 7, 132):
      got = balanced_ctas(tiles, ctas)
      rounds = -(-tiles // min(ctas, tiles))
      assert 1 <= got <= min(ctas, tiles) and -(-tiles // got) == rounds
      assert got == 1 or -(-tiles // (got - 1)) > rounds, (tiles, ctas)
  # Launches: the heuristic's single-block ones are balanced (plain and
  # controls kernels alike); a config's own count and batch blocks' share
  # of the SMs are kept.
  target = sm90_common.Target(num_sms=132)
  vm = TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=128, tile_d=128)
  assert target.grid_ctas(vm, 1002) == 126 and target.grid_ctas(vm, 1187) == 132
  assert target.grid_ctas(dataclasses.replace(vm, num_ctas=132), 1002) == 132
  blocks = TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128, tile_d=64,
                        batch_blocks=2)
  assert target.grid_ctas(blocks, 1002) == 66


@pytest.mark.parametrize("b", [5, 50])
def test_heuristic_grid_is_balanced(b):
  # 5 tiles of 128 rows over interpret mode's 4 CTAs take 2 rounds, so the
  # heuristic's launch runs 3 CTAs (vocabulary on M at 5 rows, batch on M
  # at 50, whose candidates are one per CTA's warpgroup); exact inputs,
  # non-power-of-two temperatures, a vocabulary that ends inside a tile.
  from pallas_kernels import sm90_sampler
  from pallas_kernels.sm90_config import balanced_ctas
  d, v = 128, 600
  ((_, _, cfg, _),) = sm90_sampler.launches(b, d, 640, 2)
  assert cfg.num_ctas is None and cfg.tile_v == 128
  assert balanced_ctas(640 // 128, 4) == 3
  h, w = inputs.exact_inputs(b, d, v, seed=b)
  t = jnp.asarray(np.r_[0.0, np.linspace(0.3, 3.0, b - 1)], jnp.float32)
  p = problem.prepare(h, w, jax.random.key(b), temperature=t, vocab_size=597)
  _assert_same_candidates(_interpret_candidates(p), _xla_candidates(p), p)


def test_batch_over_192_runs_in_blocks():
  # 300 rows: the heuristic's one launch of 3 blocks of 128 rows.
  from pallas_kernels import sm90_sampler
  (launch,) = sm90_sampler.launches(300, 64, 136, 2)
  assert launch[2].batch_blocks == 3 and launch[3] == 128
  b, d, v = 300, 64, 130
  h, w = inputs.exact_inputs(b, d, v, seed=4)
  t = inputs.pow2_temperatures(b, greedy_every=7, seed=4)
  for key in (jax.random.key(4), inputs.row_keys(b, seed=4)):
    p = problem.prepare(h, w, key, temperature=t)
    _assert_same_candidates(_interpret_candidates(p), _xla_candidates(p),
                            p)


def test_blocked_config_by_device_kind():
  # Two blocks take Dt = 128 in 2 slots on an H200 (measured faster there),
  # Dt = 64 elsewhere; from three blocks every sm90 device takes Dt = 128.
  from pallas_kernels import devices, sm90_config
  cfg = lambda b, kind: sm90_config.pick_blocked_config(b, 4096, 151936, 2, kind)
  for kind in ("NVIDIA H200", "NVIDIA H200 NVL"):
    assert cfg(256, kind).tile_d == 128 and cfg(256, kind).max_concurrent_steps >= 2
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", ""):
    assert cfg(256, kind).tile_d == 64, kind
  for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
    assert cfg(384, kind).tile_d == 128 and cfg(384, kind).batch_blocks == 3
  # From D = 8192 the epilogue in 4 passes frees SMEM for more slots, and a
  # wgmma stays in flight; below, one pass and none in flight.
  for b, kind, dt, slots in ((256, "NVIDIA H100 80GB HBM3", 64, 6),
                             (512, "NVIDIA H100 80GB HBM3", 128, 3),
                             (256, "NVIDIA H200", 128, 3)):
    deep = sm90_config.pick_blocked_config(b, 8192, 128256, 2, kind)
    assert (deep.tile_d, deep.max_concurrent_steps, deep.epi_passes,
            deep.mma_in_flight) == (dt, slots, 4, 1), (b, kind)
    deep.check_problem(n=128, dim=8192, rows=128256)
  for b in (256, 512):
    flat = cfg(b, "NVIDIA H100 80GB HBM3")
    assert (flat.epi_passes, flat.mma_in_flight) == (1, 0)
  # D not a multiple of 128 keeps Dt = 64 on every device.
  assert sm90_config.pick_blocked_config(256, 2880, 201088, 2, "NVIDIA H200").tile_d == 64
  assert devices.is_kind("NVIDIA H200", "NVIDIA H200")
  assert not devices.is_kind("NVIDIA GH200 480GB", "NVIDIA H200")
  # Without a kind the abstract mesh's device decides (as for the SM count).
  h200 = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H200", platform="gpu", num_cores=132))
  with jax.sharding.use_abstract_mesh(h200):
    assert devices.device_kind() == "NVIDIA H200"
    assert sm90_config.pick_blocked_config(256, 4096, 151936).tile_d == 128


@pytest.mark.parametrize("blocks,passes,in_flight,b", [(2, 4, 1, 150), (3, 1, 0, 130)])
def test_batch_blocks_share_one_launch(blocks, passes, in_flight, b):
  # Rows in blocks of 64 (the last partly padding), one launch; 11 tiles of
  # 64 over 4 // blocks CTAs per block; scalar and per-row keys. Two blocks
  # with the epilogue in 4 passes of 2 chunks and a wgmma in flight.
  d, v = 64, 700
  h, w = inputs.exact_inputs(b, d, v, seed=8)
  t = jnp.asarray(np.r_[0.0, np.linspace(0.3, 3.0, b - 1)], jnp.float32)
  cfg = TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=64, tile_d=64,
                     max_concurrent_steps=2, epi_cols=8, mma_in_flight=in_flight,
                     batch_blocks=blocks, epi_passes=passes)
  from pallas_kernels import sm90_sampler
  assert len(sm90_sampler.launches(b, d, v, 2, cfg)) == 1
  for key in (jax.random.key(8), inputs.row_keys(b, seed=8)):
    p = problem.prepare(h, w, key, temperature=t, vocab_size=690)
    got = _interpret_candidates(p, config=cfg)
    _assert_same_candidates(got, _xla_candidates(p), p)


@pytest.mark.parametrize("passes,steps,in_flight", [(1, 4, 0), (4, 6, 1)])
def test_batch_blocks_lower_for_cuda(passes, steps, in_flight):
  cfg = TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128, tile_d=64,
                     max_concurrent_steps=steps, epi_cols=8, mma_in_flight=in_flight,
                     batch_blocks=4, epi_passes=passes)
  for layout in ("vd", "dv"):
    lowered = _lower_for_cuda(512, 4096, 151936, layout, jnp.bfloat16,
                              backend=MosaicBackend(assume_sm90=True, config=cfg))
    assert "mosaic_gpu" in lowered.as_text()


def test_traced_vocab_offset():
  # A shard of the head: global ids start at a traced offset; the noise
  # counters and the vocab_size mask use global ids.
  b, d, v = 9, 64, 333
  h, w = inputs.exact_inputs(b, d, v, layout="dv", seed=5)
  key = jax.random.key(5)

  p = problem.prepare(h, w, key, weight_layout="dv", vocab_size=v)
  # As the sharded API would: the whole head's vocab_size (and counters).
  p = dataclasses.replace(p, vocab_size=1000)

  # One program per backend for the three offsets (traced).
  got_f = jax.jit(lambda o: INTERPRET.candidates(p, vocab_offset=o))
  want_f = jax.jit(lambda o: xla_backend.candidates(p, vocab_offset=o))
  for offset in (0, 400, 800):  # 800: ids past vocab_size=1000 are masked
    off = jnp.int32(offset)
    got, want = got_f(off), want_f(off)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    if offset < 800:
      _assert_same_candidates(got, want, p, offset)
    else:
      # Ids 1000.. are masked: those rows' candidates are (-inf, -).
      assert (np.asarray(got[0])[np.asarray(want[1]) >= 1000] == -np.inf).all()


def test_nan_and_inf_follow_the_combine_rule():
  # NaN beats every number (lowest id among NaNs), as jnp.argmax; -inf logits
  # never win over finite ones.
  b, d, v = 8, 64, 300
  h, w = inputs.exact_inputs(b, d, v, seed=6)
  w = w.at[17].set(jnp.nan).at[250].set(jnp.nan).at[5].set(-jnp.inf)
  t = inputs.pow2_temperatures(b, greedy_every=2, seed=6)
  p = problem.prepare(h, w, jax.random.key(6), temperature=t)
  got = _interpret_candidates(p)
  want = _xla_candidates(p)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  # Row 5 is NaN wherever a hidden row holds a 0 (0 * -inf), else -inf.
  assert set(np.asarray(got[1]).tolist()) <= {5, 17}
  assert np.isnan(np.asarray(got[0])).all()


# -- CUDA lowering on the CPU, every config the heuristic picks ---------------

# N buckets: every multiple of 8 up to 256 (B in 1..256 maps onto them).
_N_BUCKETS = list(range(8, 257, 8))


def _lower_for_cuda(b, d, v, layout, dtype, backend=LOWER):
  h = jax.ShapeDtypeStruct((b, d), dtype)
  w = jax.ShapeDtypeStruct((v, d) if layout == "vd" else (d, v), dtype)
  t = jax.ShapeDtypeStruct((b,), jnp.float32)

  def f(h, w, key, t):
    p = problem.prepare(h, w, key, temperature=t, weight_layout=layout)
    return backend.candidates(p)

  with h100_lowering():
    return jax.jit(f).trace(h, w, jax.random.key(0), t).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("layout,dtype,buckets", [
    # Every N bucket once; layout and dtype change only the operand specs,
    # so the other pair gets the buckets where the heuristic switches.
    ("vd", jnp.bfloat16, _N_BUCKETS),
    ("dv", jnp.float16, [8, 16, 48, 56, 120, 128, 136, 256]),
])
def test_heuristic_configs_lower_for_cuda(layout, dtype, buckets):
  # One B per N bucket (the heuristic depends on N, D, V), on the
  # D=4096/V=151936 (Qwen3-8B) head: Dt=128, the largest tiles.
  for n in buckets:
    b = n - 3 if n > 8 else 1
    lowered = _lower_for_cuda(b, 4096, 151936, layout, dtype)
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("b", [1, 9, 33])
def test_running_best_per_warpgroup_in_interpret_mode(b):
  # Up to 48 rows each compute warpgroup keeps a running best over its
  # tiles (24 tiles over interpret mode's 4 CTAs: 3 a warpgroup), one per
  # chunk of 16 columns (B = 33: three, the last with one real row), and writes
  # one candidate: scores and ids equal the xla backend's, with a greedy row
  # of equal logits (zero hidden: the lowest id), a NaN row and a cut
  # vocabulary.
  d, v = 256, 3001
  (_, _, cfg, n), = sm90_sampler.launches(b, d, v, 2)
  assert sm90_sampler.per_warpgroup(cfg, n)
  p = inputs.edge_rows_problem(b, d, v, seed=30 + b)
  got = jax.jit(lambda p: INTERPRET.candidates(p))(p)
  want = jax.jit(lambda p: xla_backend.candidates(p))(p)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(_winning_scores(p, got[1])))
  assert int(got[1][0]) == 0


def test_per_warpgroup_candidates_up_to_48_rows():
  # The heuristic's vocabulary-major launches of 1-48 rows (up to three
  # chunks of columns) keep one candidate per warpgroup; wider ones are
  # batch-major (one candidate per warpgroup by construction).
  for b, d, v in ((1, 4096, 151936), (8, 2880, 201088), (16, 4096, 151936),
                  (16, 2048, 151936), (17, 4096, 151936), (48, 8192, 128256)):
    (_, _, cfg, n), = sm90_sampler.launches(b, d, v, 2)
    assert sm90_sampler.per_warpgroup(cfg, n), (b, cfg)
    assert n // cfg.epi_cols <= sm90_sampler.RUNNING_CHUNKS
  (_, _, cfg, n), = sm90_sampler.launches(49, 4096, 151936, 2)
  assert not sm90_sampler.per_warpgroup(cfg, n)
  assert cfg.schedule.batch_major


def test_kernel_noise_lowers_and_matches_in_interpret_mode():
  # The kernels' noise log lowers for CUDA, and in interpret mode (XLA:CPU's
  # log) gives the reference noise, at the extremes of u and a spread.
  with h100_lowering():
    text = jax.jit(lambda b: mosaic_gumbel(b, interpret=False)).trace(
        jax.ShapeDtypeStruct((1 << 16, 128), jnp.uint32)).lower(
            lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  bits = every_uniform_bits()
  bits = jnp.concatenate([bits[:64], bits[-64:], bits[::1024][:64]])
  got = jax.jit(lambda b: mosaic_gumbel(b, interpret=True))(bits)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(noise.gumbel_from_bits(bits)))


def test_top_kernels_lower_for_cuda():
  # The exact top-N and the top-lists selection kernels (no heuristic
  # config: one shape each covers their code); their GMEM stores are ones
  # jax >= 0.12 plans differently (docs/design.md, "Mosaic GPU facts").
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  with h100_lowering():
    top = jax.jit(lambda t, f: sm90_top.exact_top(t, f, 24, 3001)).trace(
        f32(64, 4 * sm90_top.CHUNK), jax.ShapeDtypeStruct((64,), jnp.bool_))
    lists = jax.jit(lambda v, i, b: sm90_top.top_lists(v, i, b, 28)).trace(
        f32(64, 924), jax.ShapeDtypeStruct((64, 924), jnp.int32), f32(64))
    for traced in (top, lists):
      assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_lowering_other_shapes(layout):
  # D = 64 * odd (Dt=64, 3 blocks), V not a multiple of 64, B > 256 with
  # one warpgroup (V < 128: chunks of 256), B > 2048 (16 blocks and a tail).
  for b, d, v in ((300, 192, 1000), (5, 8192, 128256), (300, 64, 64),
                  (2100, 128, 1000)):
    _lower_for_cuda(b, d, v, layout, jnp.bfloat16)


def test_heuristic_picks_the_measured_schedules():
  # The settings PERF_LOG v7c / v9 measured best on the Qwen3-8B head.
  rows = 151936
  small = sm90_config.pick_config(32, 4096, rows)
  assert (small.schedule, small.tile_v, small.mma_in_flight, small.epi_passes) == (
      Schedule.PINGPONG_VOCAB_M, 128, 0, 1)
  mid = sm90_config.pick_config(128, 4096, rows)
  assert (mid.schedule, mid.epi_cols, mid.mma_in_flight, mid.tile_d,
          mid.max_concurrent_steps) == (Schedule.PINGPONG_BATCH_M, 8, 0, 64, 4)
  assert sm90_config.pick_config(64, 4096, rows).epi_cols == 16
  # Up to 8 rows a batch side of 8 (epilogue chunks of 8 columns), bf16 and
  # 8-bit heads alike; from 9 rows 16 (docs/performance.md, "Small batches").
  for w_itemsize in (2, 1):
    for b, n, epi in ((1, 8, 8), (8, 8, 8), (9, 16, 16), (16, 16, 16)):
      (_, _, cfg, side), = sm90_sampler.launches(b, 4096, rows, 2, w_itemsize=w_itemsize)
      assert (cfg.schedule, side, cfg.epi_cols) == (Schedule.PINGPONG_VOCAB_M, n, epi)
  wide = sm90_config.pick_config(256, 4096, rows)
  assert (wide.schedule, wide.tile_v, wide.epi_passes, wide.tile_d,
          wide.max_concurrent_steps, wide.mma_in_flight) == (
              Schedule.PINGPONG_VOCAB_M, 64, 4, 64, 4, 1)
  # One compute warpgroup (V < 128): the cooperative schedule.
  assert sm90_config.pick_config(256, 4096, 64).schedule is Schedule.COOPERATIVE
  # Batch blocks of 128 rows from B = 193 (PERF_LOG "Batch blocks"): Dt = 64
  # in 4 slots for two blocks, Dt = 128 in 2 from three on (D permitting).
  # On an H100 (the abstract mesh's device: on a GPU host the heuristic
  # would otherwise follow the local GPU's kind).
  launch = lambda b, d=4096: [(b0, b1, c.batch_blocks, c.tile_d, c.max_concurrent_steps)
                              for b0, b1, c, _ in sm90_sampler.launches(b, d, rows, 2)]
  with jax.sharding.use_abstract_mesh(sm90_common.h100_abstract_mesh()):
    assert launch(192)[0][2] == 1
    assert launch(193) == [(0, 193, 2, 64, 4)]
    assert launch(512) == [(0, 512, 4, 128, 2)]
    assert launch(512, 2880) == [(0, 512, 4, 64, 4)]
    assert launch(2100) == [(0, 2048, 16, 128, 2), (2048, 2100, 1, 128, 3)]   # N = 64


def test_heuristic_configs_are_valid():
  for n in _N_BUCKETS:
    for d in (64, 128, 4096, 8192):
      for v in (64, 100, 151936):
        rows = max(64, -(-v // 8) * 8)
        cfg = sm90_config.pick_config(n, d, rows)
        cfg.check_problem(n=cfg.batch_pad(n), dim=d, rows=rows)


# -- config validation ---------------------------------------------------------

_PP, _BM = Schedule.PINGPONG_VOCAB_M, Schedule.PINGPONG_BATCH_M


@pytest.mark.parametrize("kw,field", [
    (dict(tile_v=96), "tile_v=96"),
    (dict(tile_v=0), "tile_v=0"),
    (dict(tile_d=32), "tile_d=32"),
    (dict(max_concurrent_steps=0), "max_concurrent_steps=0"),
    (dict(epi_cols=12), "epi_cols=12"),
    (dict(epi_cols=32), "epi_cols=32"),
    (dict(epi_unroll=0), "epi_unroll=0"),
    (dict(num_ctas=0), "num_ctas=0"),
    (dict(compute_wgs=3), "compute_wgs=3"),
    (dict(tile_v=64, compute_wgs=2), "tile_v=64"),
    (dict(epi_passes=0), "epi_passes=0"),
    (dict(schedule=_PP, compute_wgs=1), "PINGPONG_VOCAB_M runs 2 compute warpgroups"),
    (dict(schedule=_BM, epi_passes=3), "epi_passes=3 must split the 8 column chunks"),
    (dict(schedule=_PP, max_concurrent_steps=1),
     "PINGPONG_VOCAB_M with mma_in_flight=1 needs max_concurrent_steps >= 2"),
    (dict(mma_in_flight=2), "mma_in_flight=2"),
    (dict(schedule=_BM, tile_v=64, epi_cols=16, epi_unroll=8),
     "must divide tile_v=64"),
    (dict(schedule=_BM, batch_blocks=0), "batch_blocks=0"),
    (dict(batch_blocks=2), "batch_blocks=2 needs PINGPONG_BATCH_M"),
    (dict(schedule=_BM, tile_v=128, epi_cols=8, epi_passes=32),
     "epi_passes=32 must split the 16 column chunks"),
    (dict(schedule=_BM, tile_v=128, epi_cols=8, epi_unroll=2, epi_passes=16),
     "passes of a multiple of epi_unroll=2"),
])
def test_bad_config_raises_value_error(kw, field):
  with pytest.raises(ValueError, match=field.replace("(", r"\(")):
    TuningConfig(**kw)


def test_config_wrong_type_raises_type_error():
  with pytest.raises(TypeError, match="tile_v"):
    TuningConfig(tile_v=128.0)
  with pytest.raises(TypeError, match="schedule"):
    TuningConfig(schedule="pingpong")


def test_config_problem_checks():
  cfg = TuningConfig(tile_v=128, tile_d=128, epi_cols=16)
  with pytest.raises(ValueError, match="epi_cols=16 x epi_unroll=1 must divide"):
    cfg.check_problem(n=24, dim=4096, rows=1024)
  with pytest.raises(ValueError, match="tile_d=128 must divide D=192"):
    cfg.check_problem(n=16, dim=192, rows=1024)
  with pytest.raises(ValueError, match="accumulator registers"):
    cfg.check_problem(n=256, dim=4096, rows=1024)
  # Ping-pong: each warpgroup holds a whole tile (128 x 256 / 128 = 256).
  pp = TuningConfig(schedule=_PP, tile_v=128, tile_d=64, epi_cols=16)
  with pytest.raises(ValueError, match="rows per warpgroup 128"):
    pp.check_problem(n=256, dim=4096, rows=1024)
  bm = dataclasses.replace(pp, schedule=_BM)
  with pytest.raises(ValueError, match="multiple of 64"):
    bm.check_problem(n=72, dim=4096, rows=1024)
  with pytest.raises(ValueError, match="N=192 x tile_v=128 needs 192"):
    bm.check_problem(n=192, dim=4096, rows=1024)
  big = TuningConfig(tile_v=128, tile_d=128, max_concurrent_steps=8, epi_cols=16)
  with pytest.raises(ValueError, match="bytes of SMEM"):
    big.check_problem(n=128, dim=4096, rows=1024)


def test_config_is_frozen():
  cfg = TuningConfig()
  with pytest.raises(AttributeError):
    cfg.tile_v = 64


def test_target_compiler_params():
  # What every launch compiles with, and the profiler only where asked for
  # and only on the GPU (it adds a host callback, which neither interpret
  # mode nor a CUDA lowering on a CPU host can run; the GPU suite runs it).
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels import sm90_common as common
  default = plgpu.CompilerParams()
  plain = common.Target().compiler_params()
  assert plain.lowering_semantics == plgpu.LoweringSemantics.Lane
  assert plain.reduction_scratch_bytes == common.REDUCTION_SCRATCH_BYTES
  assert plain.profile_space == default.profile_space == 0
  assert plain.profile_dir == default.profile_dir
  no_scratch = common.Target().compiler_params(reduction_scratch=False)
  assert no_scratch.reduction_scratch_bytes == default.reduction_scratch_bytes
  prof = common.Target(profile_dir="/tmp/fsj_trace").compiler_params()
  assert prof.profile_space == common.PROFILE_REGIONS
  assert prof.profile_dir == "/tmp/fsj_trace"
  assert prof.profile_bounds_check
  assert prof.lowering_semantics == plgpu.LoweringSemantics.Lane
  interp = common.Target(interpret=plgpu.InterpretGPUParams(),
                         profile_dir="/tmp/fsj_trace").compiler_params()
  assert interp.profile_space == 0 and interp.profile_dir == default.profile_dir
  # The backend hands its profile_dir to every launch's target.
  assert MosaicBackend(profile_dir="/tmp/fsj_trace")._target().profile_dir == "/tmp/fsj_trace"
  assert MosaicBackend()._target().profile_dir is None


def test_interpret_false_runs_the_whole_grid_on_the_gpu():
  # interpret=False means the GPU: one CTA per SM (num_sms None), not the
  # interpret mode's 4 CTAs (which ran a real launch 10x slower).
  for backend in (MosaicBackend(), MosaicBackend(interpret=False)):
    target = backend._target()
    assert target.interpret is None and target.num_sms is None
  interp = MosaicBackend(interpret=True)._target()
  assert interp.interpret is not None and interp.num_sms == 4
  assert MosaicBackend(interpret=False, num_sms=8)._target().num_sms == 8


# -- support checks and auto -----------------------------------------------------


@pytest.mark.skipif(has_gpu(), reason="checks the CPU's choice; on an sm90 GPU "
                    "auto picks mosaic (tests/test_api.py)")
def test_auto_picks_xla_on_cpu_and_mosaic_raises():
  h, w = inputs.exact_inputs(4, 64, 128)
  p = problem.prepare(h, w, jax.random.key(0))
  c = controls.prepare_controls(batch=4, vocab_size=128, rows=128)
  assert backends.resolve("auto", p, c).name == "xla"
  for kw in ({}, dict(top_k=5)):
    with pytest.raises(NotImplementedError, match="sm90"):
      fs.sample(h, w, jax.random.key(0), backend="mosaic", **kw)
    assert fs.which_backend(h, w, jax.random.key(0), **kw) == "xla"


@pytest.mark.parametrize("b,d,ctl,want", [
    (320, 8192, {}, False),      # PLAIN_DENSE: the dense route measured faster
    (128, 8192, {}, True), (256, 8192, {}, True), (512, 8192, {}, True),
    (256, 4096, {}, True),
    (256, 8192, dict(top_k=5), True),      # truncation: the kernel at every B
    (256, 4096, dict(softcap=30.0), False),  # other controls: <= ROUTE_MAX_ROWS
    (192, 4096, dict(softcap=30.0), True),
    # Floats at every B: only the kernel's fixed split is batch invariant.
    (512, 4096, dict(return_logprobs=True), True),
    (1024, 8192, dict(return_entropy=True, softcap=30.0), True),
    (320, 8192, dict(top_logprobs=5), True),
])
def test_mosaic_route_preferences(b, d, ctl, want):
  h = jnp.zeros((b, d), jnp.bfloat16)
  w = jnp.zeros((256, d), jnp.bfloat16)
  p = problem.prepare(h, w, jax.random.key(0))
  c = controls.prepare_controls(batch=b, vocab_size=256, rows=256, **ctl)
  assert LOWER.prefers(p, c) is want


def test_float_calls_past_the_row_bound_follow_batch_invariant():
  # Opting out of invariance gives the measured route back: the dense one
  # past ROUTE_MAX_ROWS rows.
  h = jnp.zeros((512, 4096), jnp.bfloat16)
  w = jnp.zeros((256, 4096), jnp.bfloat16)
  p = problem.prepare(h, w, jax.random.key(0))
  c = controls.prepare_controls(batch=512, vocab_size=256, rows=256, return_logprobs=True)
  assert LOWER.prefers(p, c) is True
  assert dataclasses.replace(LOWER, batch_invariant=False).prefers(p, c) is False


def test_plain_dense_points_per_gpu():
  # The H100's points are the default; the H200 (and its variants) has its
  # own, measured; another GPU's name that only contains it does not.
  dense = lambda kind, d, b: any(d >= dm and lo <= b <= hi
                                 for dm, lo, hi in mosaic_backend.plain_dense(kind))
  for kind in ("NVIDIA H100 80GB HBM3", "", "NVIDIA GH200 480GB"):
    assert [dense(kind, 8192, b) for b in (128, 192, 256, 257, 320, 321, 512)] == [
        False, False, False, True, True, False, False]
    assert not dense(kind, 4096, 192)
  for kind in ("NVIDIA H200", "NVIDIA H200 NVL"):
    assert [dense(kind, 8192, b) for b in (128, 129, 192, 240, 241, 256, 257, 320, 321)] == [
        False, True, True, True, False, False, True, True, False]
    assert [dense(kind, 4096, b) for b in (160, 161, 192, 193, 256)] == [
        False, True, True, False, False]
    assert not dense(kind, 2880, 192)


def test_unsupported_problems_raise_not_implemented():
  h, w = inputs.exact_inputs(4, 96, 128)  # D not a multiple of 64
  with pytest.raises(NotImplementedError, match="D=96"):
    fs.sample(h, w, jax.random.key(0), backend=INTERPRET)
  h, w = inputs.exact_inputs(4, 64, 128, dtype=jnp.float32)
  with pytest.raises(NotImplementedError, match="float32"):
    fs.sample(h, w, jax.random.key(0), backend=INTERPRET)
  # auto moves on to the xla backend.
  assert fs.which_backend(h, w, jax.random.key(0), top_k=5) == "xla"
  tok = fs.sample(h, w, jax.random.key(0))
  np.testing.assert_array_equal(tok, fs.reference.sample(h, w, jax.random.key(0)))


# -- the controls kernel (pallas_kernels/sm90_controls.py) -------------------


@pytest.mark.parametrize("layout,b,d,v,kw,launch_rows,h_want", [
    # Truncation lists and log-sum-exp on the Qwen3-8B head.
    ("vd", 64, 4096, 151936, dict(top_k=50, top_p=0.9, return_logprobs=True),
     [(64, 1)], [64]),
    # Every control at once, two blocks of 64 rows, two launches of samples
    # (4 + 2).
    ("dv", 70, 192, 1000, dict(top_k=5, min_p=0.1, softcap=30.0, logit_bias=1,
                               allowed_mask=1, num_samples=6,
                               return_logprobs=True), [(64, 2)] * 2, [128] * 2),
    ("vd", 5, 8192, 128256, dict(softcap=30.0), [(64, 1)], [8]),
    # Blocks of 128 rows (no truncation, one sample), both layouts, for
    # tokens and, on the batch-invariant split, for log-probabilities; up
    # to 64 rows those take one 64-row block with the 128-row epilogue.
    ("vd", 200, 4096, 151936, dict(softcap=30.0, logit_bias=1, allowed_mask=1),
     [(128, 2)], [256]),
    ("dv", 100, 192, 1000, dict(logit_bias=1), [(128, 1)], [104]),
    ("dv", 100, 192, 1000, dict(logit_bias=1, return_logprobs=True), [(128, 1)],
     [104]),
    ("vd", 40, 4096, 151936, dict(return_logprobs=True, return_entropy=True,
                                  return_raw_logprobs=True), [(64, 1)], [40]),
    # 17 blocks of 64 with lists: 4 launches of MAX_LIST_BLOCKS, then one of 1.
    ("vd", 1030, 256, 1000, dict(top_k=5), [(64, 4)] * 4 + [(64, 1)], [256] * 4 + [8]),
    # Without lists: one launch of MAX_BLOCKS blocks of 64 rows (two samples).
    ("vd", 1024, 256, 1000, dict(softcap=3.0, num_samples=2), [(64, 16)], [1024]),
    # Penalties in the kernel: the benchmark's (1 + 8 bit-planes of 128
    # output ids), with lists; with the mask, two blocks and two sample
    # groups; presence alone in blocks of 128 rows.
    ("vd", 64, 4096, 151936, dict(repetition_penalty=1.2, presence_penalty=0.5,
                                  frequency_penalty=0.3, prompt_ids=128, output_ids=128,
                                  top_logprobs=20), [(64, 1)], [64]),
    ("dv", 70, 192, 1000, dict(allowed_mask=1, repetition_penalty=1.3,
                               frequency_penalty=0.5, output_ids=7, top_k=5,
                               num_samples=6), [(64, 2)] * 2, [128] * 2),
    ("vd", 200, 4096, 151936, dict(presence_penalty=0.5, output_ids=16),
     [(128, 2)], [256]),
])
def test_controls_kernel_lowers_for_cuda(layout, b, d, v, kw, launch_rows, h_want,
                                         monkeypatch):
  rows, h_rows = [], []
  real = sm90_controls._launch
  monkeypatch.setattr(sm90_controls, "_launch",
                      lambda *a, **k: (rows.append((k["n"], k["cfg"].batch_blocks)),
                                       h_rows.append(a[2].shape[0]),
                                       real(*a, **k))[-1])
  h = jax.ShapeDtypeStruct((b, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((v, d) if layout == "vd" else (d, v), jnp.bfloat16)
  t = jax.ShapeDtypeStruct((b,), jnp.float32)

  def f(h, w, key, t):
    p = problem.prepare(h, w, key, temperature=t, weight_layout=layout)
    kk = dict(kw)
    if "logit_bias" in kk:
      kk["logit_bias"] = jnp.zeros((v,), jnp.float32)
    if "allowed_mask" in kk:
      kk["allowed_mask"] = jnp.zeros((b, -(-v // 32)), jnp.uint32)
    for name in ("prompt_ids", "output_ids"):
      if name in kk:
        kk[name] = jnp.zeros((b, kk[name]), jnp.int32)
    c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, **kk)
    return LOWER.controls_state(p, c)

  with h100_lowering():
    lowered = jax.jit(f).trace(h, w, jax.random.key(0), t).lower(
        lowering_platforms=("cuda",))
  assert "flashsample_sm90_controls" in lowered.as_text()
  assert rows == launch_rows
  # A launch of one block takes H with its own rows padded to 8 only (not
  # to N); one of several blocks all of theirs.
  assert h_rows == h_want


@pytest.mark.parametrize("v,ctas", [(151936, 132), (128256, 126)])
def test_float_outputs_split_every_block_as_one(v, ctas, monkeypatch):
  # On an H100's 132 SMs: a call that reports floats gives every block of
  # 64 rows the balanced one-block grid (1187 tiles of the S head: 132 CTAs
  # in 9 rounds; 1002 of L: 126 in 8), so 4 blocks launch 4 x that many
  # CTAs; a call for tokens alone shares the SMs among its blocks.
  grids = []
  real = sm90_common.Target.grid_ctas
  monkeypatch.setattr(sm90_common.Target, "grid_ctas", lambda self, cfg, n: grids.append(
      (cfg.batch_blocks, cfg.num_ctas)) or real(self, cfg, n))
  h = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((v, 1024), jnp.bfloat16)
  for kw, want in ((dict(top_k=50, return_logprobs=True), [(1, None), (4, 4 * ctas)]),
                   (dict(top_k=50), [(4, None)])):
    grids.clear()
    with h100_lowering():
      jax.jit(lambda h, w, k: fs.sample(h, w, k, backend=LOWER, **kw)).trace(
          h, w, jax.random.key(0)).lower(lowering_platforms=("cuda",))
    assert grids == want, kw


def test_calls_reporting_floats_take_the_batch_invariant_split(monkeypatch):
  # As the triton backend's configs (tests/test_triton_adapter.py):
  # log-probabilities, entropies and raw log-probabilities on the fixed
  # split, tokens and kept sets (the same on every split) on the per-B one,
  # and every call on it with batch_invariant=False. Traced for an H100.
  seen = []
  real = sm90_controls._launch
  monkeypatch.setattr(sm90_controls, "_launch",
                      lambda *a, **k: seen.append(k["fixed_split"]) or real(*a, **k))
  h = jax.ShapeDtypeStruct((70, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((1000, 256), jnp.bfloat16)
  for kw, want in ((dict(top_k=20, top_p=0.9), False), (dict(return_logprobs=True), True),
                   (dict(top_k=20, top_logprobs=3), True), (dict(return_entropy=True), True),
                   (dict(return_raw_logprobs=True), True),
                   (dict(top_p=0.9, return_kept=8), False)):
    for backend, expect in ((LOWER, want), (dataclasses.replace(LOWER, batch_invariant=False),
                                            False)):
      seen.clear()
      with h100_lowering():
        jax.jit(lambda h, w, k: fs.sample(h, w, k, backend=backend, **kw)).trace(
            h, w, inputs.row_keys(70))
      assert seen == [expect], (kw, backend.batch_invariant)
  with pytest.raises(TypeError, match="batch_invariant"):
    MosaicBackend(batch_invariant=1)


# B = 37 (not a multiple of 8), V a multiple of no tile (CI time: one shape;
# the shared suite's penalties cases run others).
@pytest.mark.parametrize("b,d,v", [(37, 128, 1000)])
def test_penalties_in_the_kernel_bit_for_bit(b, d, v):
  # The kernel applies the penalties per element from the history planes:
  # best scores, tempered logits and listed candidates equal the dense
  # penalized logits' bit for bit (in NumPy: IEEE division, as the kernel
  # in interpret mode), with penalties that round and history ids among
  # the winners.
  h, w = inputs.exact_inputs(b, d, v, seed=b)
  t = jnp.asarray(np.resize([0.7, 0.6, 1.3, 0.0, 1.0], b), jnp.float32)
  kw = penalty_kwargs(b, v, seed=b)
  won = check_fused_penalties(INTERPRET, h, w, jax.random.key(b), t, kw, ieee=True)
  assert won >= max(1, b // 4)
  if b > 8:
    return   # the variants below once, on the small shape (CI time)
  # Each penalty alone, and repetition on a prompt only (no count planes).
  for part in (dict(repetition_penalty=kw["repetition_penalty"]),
               dict(presence_penalty=kw["presence_penalty"]),
               dict(frequency_penalty=kw["frequency_penalty"])):
    check_fused_penalties(INTERPRET, h, w, jax.random.key(b), t,
                          dict(part, prompt_ids=kw["prompt_ids"], output_ids=kw["output_ids"]),
                          ieee=True)
  check_fused_penalties(INTERPRET, h, w, jax.random.key(b), t,
                        dict(repetition_penalty=1.3, prompt_ids=kw["prompt_ids"]), ieee=True)


@pytest.mark.parametrize("pairwise_max", [stage2.PAIRWISE_MAX, 0])
def test_history_bits_and_planes(pairwise_max, monkeypatch):
  # Distinct ids per row (by comparing pairs, or by sorting), their planes'
  # bits (in the history; bits of the output count), and the kernel's
  # bit-planes: the mask first, then the history, by (block, word, plane,
  # row), for this weight's rows only.
  monkeypatch.setattr(stage2, "PAIRWISE_MAX", pairwise_max)
  prompt = jnp.asarray([[5, 70, -1], [-1, -1, -1], [99, 99, 0]], jnp.int32)
  output = jnp.asarray([[70, 70, 3, 70, 31, -1], [64, -1, -1, -1, -1, -1],
                        [-1] * 6], jnp.int32)
  c = controls.prepare_controls(batch=3, vocab_size=100, rows=100, prompt_ids=prompt,
                                output_ids=output, repetition_penalty=1.5,
                                frequency_penalty=0.5)
  ids, flags, pen = stage2.history_bits(c)
  assert (pen.repetition, pen.frequency, pen.presence, pen.count_bits) == (True, True, False, 3)
  ids, flags = np.asarray(ids), np.asarray(flags)
  # id -> its flags: in the history; count bits 0, 1, 2 (70: 3, others 1 or 0).
  got = [{int(i): tuple(f) for i, f in zip(ids[r], flags[r]) if i >= 0} for r in range(3)]
  assert got[0] == {5: (1, 0, 0, 0), 70: (1, 1, 1, 0), 3: (1, 1, 0, 0), 31: (1, 1, 0, 0)}
  assert got[1] == {64: (1, 1, 0, 0)} and got[2] == {99: (1, 0, 0, 0), 0: (1, 0, 0, 0)}
  mask = jnp.asarray(np.random.default_rng(0).integers(0, 2**32, (3, 4)), jnp.uint32)
  # Jitted as the kernel's operands are computed (the offset traced).
  planes_f = jax.jit(sm90_controls._planes, static_argnums=(3, 4, 5))
  for offset, rows_k in ((0, 128), (32, 64), (37, 64)):
    planes = np.asarray(planes_f(mask, (jnp.asarray(ids), jnp.asarray(flags)),
                                 jnp.int32(offset), rows_k, 100, 2))
    assert planes.shape == (2, rows_k // 32, 5, 2)
    bits = lambda r, k: {offset + 32 * wd + i for wd in range(rows_k // 32) for i in range(32)
                         if planes[r // 2, wd, k, r % 2] >> i & 1}
    for r in range(3):
      window = set(range(offset, offset + rows_k))
      allowed = {v for v in range(100) if np.asarray(mask)[r, v // 32] >> (v % 32) & 1}
      # (bits past V are the mask's own; the kernel masks ids >= V anyway)
      assert bits(r, 0) & set(range(100)) == allowed & window
      for k in range(4):
        assert bits(r, 1 + k) == {i for i, f in got[r].items() if f[k]} & window
  # Without a mask the history's planes come first.
  planes = np.asarray(planes_f(None, (jnp.asarray(ids), jnp.asarray(flags)),
                               jnp.int32(0), 128, 100, 2))
  assert planes.shape == (2, 4, 4, 2)
  for r in range(3):
    for k in range(4):
      assert {32 * wd + i for wd in range(4) for i in range(32)
              if planes[r // 2, wd, k, r % 2] >> i & 1} == {
                  i for i, f in got[r].items() if f[k]}
  # Presence alone needs one count plane (count > 0); without output ids
  # the penalties have no plane.
  c = controls.prepare_controls(batch=3, vocab_size=100, rows=100, output_ids=output,
                                presence_penalty=0.5)
  ids, flags, pen = stage2.history_bits(c)
  assert pen.planes == 1 and flags.shape == (3, 6, 1)
  assert {int(i) for i, f in zip(ids[0], flags[0]) if f[0]} == {3, 31, 70}
  c = controls.prepare_controls(batch=3, vocab_size=100, rows=100, prompt_ids=prompt,
                                presence_penalty=0.5)
  assert stage2.history_bits(c)[2].planes == 0


def test_long_histories_take_the_gathered_rows_route():
  # A frequency penalty over 16384 output ids needs 15 count planes: with
  # the mask and the repetition plane more than MAX_PLANES, so the kernel
  # runs with the history ids left out and stage 2 scores them apart.
  b, d, v = 2, 64, 200
  h, w = inputs.exact_inputs(b, d, v, seed=2)
  out = np.full((b, 16384), -1, np.int32)
  out[:, :40] = np.random.default_rng(2).integers(0, 30, (b, 40))
  kw = dict(output_ids=jnp.asarray(out), repetition_penalty=2.0, frequency_penalty=0.5,
            allowed_mask=jnp.full((b, -(-v // 32)), 0xFFFF00FF, jnp.uint32))
  p = problem.prepare(h, w, jax.random.key(2))
  c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, **kw)
  assert not INTERPRET.fuses_penalties(p, c)
  short = dict(kw, output_ids=jnp.asarray(out[:, :8191]))
  assert INTERPRET.fuses_penalties(p, controls.prepare_controls(
      batch=b, vocab_size=v, rows=v, **short))
  SUITE.check_controls(kw, key=jax.random.key(2), h=h, w=w, t=1.0)


def test_mosaic_more_samples_than_one_launch():
  # 6 samples: two launches (4 + 2), the second keeps only the best.
  assert sm90_controls.MAX_KERNEL_SAMPLES < 6
  SUITE.check_controls(CASES["all"], num_samples=6, return_logprobs=True)
  SUITE.check_controls(CASES["bias"], KEYS["per_row"], num_samples=5)


def test_mosaic_overflowing_slot_lists_take_the_exact_path(monkeypatch):
  # One value per slot and two per warpgroup: the bound is high, most rows
  # cannot be certified from the candidates and take the materialized path.
  monkeypatch.setattr(sm90_controls, "_SLOT_DEPTH", 1)
  monkeypatch.setattr(sm90_controls, "_WG_CANDIDATES", 2)
  jax.clear_caches()  # both are read when the sampler is traced
  # "all" holds top-k, top-p and min-p; top-p alone is the rule whose kept
  # set reaches deepest into the lists.
  for case in ("top_p", "all"):
    SUITE.check_controls(CASES[case], return_logprobs=True)
  p = problem.prepare(H, W, KEYS["scalar"], temperature=T)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, **CASES["top_k"])
  # Jitted, as the sampler runs them (functions of their own: traced with
  # the patched lists).
  st = jax.jit(lambda p, c: INTERPRET.controls_state(p, c))(p, c)
  _, _, fallback = jax.jit(lambda p, c, st: stage2.finish(p, c, st))(p, c, st)
  assert np.asarray(fallback).sum() > 0
  # The bound is never below a value the lists missed: every value above
  # it is listed.
  l = np.asarray(jnp.dot(H.astype(jnp.float32), W.astype(jnp.float32).T))
  t = l / np.where(np.asarray(T) == 0, 1, np.asarray(T))[:, None]
  vals, ids, bound = (np.asarray(a) for a in (st.cand_vals, st.cand_ids, st.cand_bound))
  for b in range(B):
    above = set(np.flatnonzero(t[b] > bound[b]))
    assert above <= set(ids[b][vals[b] > bound[b]]), b


def test_full_slot_lists_that_dropped_nothing_leave_the_row_certified():
  # 64 ids in one tile: each of the 16 column slots sees exactly
  # _SLOT_DEPTH = 4 ids, so every list fills and none drops a value. The
  # row's top four sit in one slot (ids 0, 16, 32, 48); its last entry (the
  # 4th value) is no bound on what the lists missed, which is the 8th value
  # once the 7 candidates are popped. top_k = 6 is then decided from the
  # candidates, with no exact path.
  assert sm90_controls._SLOT_DEPTH == 4 and sm90_controls._WG_CANDIDATES == 7
  v, d = 64, 128
  top = [0, 16, 32, 48]
  rest = [i for i in range(v) if i not in top]
  logits = np.zeros(v, np.float32)
  logits[top] = [60, 59, 58, 57]
  logits[rest] = np.arange(56, 56 - len(rest), -1)
  w = np.zeros((v, d), np.float32)
  w[:, 0] = logits
  h = np.zeros((2, d), np.float32)
  h[:, 0] = 1
  h, w = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  key = jax.random.key(5)
  p = problem.prepare(h, w, key)
  c = controls.prepare_controls(batch=2, vocab_size=v, rows=v, top_k=6)
  st = jax.jit(lambda p, c: INTERPRET.controls_state(p, c))(p, c)
  np.testing.assert_array_equal(np.asarray(st.cand_bound), [53, 53])
  _, _, fallback = jax.jit(lambda p, c, st: stage2.finish(p, c, st))(p, c, st)
  assert np.asarray(fallback).sum() == 0
  got = fs.sample(h, w, key, top_k=6, backend=INTERPRET)
  np.testing.assert_array_equal(got, fs.reference.sample(h, w, key, top_k=6))


def _bias_mask_rows(b, seed):
  """Exact inputs of ``b`` rows with a bias and a random allowed mask:
  ``(h, w, t, controls kwargs)``."""
  h, w = inputs.exact_inputs(b, D, V, scale=1, seed=seed)
  t = inputs.pow2_temperatures(b, greedy_every=7, seed=seed) * 4
  rng = np.random.default_rng(seed)
  kw = dict(logit_bias=jnp.asarray(rng.integers(-2, 3, V), jnp.float32),
            allowed_mask=jnp.asarray(rng.integers(0, 2**32, (b, -(-V // 32)),
                                                  dtype=np.uint32)))
  return h, w, t, kw


def _record_launches(monkeypatch):
  """A list that collects ``(n, batch_blocks)`` of every controls launch
  traced from now on (caches cleared: launches are recorded at tracing)."""
  rows = []
  real = sm90_controls._launch
  monkeypatch.setattr(sm90_controls, "_launch",
                      lambda *a, **k: (rows.append((k["n"], k["cfg"].batch_blocks)),
                                       real(*a, **k))[1])
  jax.clear_caches()
  return rows


class _PerBatchSplit(TestMosaicInterpret):
  """The suite's checks on the per-B split (``batch_invariant=False``):
  log-probabilities through the 128-row blocks (not collected: no Test
  prefix)."""
  backend = MosaicBackend(interpret=True, batch_invariant=False)


PER_B = _PerBatchSplit()


def test_mosaic_launches_of_128_rows_without_truncation(monkeypatch):
  # B > 64 with one sample and no truncation rule, on the per-B split: a
  # block of 128 rows ([128, 8] epilogue chunks, the bias in 8-wide rows);
  # with a truncation rule: one launch of two blocks of 64. Tokens and
  # log-probabilities as the reference's either way.
  b = 80
  h, w, t, kw = _bias_mask_rows(b, seed=9)
  kw["softcap"] = 8.0
  rows = _record_launches(monkeypatch)
  PER_B.check_controls(kw, inputs.row_keys(b, seed=9), h=h, w=w, t=t,
                       return_logprobs=True)
  assert rows == [(128, 1)]
  rows.clear()
  PER_B.check_controls(dict(top_k=30, **kw), jax.random.key(9), h=h, w=w, t=t)
  assert rows == [(64, 2)]


def test_mosaic_wide_blocks_with_bias_mask_and_logprobs(monkeypatch):
  # 136 rows, one sample, no lists, on the per-B split: one launch of two
  # blocks of 128 rows (the second nearly all padding), with the per-row
  # mask and data split by block; tokens and log-probabilities as the
  # reference's.
  b = 136
  h, w, t, kw = _bias_mask_rows(b, seed=10)
  rows = _record_launches(monkeypatch)
  PER_B.check_controls(kw, inputs.row_keys(b, seed=10), h=h, w=w, t=t,
                       return_logprobs=True)
  assert rows == [(128, 2)]


# Per case: the batches compared (a call of the first, the first rows of a
# call of the second), and the launches of the two calls ((rows per block,
# blocks, fixed split, the config's epilogue columns and Dt)).
_ONE_SPLIT_CASES = {
    # With lists: 64-row blocks at every B (the per-B split would run 4 // 3
    # CTAs per block of a 130-row launch), with the epilogue of the calls
    # without lists (chunks of 8 columns).
    "top_k_top_p": (dict(top_k=50, top_p=0.9, return_logprobs=True, return_entropy=True),
                    (64, 130), [(64, 1, True, 8, 128), (64, 3, True, 8, 128)]),
    # Without: 64-row blocks up to B = 64 and 128-row ones past it, one
    # epilogue (chunks of 8 columns) for both; bf16's 64-row blocks keep
    # their Dt = 128 (the same k16 products in the same order).
    "plain_narrow": (dict(return_logprobs=True, return_entropy=True,
                          return_raw_logprobs=True),
                     (40, 64), [(64, 1, True, 8, 128), (64, 1, True, 8, 128)]),
    "plain_wide": (dict(return_logprobs=True, return_entropy=True, return_raw_logprobs=True),
                   (130, 200), [(128, 2, True, 8, 64), (128, 2, True, 8, 64)]),
}


@pytest.mark.parametrize("case", sorted(_ONE_SPLIT_CASES))
def test_float_outputs_take_one_split_for_every_batch(case, monkeypatch):
  # A call that reports floats runs each block split over the vocabulary as
  # one block alone is, so a row's per-warpgroup outputs (scores, t, the
  # log-sum-exp parts, lists, entropy terms, raw lse) are the same bits in
  # calls of two batch sizes. Random inputs, so the sums round. Compared at
  # the kernel's outputs where both calls' blocks have one shape: on the CPU
  # XLA's exp rounds by an element's place in its vectorized loop, so a
  # 64-row block's bits against a 128-row block's, and the merged state's,
  # are compared on the GPU (tests/test_mosaic_gpu.py); here the two
  # blocks' configs agree in what sets a row's arithmetic.
  kw, (small, large), want_launches = _ONE_SPLIT_CASES[case]
  h, w = inputs.random_inputs(large, 128, 1000, seed=11)
  keys = inputs.row_keys(large, seed=11)
  launches = []
  real = sm90_controls._launch
  monkeypatch.setattr(sm90_controls, "_launch", lambda *a, **k: (
      launches.append((k["n"], k["cfg"].batch_blocks, k["fixed_split"],
                       k["cfg"].epi_cols, k["cfg"].tile_d)), real(*a, **k))[1])

  @jax.jit
  def kernel_outputs(h, key):
    outs = []
    monkeypatch.setattr(sm90_controls, "_merge_outputs",
                        lambda fo, io, *a, **k: outs.append((fo, io)) or merge(fo, io, *a, **k))
    p = problem.prepare(h, w, key, temperature=0.7)
    c = controls.prepare_controls(batch=h.shape[0], vocab_size=1000, rows=1000, **kw)
    INTERPRET.controls_state(p, c)
    return outs

  merge = sm90_controls._merge_outputs
  jax.clear_caches()
  (one_fo, one_io), = kernel_outputs(h[:small], keys[:small])
  (all_fo, all_io), = kernel_outputs(h, keys)
  assert launches == want_launches
  assert one_fo.shape == all_fo[:small].shape
  np.testing.assert_array_equal(np.asarray(all_fo[:small]).view(np.uint32),
                                np.asarray(one_fo).view(np.uint32))
  np.testing.assert_array_equal(all_io[:small], one_io)


def test_wide_invariant_blocks_share_the_narrow_ones_arithmetic():
  # A batch-invariant call without lists runs 64-row blocks up to B = 64 and
  # 128-row ones past it: the two configs agree in the tile, the epilogue's
  # chunks and passes, and the one-block grid, so a row meets the same
  # column slots in both; Dt may differ for bf16 (the same k16 products in
  # the same order; bits checked on the GPU), not for 8-bit weights.
  for w_itemsize in (2, 1):
    cfgs = [sm90_controls.config(4096, 151936, 2, n, w_itemsize=w_itemsize,
                                 wide_epilogue=True)
            for n in (sm90_controls.BATCH, sm90_controls.BATCH_WIDE)]
    fields = lambda c: (c.tile_v, c.epi_cols, c.epi_passes, c.epi_unroll,
                        c.num_ctas, c.schedule)
    assert fields(cfgs[0]) == fields(cfgs[1])
    narrow = sm90_controls.config(4096, 151936, 2, sm90_controls.BATCH,
                                  w_itemsize=w_itemsize)
    # The 64-row block keeps its own Dt and wgmma in flight where the
    # weight is bf16 (staged 8-bit tiles have none in flight).
    assert (cfgs[0].tile_d, cfgs[0].mma_in_flight) == (
        (narrow.tile_d, narrow.mma_in_flight) if w_itemsize == 2 else (64, 0))
    assert cfgs[0].epi_cols == 8 != narrow.epi_cols
    n_tiles = -(-151936 // cfgs[0].tile_v)
    target = sm90_common.Target(num_sms=132)
    grids = [sm90_controls._fixed_split(c, target, n_tiles).num_ctas for c in cfgs]
    assert grids[0] == grids[1]
  assert sm90_controls._block_rows(64, samples=1, lists=False, batch_invariant=True,
                                   invariant_rows=sm90_controls.BATCH_WIDE) == (64, True)
  assert sm90_controls._block_rows(65, samples=1, lists=False, batch_invariant=True,
                                   invariant_rows=sm90_controls.BATCH_WIDE) == (128, True)
  # With lists or several samples: 64-row blocks at every B, with the same
  # epilogue as without (outputs that are not controls must not move the
  # floats score_tokens reproduces); asked for 64-row blocks: the 64-row
  # epilogue at every B.
  for b in (1, 64, 65, 1000):
    for samples, lists in ((1, True), (2, False), (4, True)):
      assert sm90_controls._block_rows(b, samples=samples, lists=lists, batch_invariant=True,
                                       invariant_rows=sm90_controls.BATCH_WIDE) == (64, True)
    assert sm90_controls._block_rows(b, samples=1, lists=False, batch_invariant=True,
                                     invariant_rows=sm90_controls.BATCH) == (64, False)
  # Calls for tokens alone keep the per-B blocks and their own epilogue.
  assert sm90_controls._block_rows(65, samples=1, lists=True, batch_invariant=False,
                                   invariant_rows=sm90_controls.BATCH_WIDE) == (64, False)
  with pytest.raises(ValueError, match="invariant_rows"):
    sm90_controls._block_rows(1, samples=1, lists=False, batch_invariant=True,
                              invariant_rows=96)


@pytest.mark.parametrize("key", sorted(KEYS))
def test_samples_only_run_as_rows_of_the_plain_kernel(key, monkeypatch):
  # num_samples with temperature only: S * B <= SAMPLES_AS_ROWS_MAX rows of
  # one plain launch (the controls kernel is not called), same tokens as the
  # reference; above the limit the controls kernel takes them.
  calls = []
  real = sm90_controls.controls_state
  monkeypatch.setattr(sm90_controls, "controls_state",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  h, t = H[:8], T[:8]
  k = KEYS[key] if key == "scalar" else KEYS[key][:8]
  jax.clear_caches()  # traces of other tests must not answer for this one
  for s in (1, 5):
    SUITE.check_controls({}, key=k, h=h, t=t, num_samples=s)
  assert not calls
  monkeypatch.setattr(mosaic_backend, "SAMPLES_AS_ROWS_MAX", 8)
  jax.clear_caches()  # the limit is read at trace time
  SUITE.check_controls({}, key=k, h=h, t=t, num_samples=2)
  assert calls


def test_exact_top_kernel_orders_as_top_n():
  # The early-exit top-N kernel against controls.top_n on rows with many
  # ties, NaN, +-inf and signed zeros (-0.0 == 0.0, ties by id, NaN after
  # -inf), a row that is mostly NaN, columns past ``valid`` that must not
  # be read, and one row not flagged (left alone).
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels import sm90_common
  r = np.random.default_rng(0)
  rows, width, valid, n = 6, 2 * sm90_top.CHUNK, 3001, 24
  t = r.integers(-4, 4, (rows, width)).astype(np.float32)
  t[0, r.integers(0, valid, 40)] = np.nan
  t[1, [5, 9, 3000]] = np.inf
  t[1, [7, 8]] = -np.inf
  t[2] = -np.inf
  t[2, [100, 40, 2999]] = [0.0, -0.0, -0.0]
  t[3, :valid - 10] = np.nan
  t[4] = np.float32(1.5)
  t[:, valid:] = 1e30                      # past the row: never an element
  t[5] = np.nan                            # not flagged
  flags = np.array([1, 1, 1, 1, 1, 0], bool)
  target = sm90_common.Target(interpret=plgpu.InterpretGPUParams(), num_sms=4)
  top = jax.jit(lambda t, f: sm90_top.exact_top(t, f, n, valid, target=target))
  vals, ids = top(jnp.asarray(t), jnp.asarray(flags))
  want_v, want_i = controls.top_n(jnp.asarray(t[:, :valid]), n)
  np.testing.assert_array_equal(np.asarray(ids)[:5], np.asarray(want_i)[:5])
  np.testing.assert_array_equal(np.asarray(vals)[:5].view(np.uint32),
                                np.asarray(want_v)[:5].view(np.uint32))
  # No row flagged: the launch returns at once (whatever its outputs hold).
  jax.block_until_ready(top(jnp.asarray(t), jnp.zeros((rows,), bool)))
  with pytest.raises(ValueError, match="multiple of"):
    sm90_top.exact_top(jnp.zeros((2, 100)), jnp.ones((2,), bool), 4, 90)


@pytest.mark.parametrize("length,m", [(300, 28), (200, 21), (20, 28)])
def test_top_lists_kernel_equals_the_two_key_sort(length, m):
  # The selection kernel that replaces state.top_m(by_id=True)'s sort on
  # the GPU, bit for bit against it (check_top_lists). Interpret mode
  # compiles its unrolled sorting network slowly past 512 candidates (16
  # per lane): the GPU test takes the 924 of a real launch.
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels import sm90_common
  check_top_lists(length, m, sm90_common.Target(interpret=plgpu.InterpretGPUParams(),
                                                num_sms=4))
  with pytest.raises(ValueError, match="at most"):
    sm90_top.top_lists(jnp.zeros((2, 3000)), jnp.zeros((2, 3000), jnp.int32),
                       jnp.zeros((2,)), 4)


@pytest.mark.parametrize("kw,layout,vocab", [
    (dict(), "vd", None),
    (dict(), "dv", 613),
    (dict(logit_bias=1, softcap=20.0, allowed_mask=1), "vd", 650),
    (dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25), "vd", None)],
    ids=["plain", "dv_vocab_below_rows", "bias_softcap_mask", "penalties"])
def test_exact_top_through_the_controls_kernel(kw, layout, vocab):
  # The materializing launch of the controls kernel (the call's transforms
  # and division) feeding the top-N kernel: the flagged rows' top N equal
  # the reference's tempered logits' top_n (interpret mode: ids exactly,
  # values within rounding of XLA:CPU's division), in both layouts and
  # with a vocabulary smaller than the weight's rows.
  b, d, v = 6, 64, 700
  h, w = inputs.exact_inputs(b, d, v, seed=11, layout=layout)
  t = jnp.asarray([0.7, 1.0, 0.0, 1.3, 0.6, 1.0], jnp.float32)
  r = np.random.default_rng(11)
  kw = dict(kw)
  vv = vocab or v
  if "logit_bias" in kw:
    kw["logit_bias"] = jnp.asarray(r.normal(size=vv), jnp.float32).at[3].set(jnp.inf)
    kw["allowed_mask"] = jnp.asarray(r.integers(0, 2**32, (b, -(-vv // 32)), dtype=np.uint32))
  if "repetition_penalty" in kw:
    kw["prompt_ids"] = jnp.asarray(r.integers(-1, vv, (b, 9)), jnp.int32)
    kw["output_ids"] = jnp.asarray(r.integers(0, 60, (b, 12)), jnp.int32)
  check_exact_top(INTERPRET, h, w, jax.random.key(2), t, kw, rows=[0, 2, 3, 5],
                  exact_values=False, layout=layout, vocab_size=vocab)


def test_top_logprobs_lowers_without_a_conditional():
  # top_logprobs alone at shape S, B = 64: the exact path is the two
  # early-exit launches, and the program holds no XLA conditional (whose
  # CUDA graph node alone cost more than the two launches).
  h = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((151936, 4096), jnp.bfloat16)

  def f(h, w, key):
    return fs.sample(h, w, key, top_logprobs=20, backend=LOWER)

  with h100_lowering():
    text = jax.jit(f).trace(h, w, jax.random.key(0)).lower(
        lowering_platforms=("cuda",)).as_text()
  for name in ("flashsample_sm90_controls", "flashsample_sm90_top_lists",
               "flashsample_sm90_tempered_rows", "flashsample_sm90_exact_top"):
    assert name in text, name
  assert "stablehlo.case" not in text and "stablehlo.if" not in text
