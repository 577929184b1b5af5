"""Quantized heads (FP8 e4m3/e5m2, int8; ``weight_scale``) in the Mosaic
(sm90) kernels (#40): interpret mode and CUDA lowering on the CPU, and the
tests marked ``gpu`` that only a Hopper GPU can run (the on-chip conversion
is inline PTX, which interpret mode replaces by ``astype``).

The shared suite (tests/backend_suite.py, ``test_quantized_heads*``) runs
the backend on quantized heads through ``fs.sample``; here each weight path
(``sm90_config.WeightPath``) and schedule is pinned by a config, scores are
compared bit for bit, and every 8-bit code goes through the conversion.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import problem
from flashsample_jax.backends import xla as xla_backend
from flashsample_jax.backends.mosaic import MosaicBackend, h100_lowering
from pallas_kernels import rowdata, sm90_common, sm90_config
from pallas_kernels.sm90_config import Schedule, TuningConfig, WeightPath
from tests import inputs

DTYPES = inputs.QUANTIZED_DTYPES
LOWER = MosaicBackend(assume_sm90=True)

# One config per weight path and schedule (docs/design.md, "Quantized
# heads"); V = 520 is a multiple of no tile, 21 rows pad to N = 24 / 64.
_CONFIGS = [
    # Vocabulary on M: "vd" converts into the register A operand, "dv" into
    # a staging tile; 5 tiles on 3 CTAs, 2 steps per tile over 3 slots.
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=128, tile_d=64,
                 max_concurrent_steps=3, epi_cols=8, mma_in_flight=0, num_ctas=3),
    # Dt = 128 (a 128-byte row of 8-bit weights), a buffer per warpgroup in
    # 2 passes; one wgmma in flight asked for (an 8-bit weight's steps wait
    # for theirs all the same: WeightPath).
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=64, tile_d=128,
                 max_concurrent_steps=2, epi_cols=8, epi_passes=2, num_ctas=3),
    # Batch on M: the weight is the B operand, always staged.
    TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128, tile_d=64,
                 max_concurrent_steps=3, epi_cols=8, mma_in_flight=0, num_ctas=3),
    # Batch on M in 2 blocks of 64 rows sharing each tile.
    TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=64, tile_d=128,
                 max_concurrent_steps=2, epi_cols=16, mma_in_flight=0,
                 batch_blocks=2, num_ctas=5),
    # Dt = 256, the register path's wide steps (two 128-byte swizzle rows of
    # 8-bit weights per tile row; sm90_config.WIDE_8BIT_STEP).
    TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=64, tile_d=256,
                 max_concurrent_steps=2, epi_cols=8, mma_in_flight=0, num_ctas=3),
]


def _exact_problem(b, d, v, dtype, layout, per_row, seed, hidden_dtype=jnp.bfloat16):
  h, w, s = inputs.quantized_inputs(b, d, v, dtype=dtype, layout=layout,
                                    per_row=per_row, seed=seed,
                                    hidden_dtype=hidden_dtype)
  t = inputs.pow2_temperatures(b, greedy_every=4, seed=seed)
  return problem.prepare(h, w, jax.random.key(seed), temperature=t,
                         weight_layout=layout, weight_scale=s)


def _same_candidates(backend, p):
  # Power-of-two temperatures: the xla backend's scores are the kernels'
  # bit for bit (no division rounding), on the CPU and the GPU.
  got = jax.block_until_ready(jax.jit(backend.candidates)(p))
  want = jax.jit(xla_backend.candidates)(p)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


# -- configs and the register order (no kernel runs) -----------------------


def test_permute_k_is_the_register_order():
  # A thread of WGMMA_UPCAST_2X holds columns 4j..4j+3 of a 16-column group
  # (j = 0, 2, 1, 3 for lanes q = 0..3 of a quad) in one 32-bit word, which
  # the conversion splits into the pairs (4j, 4j+2) and (4j+1, 4j+3); read
  # as the A layout those are positions (2q, 2q+1) and (2q+8, 2q+9). So
  # position k of the operand holds column order[k] of the tile.
  order = [0] * 16
  for q, j in enumerate([0, 2, 1, 3]):
    order[2 * q], order[2 * q + 1] = 4 * j, 4 * j + 2
    order[2 * q + 8], order[2 * q + 9] = 4 * j + 1, 4 * j + 3
  assert sorted(order) == list(range(16))
  x = np.arange(64).reshape(2, 32)
  got = np.asarray(sm90_common.permute_k(jnp.asarray(x), 1))
  want = np.concatenate([x[:, :16][:, order], x[:, 16:][:, order]], axis=1)
  np.testing.assert_array_equal(got, want)
  # Permuting W's and H's columns alike keeps every dot product.
  r = np.random.default_rng(0)
  w, h = r.integers(-3, 4, (5, 64)), r.integers(-3, 4, (3, 64))
  np.testing.assert_array_equal(
      np.asarray(sm90_common.permute_k(jnp.asarray(w), 1) @ sm90_common.permute_k(jnp.asarray(h), 1).T),
      w @ h.T)


def test_exact_top_runs_the_config_of_the_pass(monkeypatch):
  # Found by review: top_logprobs' early-exit launch (materializing t) kept
  # the 64-row lists' own config (Dt = 128) while the pass with lists ran
  # the wide epilogue, where an 8-bit weight takes Dt = 64: its t from
  # another dot. Traced only (the launches' configs), S-like D = 256.
  from pallas_kernels import sm90_controls
  seen = []
  real = sm90_controls._launch
  monkeypatch.setattr(sm90_controls, "_launch", lambda *a, **k: (
      seen.append((k["cfg"].tile_d, k["cfg"].epi_cols, k["spec"].materialize)),
      real(*a, **k))[1])
  h = jax.ShapeDtypeStruct((4, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((1024, 256), jnp.float8_e4m3fn)
  s = jax.ShapeDtypeStruct((1024,), jnp.float32)
  backend = MosaicBackend(interpret=True)
  jax.jit(lambda h, w, s: fs.sample(h, w, jax.random.key(0), weight_scale=s,
                                    top_logprobs=5, backend=backend)).trace(h, w, s)
  passes = {cfg[:2] for cfg in seen if not cfg[2]}
  tops = {cfg[:2] for cfg in seen if cfg[2]}
  assert passes == tops == {(64, 8)}, seen


def test_weight_paths_and_configs():
  path = sm90_config.weight_path
  assert path(Schedule.PINGPONG_VOCAB_M, "vd", 1) is WeightPath.REGISTERS
  assert path(Schedule.PINGPONG_VOCAB_M, "dv", 1) is WeightPath.STAGED
  assert path(Schedule.PINGPONG_BATCH_M, "vd", 1) is WeightPath.STAGED
  assert path(Schedule.PINGPONG_VOCAB_M, "vd", 2) is WeightPath.DIRECT
  for n in (8, 16, 48, 64, 128, 192, 256):
    for layout in ("vd", "dv"):
      bf16 = sm90_config.pick_config(n, 4096, 151936, 2, layout=layout)
      q = sm90_config.pick_config(n, 4096, 151936, 2, 1, layout=layout)
      # bf16's schedule, but the register path (vocabulary on M, 128-row
      # tiles) up to N = 128 for "vd", where bf16 puts the batch on M.
      register = layout == "vd" and n <= sm90_config.REGISTER_PATH_MAX_N
      want = ((Schedule.PINGPONG_VOCAB_M, 128) if register
              else (bf16.schedule, bf16.tile_v))
      assert (q.schedule, q.tile_v) == want, (n, layout)
      staged = path(q.schedule, layout, 1) is WeightPath.STAGED
      assert staged is (layout == "dv" or q.schedule.batch_major)
      # Half the bytes per slot: a ring at least as deep (in elements of D)
      # where nothing is staged and the schedule is bf16's.
      if not staged and q.schedule == bf16.schedule and q.tile_v == bf16.tile_v:
        assert (q.max_concurrent_steps * q.tile_d
                >= bf16.max_concurrent_steps * bf16.tile_d)
      assert q.mma_in_flight == 0
      n_pad = q.batch_pad(n)
      assert q.smem_bytes(n_pad, 2, 1, staged) <= sm90_config.SMEM_BUDGET
      q.check_problem(n=n_pad, dim=4096, rows=151936, w_itemsize=1, staged=staged)
  # The register path's wide steps where D and the slots allow (B <= 48:
  # 4 slots at N <= 16, 3 at 24-48, 2 from 64 on, too few; gpt-oss'
  # D = 2880's last step runs 192 columns past D; not where D = 320 would
  # run 192 past, nor where 128 x 128 tiles divide D = 1408: not
  # measured), the 128 x 128 tiles elsewhere, also where 128 does not
  # divide D (gpt-oss at N > 48).
  wide = sm90_config.WIDE_8BIT_STEP
  for n, d, want in ((8, 4096, True), (16, 8192, True), (16, 2048, True), (24, 4096, True),
                     (48, 8192, True), (48, 2880, True), (64, 4096, False),
                     (64, 2880, False), (128, 8192, False), (16, 2880, True),
                     (16, 320, False), (16, 1408, False)):
    q = sm90_config.pick_config(n, d, 151936, 2, 1)
    assert ((q.tile_v, q.tile_d) == (wide.tile_v, wide.tile_d)) is want, (n, d, q)
    assert q.max_concurrent_steps >= (wide.min_steps if want else 2)
    assert sm90_config.wide_8bit_steps(n, d, 151936) is want
    assert not sm90_config.wide_8bit_steps(n, d, 151936, layout="dv")
    if not want:
      assert (q.tile_v, q.tile_d) == (128, 128 if d >= 128 else 64), (n, d, q)
  blocked = sm90_config.pick_blocked_config(512, 8192, 128256, 2, "NVIDIA H100", 1)
  assert blocked.mma_in_flight == 0 and blocked.batch_blocks == 4
  with pytest.raises(ValueError, match="bf16/f16 weights only"):
    TuningConfig().check_problem(n=8, dim=64, rows=64, w_itemsize=1)


def test_small_vocabularies_are_refused_by_name():
  # Fewer than 128 weight rows leave one compute warpgroup (the cooperative
  # schedule), which takes bf16/f16 only: NotImplementedError, so that auto
  # takes another backend.
  h, w, s = inputs.quantized_inputs(3, 64, 100, seed=1)
  with pytest.raises(NotImplementedError, match="at least 128 weight rows"):
    fs.sample(h, w, jax.random.key(0), weight_scale=s, backend=MosaicBackend(interpret=True))
  assert fs.which_backend(h, w, jax.random.key(0), weight_scale=s) != "mosaic"


# -- interpret mode --------------------------------------------------------


@pytest.mark.parametrize("cfg", _CONFIGS, ids=str)
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_configs_match_xla_scores(cfg, layout):
  # Every 8-bit dtype on the first config's two paths (register A, staging
  # tile); one dtype per other (config, layout), in turn (CI time: the
  # conversions do not depend on the schedule).
  backend = MosaicBackend(interpret=True, config=cfg)
  j = _CONFIGS.index(cfg)
  for i, dt in enumerate(DTYPES):
    if j and i != (j + ("vd", "dv").index(layout)) % len(DTYPES):
      continue
    p = _exact_problem(21, max(128, cfg.tile_d), 520, dt, layout, per_row=i != 1, seed=i)
    _same_candidates(backend, p)


@pytest.mark.parametrize("cfg", [_CONFIGS[-1], _CONFIGS[3]], ids=["wide", "batch_blocks"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_steps_that_do_not_divide_d(cfg, layout):
  # D = 320 in steps of 256 (128): the last step's copies of W and H run
  # 192 (64) columns past their last (interpret mode, as the TMA, fills
  # zeros: sm90_common.step_count); a column counted twice or skipped would
  # change the exact scores. Vocabulary on M (register A operand and
  # staging tile) and batch on M in two blocks.
  p = _exact_problem(21, 320, 520, jnp.float8_e4m3fn, layout, per_row=True, seed=5)
  _same_candidates(MosaicBackend(interpret=True, config=cfg), p)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_infinite_weights_next_to_the_last_step(layout):
  # e5m2 codes of +-inf, read as f16 infinities with f16 hidden states, in
  # the columns the step before the last takes (D = 320 in steps of 256):
  # the last step must not multiply them again (0 x inf = NaN). Rows with
  # one inf score it (NaN where H's column is 0, in the reference too);
  # tokens equal the reference's.
  h, w, s = inputs.quantized_inputs(21, 320, 520, dtype=jnp.float8_e5m2, layout=layout,
                                    seed=7, hidden_dtype=jnp.float16)
  wv = np.asarray(w if layout == "vd" else w.T).copy()
  inf = np.array([np.inf, -np.inf], jnp.float8_e5m2)
  wv[::7, 100] = inf[0]
  wv[3::7, 200] = inf[1]
  w = jnp.asarray(wv if layout == "vd" else wv.T)
  cfg = _CONFIGS[-1]
  kw = dict(temperature=0.5, weight_layout=layout, weight_scale=s)
  for key in jax.random.split(jax.random.key(0), 2):
    want = fs.reference.sample(h, w, key, **kw)
    got = fs.sample(h, w, key, backend=MosaicBackend(interpret=True, config=cfg), **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_step_count():
  assert sm90_common.step_count(2880, 256) == 12
  assert sm90_common.step_count(4096, 256) == 16
  assert sm90_common.step_count(320, 128) == 3
  with pytest.raises(ValueError, match="multiple of 64"):
    sm90_common.step_count(2900, 256)


def test_f16_hidden_states_multiply_in_f16():
  # An f16 hidden state takes the f16 conversions (e4m3 by the hardware's,
  # e5m2 as the high byte of an f16, int8 by the f16 magic number).
  for i, dt in enumerate(DTYPES):
    layout = ("vd", "dv")[i % 2]
    h, w, s = inputs.quantized_inputs(6, 128, 300, dtype=dt, layout=layout,
                                      seed=i, hidden_dtype=jnp.float16)
    t = inputs.pow2_temperatures(6, greedy_every=3, seed=i)
    kw = dict(temperature=t, weight_layout=layout, weight_scale=s)
    want = fs.reference.sample(h, w, jax.random.key(i), **kw)
    got = fs.sample(h, w, jax.random.key(i), backend=MosaicBackend(interpret=True), **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# -- CUDA lowering on the CPU ----------------------------------------------


def _lower(b, d, v, layout, dtype, per_row=True, hidden=jnp.bfloat16, **controls):
  h = jax.ShapeDtypeStruct((b, d), hidden)
  w = jax.ShapeDtypeStruct((v, d) if layout == "vd" else (d, v), dtype)
  t = jax.ShapeDtypeStruct((b,), jnp.float32)
  s = jax.ShapeDtypeStruct((v,) if per_row else (), jnp.float32)

  def f(h, w, key, t, s):
    return fs.sample(h, w, key, temperature=t, weight_layout=layout,
                     weight_scale=s, backend=LOWER, **controls)

  with h100_lowering():
    text = jax.jit(f).trace(h, w, jax.random.key(0), t, s).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  return text


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_heuristic_configs_lower_for_cuda(layout):
  # Every schedule the heuristic picks (N = 8 .. 256, batch blocks), each
  # dtype and scale kind, on the Qwen3-8B head.
  for i, b in enumerate((1, 16, 48, 64, 128, 192, 256, 300)):
    dt = DTYPES[i % 3]
    text = _lower(b, 4096, 151936, layout, dt, per_row=i % 2 == 0)
    # The 8-bit weight goes to the kernel as it is: no converted copy.
    assert f"tensor<{151936 if layout == 'vd' else 4096}x" \
           f"{4096 if layout == 'vd' else 151936}x{_mlir(dt)}>" in text


def test_slot_kernel_lowers_for_cuda():
  # The heads' shapes at one row (wide steps), 16 rows and 48 (e5m2,
  # gpt-oss' D = 2880, its last step past D).
  from pallas_kernels import sm90_slots  # pylint: disable=import-outside-toplevel
  for b, d, v, dt in [(1, 4096, 151936, jnp.float8_e4m3fn), (16, 8192, 128256, jnp.int8),
                      (48, 2880, 201088, jnp.float8_e5m2)]:
    f = functools.partial(sm90_slots.slot_entries, layout="vd", vocab_size=v,
                          target=sm90_common.Target())
    args = (jax.ShapeDtypeStruct((b, d), jnp.bfloat16), jax.ShapeDtypeStruct((v, d), dt),
            jax.ShapeDtypeStruct((rowdata.RowLayout().rows, b), jnp.uint32), 0)
    with h100_lowering():
      text = jax.jit(f).trace(*args, scale=jax.ShapeDtypeStruct((v,), jnp.float32)).lower(
          lowering_platforms=("cuda",)).as_text()
    assert "flashsample_sm90_slots" in text


def _mlir(dt):
  return {"float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2",
          "int8": "i8"}[jnp.dtype(dt).name]


def test_controls_and_f16_lower_for_cuda():
  # The controls kernel (staged) with lists, bias and a mask; the exact
  # top-N path (its materializing launch); f16 hidden states; D = 2880
  # (Dt = 64, 64-byte rows of 8-bit weights; "vd" at B = 4: the wide steps,
  # their last past D, in the 64-byte swizzle); float outputs without lists on
  # the batch-invariant split (a 64-row block with the 128-row epilogue, or
  # 128-row blocks).
  for i, dt in enumerate(DTYPES):
    layout = ("vd", "dv")[i % 2]
    _lower(16, 4096, 151936, layout, dt, top_k=50, top_p=0.9,
           logit_bias=jnp.zeros((151936,), jnp.float32), return_logprobs=True)
    _lower((16, 100)[i % 2], 4096, 151936, layout, dt, return_logprobs=True,
           return_entropy=True)
    _lower(8, 2048, 151936, layout, dt, per_row=False, top_logprobs=5)
    _lower(4, 2880, 201088, layout, dt, hidden=jnp.float16)
    _lower(100, 2880, 201088, layout, dt, top_k=20)


# -- on the GPU ------------------------------------------------------------


def _codes(dtype):
  """Every finite value of ``dtype`` (FP8 NaN and inf codes excluded: the
  bf16 route decodes them as finite numbers, see sm90_common)."""
  bits = np.arange(256, dtype=np.uint8)
  vals = bits.view(np.int8) if dtype == jnp.int8 else np.asarray(
      jnp.asarray(bits).view(dtype).astype(jnp.float32))
  return np.asarray(vals, np.float32)[np.isfinite(np.asarray(vals, np.float32))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("hidden", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_every_code_converts_exactly(dtype, hidden):
  # Row r's hidden state is +-1 at column r and W's row r holds code r at
  # column r (0 elsewhere): each greedy row's best logit is |value of code
  # r|, at id r, through every column position of a 16-column group (the
  # register path's order) and each path: registers ("vd", vocabulary on
  # M), staged ("dv"; batch on M).
  vals = _codes(dtype)
  n = vals.size
  d = -(-n // 64) * 64
  v = max(128, d)
  w = np.zeros((v, d), np.float32)
  w[np.arange(n), np.arange(n)] = vals
  # Launches of 48 rows, all of one shape (one compilation): the padding
  # rows' hidden states are 0, their best logit 0.
  vals = np.pad(vals, (0, -n % 48))
  n = vals.size
  h = np.zeros((n, d), np.float32)
  h[np.arange(n), np.arange(n) % d] = np.where(vals < 0, -1.0, 1.0) * (vals != 0)
  w8 = jnp.asarray(w).astype(dtype)
  vm = TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=128, tile_d=64,
                    max_concurrent_steps=3, epi_cols=16, mma_in_flight=0)
  bm = TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128, tile_d=64,
                    max_concurrent_steps=3, epi_cols=16, mma_in_flight=0)
  for layout, cfg in (("vd", vm), ("dv", vm), ("vd", bm)):
    wl = w8 if layout == "vd" else w8.T
    for b0 in range(0, n, 48):
      rows = slice(b0, b0 + 48)
      p = problem.prepare(jnp.asarray(h[rows], hidden), wl, jax.random.key(0),
                          temperature=0.0, weight_layout=layout,
                          weight_scale=jnp.float32(1.0))
      score, tok = jax.jit(MosaicBackend(config=cfg).candidates)(p)
      want = np.abs(vals[rows])
      pos = want > 0
      np.testing.assert_array_equal(np.asarray(score), want, err_msg=f"{layout} {cfg}")
      np.testing.assert_array_equal(np.asarray(tok)[pos], np.arange(n)[rows][pos])


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _CONFIGS, ids=str)
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_configs_exact_scores_on_the_gpu(cfg, layout):
  backend = MosaicBackend(config=cfg)
  for i, dt in enumerate(DTYPES):
    p = _exact_problem(21, 512, 2000, dt, layout, per_row=i != 1, seed=i)
    _same_candidates(backend, p)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_heuristic_exact_on_a_real_head_size(layout):
  # The heuristic's launches at every batch bucket on a 4096-wide head of
  # 32000 rows: tokens equal to the reference's on exact inputs.
  for i, b in enumerate((1, 16, 48, 64, 128, 192, 300)):
    dt = DTYPES[i % 3]
    h, w, s = inputs.quantized_inputs(b, 4096, 32000, dtype=dt, layout=layout,
                                      per_row=i % 2 == 0, seed=i)
    t = inputs.pow2_temperatures(b, greedy_every=5, seed=i)
    kw = dict(temperature=t, weight_layout=layout, weight_scale=s)
    key = jax.random.key(i)
    got = fs.sample(h, w, key, backend="mosaic", **kw)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(fs.reference.sample(h, w, key, **kw)),
                                  err_msg=f"B={b} {jnp.dtype(dt).name}")


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16])
def test_wide_steps_at_gpt_oss_width(b):
  # D = 2880 (gpt-oss): the heuristic's wide steps, the last of which
  # runs 192 columns past the weight's and H's last (TMA zeros:
  # sm90_common.step_count); scores equal XLA's bit for bit, tokens the
  # reference's.
  d, v = 2880, 5003
  assert sm90_config.wide_8bit_steps(b, d, v)
  for i, dt in enumerate(DTYPES):
    p = _exact_problem(b, d, v, dt, "vd", per_row=i != 1, seed=b + i)
    _same_candidates(MosaicBackend(), p)
  h, w, s = inputs.quantized_inputs(b, d, v, seed=b)
  key = jax.random.key(b)
  np.testing.assert_array_equal(
      np.asarray(fs.sample(h, w, key, temperature=0.7, weight_scale=s, backend="mosaic")),
      np.asarray(fs.reference.sample(h, w, key, temperature=0.7, weight_scale=s)))


@pytest.mark.gpu
@pytest.mark.parametrize("b", [24, 48, 64, 128])
def test_register_path_up_to_128_rows(b):
  # The heuristic's register path (vocabulary on M, 128-row tiles) past
  # 16 rows, up to REGISTER_PATH_MAX_N: the wide steps in 3 slots up to
  # B = 48 (at D = 8192 too), 128-column steps beyond; at D = 2880 the last
  # step runs past D. Scores equal XLA's bit for bit.
  wide = b <= 48
  dims = ((4096, DTYPES[b % 3]), (2880, DTYPES[(b + 1) % 3]))
  if wide:
    dims += ((8192, DTYPES[(b + 2) % 3]),)
  for i, (d, dt) in enumerate(dims):
    cfg = sm90_config.pick_config(sm90_config.batch_side(b), d, 5003, 2, 1)
    assert cfg.schedule is Schedule.PINGPONG_VOCAB_M, cfg
    assert cfg.tile_d == (sm90_config.WIDE_8BIT_STEP.tile_d if wide else 128), cfg
    assert sm90_config.wide_8bit_steps(b, d, 5003) is wide
    p = _exact_problem(b, d, 5003, dt, "vd", per_row=i != 1, seed=b + i)
    _same_candidates(MosaicBackend(), p)


@pytest.mark.gpu
def test_infinite_weights_at_gpt_oss_width():
  # The wide steps' last step at D = 2880 runs past the last column (TMA
  # zeros, sm90_common.step_count): e5m2 infinities with f16 hidden states in
  # the columns the step before takes and in the last ones give the
  # reference's tokens. H's columns there are nonzero:
  # +-inf logits, no NaN (0 x inf).
  d, v = 2880, 5003
  h, w, s = inputs.quantized_inputs(16, d, v, dtype=jnp.float8_e5m2, seed=3,
                                    hidden_dtype=jnp.float16)
  assert sm90_config.wide_8bit_steps(16, d, v, itemsize=2)
  sign = jnp.where(jnp.arange(16) % 2 == 0, 1.0, -1.0).astype(h.dtype)
  h = h.at[:, 2700].set(sign).at[:, 2879].set(-sign)
  wv = np.asarray(w).copy()
  inf = np.array([np.inf, -np.inf], jnp.float8_e5m2)
  wv[::5, 2700] = inf[0]
  wv[2::5, 2879] = inf[1]
  w = jnp.asarray(wv)
  for key in jax.random.split(jax.random.key(1), 2):
    got = fs.sample(h, w, key, temperature=0.5, weight_scale=s, backend="mosaic")
    want = fs.reference.sample(h, w, key, temperature=0.5, weight_scale=s)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16, 40])
def test_wide_steps_with_non_power_of_two_temperatures(b):
  # The heuristic's wide 8-bit steps (D = 512, B <= 48) with temperatures
  # that round when divided: the winning scores equal the xla backend's bit
  # for bit, and the tokens the reference's, with a shared and per-row keys.
  d, v = 512, 5003
  assert sm90_config.wide_8bit_steps(b, d, v)
  h, w, s = inputs.quantized_inputs(b, d, v, seed=b)
  t = jnp.asarray(np.resize([0.7, 0.6, 1.3, 0.0], b), jnp.float32)
  for key in (jax.random.key(b), inputs.row_keys(b, seed=b)):
    p = problem.prepare(h, w, key, temperature=t, weight_scale=s)
    _same_candidates(MosaicBackend(), p)
    got = fs.sample(h, w, key, temperature=t, weight_scale=s, backend="mosaic")
    want = fs.reference.sample(h, w, key, temperature=t, weight_scale=s)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
