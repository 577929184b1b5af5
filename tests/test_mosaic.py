"""The ``mosaic`` backend on the CPU: interpret mode, CUDA lowering, configs.

Interpret mode runs the real Pallas Mosaic GPU kernel on the CPU (it misses
races and accepts some ops that do not lower, DESIGN.md section 3), so the
CUDA lowering of every config the heuristic can pick is checked separately,
and the GPU tests (tests/test_mosaic_gpu.py) run the same suite on an H100.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from flashsample_jax import _validate, api, noise, xla_backend
from pallas_kernels import mosaic_sm90
from tests import inputs
from tests.conftest import has_gpu
from tests.backend_suite import BackendSuite


class TestMosaicInterpret(BackendSuite):
  backend = "mosaic"
  # f32 weights raise NotImplementedError (tested below); D a multiple of 64.
  dtypes = [jnp.bfloat16, jnp.float16]
  # The suite's shapes, with V kept small where interpretation is slow; still
  # B not a multiple of 8 and V a multiple of no tile.
  shapes = [(1, 64, 200), (5, 64, 1000), (16, 128, 517), (37, 64, 650)]
  random_shapes = [(64, 128, 1500), (29, 256, 1100)]

  def run(self, hidden, weight, key, **kw):
    with mosaic_sm90.interpret_mode():
      return fs.sample(hidden, weight, key, backend=self.backend, **kw)


def _interpret_candidates(p, **kw):
  with mosaic_sm90.interpret_mode():
    return jax.block_until_ready(mosaic_sm90.candidates(p, **kw))


def _winning_scores(p, token, offset=0):
  """f32 score of each row's returned token, divided by T in NumPy (IEEE).

  Exact inputs make the logits exact, so the kernel's score must equal this
  bit for bit. (XLA on the CPU may turn ``l / T`` into ``l * (1 / T)``, which
  is 1 ulp off for some T: seen with the xla backend's scores, never with its
  tokens on these inputs.)
  """
  tok = np.asarray(token)
  l = np.asarray(jax.jit(lambda: jax.lax.dot_general(
      p.hidden.astype(jnp.float32), p.weight.astype(jnp.float32),
      (((1,), (1 if p.layout == "vd" else 0,)), ((), ()))))())
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
    mosaic_sm90.TuningConfig(tile_v=64, tile_d=64, max_concurrent_steps=2,
                             epi_cols=8),
    mosaic_sm90.TuningConfig(tile_v=128, tile_d=128, max_concurrent_steps=3,
                             epi_cols=8, epi_unroll=3),
    mosaic_sm90.TuningConfig(tile_v=192, tile_d=64, max_concurrent_steps=1,
                             epi_cols=8),
    # Two compute warpgroups, the accumulator in uneven passes (1 + 2 chunks).
    mosaic_sm90.TuningConfig(tile_v=128, tile_d=64, max_concurrent_steps=2,
                             epi_cols=8, compute_wgs=2, epi_passes=2),
    # Ping-pong: 4 steps per tile over 3 slots (a tile's steps change owner
    # mid-ring); 6 tiles on 4 CTAs (one or two tiles per CTA).
    mosaic_sm90.TuningConfig(tile_v=128, tile_d=64, max_concurrent_steps=3,
                             epi_cols=8, compute_wgs=2, pingpong=True),
    # Ping-pong, 11 tiles on 3 CTAs (4, 4, 3 tiles: both warpgroups end on
    # either parity), 3 chunks per unrolled iteration, 2 steps per tile over
    # 2 slots.
    mosaic_sm90.TuningConfig(tile_v=64, tile_d=128, max_concurrent_steps=2,
                             epi_cols=8, epi_unroll=3, compute_wgs=2,
                             pingpong=True, num_ctas=3),
    # Batch on M (N=21 padded to 64): running best over chunks and tiles.
    mosaic_sm90.TuningConfig(tile_v=128, tile_d=64, max_concurrent_steps=3,
                             epi_cols=8, compute_wgs=2, pingpong=True,
                             batch_major=True),
    # Batch on M, 11 tiles of 64 on 3 CTAs, two chunks per iteration.
    mosaic_sm90.TuningConfig(tile_v=64, tile_d=128, max_concurrent_steps=2,
                             epi_cols=16, epi_unroll=2, compute_wgs=2,
                             pingpong=True, batch_major=True, num_ctas=3),
    # Each slot released as soon as its wgmma is done: a ring of one slot
    # (vocabulary on M) and, batch on M, of two.
    mosaic_sm90.TuningConfig(tile_v=64, tile_d=64, max_concurrent_steps=1,
                             epi_cols=8, compute_wgs=2, pingpong=True,
                             num_ctas=3, mma_in_flight=0),
    mosaic_sm90.TuningConfig(tile_v=128, tile_d=64, max_concurrent_steps=2,
                             epi_cols=16, compute_wgs=2, pingpong=True,
                             batch_major=True, mma_in_flight=0),
    # Ping-pong with a buffer per warpgroup, in uneven passes (1 + 2 chunks
    # of N=24), 11 tiles on 3 CTAs.
    mosaic_sm90.TuningConfig(tile_v=64, tile_d=64, max_concurrent_steps=3,
                             epi_cols=8, compute_wgs=2, pingpong=True,
                             epi_passes=2, num_ctas=3, mma_in_flight=0),
]


@pytest.mark.parametrize("cfg", _CONFIGS, ids=str)
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_configs_match_xla_scores(cfg, layout):
  b, d, v = 21, 256, 700
  h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=3)
  t = jnp.asarray(np.r_[0.0, np.linspace(0.3, 3.0, b - 1)], jnp.float32)
  p = _validate.prepare(h, w, jax.random.key(3), temperature=t,
                        weight_layout=layout, vocab_size=690)
  got = _interpret_candidates(p, config=cfg)
  _assert_same_candidates(got, xla_backend.candidates(p), p)


def test_batch_over_256_is_chunked():
  b, d, v = 300, 64, 130
  h, w = inputs.exact_inputs(b, d, v, seed=4)
  t = inputs.pow2_temperatures(b, greedy_every=7, seed=4)
  for key in (jax.random.key(4), inputs.row_keys(b, seed=4)):
    p = _validate.prepare(h, w, key, temperature=t)
    _assert_same_candidates(_interpret_candidates(p), xla_backend.candidates(p),
                            p)


def test_traced_vocab_offset():
  # A shard of the head: global ids start at a traced offset; the noise
  # counters and the vocab_size mask use global ids.
  b, d, v = 9, 64, 333
  h, w = inputs.exact_inputs(b, d, v, layout="dv", seed=5)
  key = jax.random.key(5)

  p = _validate.prepare(h, w, key, weight_layout="dv", vocab_size=v)
  # As the sharded API would: the whole head's vocab_size (and counters).
  p = _validate.Problem(**{**p.__dict__, "vocab_size": 1000})

  def f(offset, backend):
    if backend == "mosaic":
      return mosaic_sm90.candidates(p, vocab_offset=offset)
    return xla_backend.candidates(p, vocab_offset=offset)

  for offset in (0, 400, 800):  # 800: ids past vocab_size=1000 are masked
    off = jnp.int32(offset)
    with mosaic_sm90.interpret_mode():
      got = jax.jit(lambda o: f(o, "mosaic"))(off)
    want = jax.jit(lambda o: f(o, "xla"))(off)
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
  p = _validate.prepare(h, w, jax.random.key(6), temperature=t)
  got = _interpret_candidates(p)
  want = xla_backend.candidates(p)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  # Row 5 is NaN wherever a hidden row holds a 0 (0 * -inf), else -inf.
  assert set(np.asarray(got[1]).tolist()) <= {5, 17}
  assert np.isnan(np.asarray(got[0])).all()


# -- CUDA lowering on the CPU, every config the heuristic picks ---------------

# N buckets: every multiple of 8 up to 256 (B in 1..256 maps onto them).
_N_BUCKETS = list(range(8, 257, 8))


def _lower_for_cuda(b, d, v, layout, dtype):
  h = jax.ShapeDtypeStruct((b, d), dtype)
  w = jax.ShapeDtypeStruct((v, d) if layout == "vd" else (d, v), dtype)
  t = jax.ShapeDtypeStruct((b,), jnp.float32)

  def f(h, w, key, t):
    p = _validate.prepare(h, w, key, temperature=t, weight_layout=layout)
    return mosaic_sm90.candidates(p)

  with mosaic_sm90.abstract_h100():
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


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_lowering_other_shapes(layout):
  # D = 64 * odd (Dt=64), V not a multiple of 64, B > 256 (two chunks).
  for b, d, v in ((300, 192, 1000), (5, 8192, 128256), (256, 64, 64)):
    _lower_for_cuda(b, d, v, layout, jnp.bfloat16)


def test_heuristic_picks_the_measured_schedules():
  # The settings PERF_LOG v7c / v9 measured best on the Qwen3-8B head.
  rows = 151936
  small = mosaic_sm90.pick_config(32, 4096, rows)
  assert (small.pingpong, small.batch_major, small.tile_v, small.mma_in_flight,
          small.epi_passes) == (True, False, 128, 0, 1)
  mid = mosaic_sm90.pick_config(128, 4096, rows)
  assert (mid.batch_major, mid.epi_cols, mid.mma_in_flight, mid.tile_d,
          mid.max_concurrent_steps) == (True, 8, 0, 64, 4)
  assert mosaic_sm90.pick_config(64, 4096, rows).epi_cols == 16
  wide = mosaic_sm90.pick_config(256, 4096, rows)
  assert (wide.pingpong, wide.batch_major, wide.tile_v, wide.epi_passes,
          wide.tile_d, wide.max_concurrent_steps, wide.mma_in_flight) == (
              True, False, 64, 4, 64, 4, 1)
  # One compute warpgroup (V < 128): the cooperative schedule.
  assert not mosaic_sm90.pick_config(256, 4096, 64).pingpong


def test_heuristic_configs_are_valid():
  for n in _N_BUCKETS:
    for d in (64, 128, 4096, 8192):
      for v in (64, 100, 151936):
        rows = max(64, -(-v // 8) * 8)
        cfg = mosaic_sm90.pick_config(n, d, rows)
        cfg.check_problem(n=cfg.batch_pad(n), dim=d, rows=rows)


# -- config validation ---------------------------------------------------------


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
    (dict(pingpong=True), "pingpong needs compute_wgs=2"),
    (dict(compute_wgs=2, pingpong=True, batch_major=True, epi_passes=2),
     "epi_passes=2: batch_major"),
    (dict(compute_wgs=2, batch_major=True), "batch_major needs pingpong"),
    (dict(compute_wgs=2, pingpong=True, max_concurrent_steps=1),
     "pingpong with mma_in_flight=1 needs max_concurrent_steps >= 2"),
    (dict(mma_in_flight=2), "mma_in_flight=2"),
    (dict(tile_v=64, epi_cols=16, epi_unroll=8, compute_wgs=2, pingpong=True,
          batch_major=True), "must divide tile_v=64"),
])
def test_bad_config_raises_value_error(kw, field):
  with pytest.raises(ValueError, match=field.replace("(", r"\(")):
    mosaic_sm90.TuningConfig(**kw)


def test_config_wrong_type_raises_type_error():
  with pytest.raises(TypeError, match="tile_v"):
    mosaic_sm90.TuningConfig(tile_v=128.0)
  with pytest.raises(TypeError, match="pingpong"):
    mosaic_sm90.TuningConfig(compute_wgs=2, pingpong=1)


def test_config_problem_checks():
  cfg = mosaic_sm90.TuningConfig(tile_v=128, tile_d=128, epi_cols=16)
  with pytest.raises(ValueError, match="epi_cols=16 x epi_unroll=1 must divide"):
    cfg.check_problem(n=24, dim=4096, rows=1024)
  with pytest.raises(ValueError, match="tile_d=128 must divide D=192"):
    cfg.check_problem(n=16, dim=192, rows=1024)
  with pytest.raises(ValueError, match="accumulator registers"):
    cfg.check_problem(n=256, dim=4096, rows=1024)
  # Ping-pong: each warpgroup holds a whole tile (128 x 256 / 128 = 256).
  pp = mosaic_sm90.TuningConfig(tile_v=128, tile_d=64, epi_cols=16,
                                compute_wgs=2, pingpong=True)
  with pytest.raises(ValueError, match="rows per warpgroup 128"):
    pp.check_problem(n=256, dim=4096, rows=1024)
  bm = dataclasses.replace(pp, batch_major=True)
  with pytest.raises(ValueError, match="multiple of 64"):
    bm.check_problem(n=72, dim=4096, rows=1024)
  with pytest.raises(ValueError, match="N=192 x tile_v=128 needs 192"):
    bm.check_problem(n=192, dim=4096, rows=1024)
  big = mosaic_sm90.TuningConfig(tile_v=128, tile_d=128,
                                 max_concurrent_steps=8, epi_cols=16)
  with pytest.raises(ValueError, match="bytes of SMEM"):
    big.check_problem(n=128, dim=4096, rows=1024)


def test_config_is_frozen():
  cfg = mosaic_sm90.TuningConfig()
  with pytest.raises(AttributeError):
    cfg.tile_v = 64


# -- support checks and auto -----------------------------------------------------


@pytest.mark.skipif(has_gpu(), reason="checks the CPU's choice; on an sm90 GPU "
                    "auto picks mosaic (tests/test_api.py)")
def test_auto_picks_xla_on_cpu_and_mosaic_raises():
  h, w = inputs.exact_inputs(4, 64, 128)
  p = _validate.prepare(h, w, jax.random.key(0))
  assert api.resolve_backend("auto", p) == "xla"
  with pytest.raises(NotImplementedError, match="sm90"):
    fs.sample(h, w, jax.random.key(0), backend="mosaic")
  with pytest.raises(NotImplementedError, match="sm90"):
    mosaic_sm90.check_supported(p)


def test_unsupported_problems_raise_not_implemented():
  with mosaic_sm90.interpret_mode():
    h, w = inputs.exact_inputs(4, 96, 128)  # D not a multiple of 64
    with pytest.raises(NotImplementedError, match="D=96"):
      fs.sample(h, w, jax.random.key(0), backend="mosaic")
    h, w = inputs.exact_inputs(4, 64, 128, dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match="float32"):
      fs.sample(h, w, jax.random.key(0), backend="mosaic")
    # auto still works: it moves on to xla.
    tok = fs.sample(h, w, jax.random.key(0))
  np.testing.assert_array_equal(tok, fs.reference.sample(h, w, jax.random.key(0)))


# -- the controls kernel (pallas_kernels/mosaic_controls.py) -------------------


@pytest.mark.parametrize("layout,b,d,v,kw,launch_rows", [
    # Truncation lists and log-sum-exp on the Qwen3-8B head.
    ("vd", 64, 4096, 151936, dict(top_k=50, top_p=0.9, return_logprobs=True),
     [64]),
    # Every control at once, two launches of samples (4 + 2) per 64 rows.
    ("dv", 70, 192, 1000, dict(top_k=5, min_p=0.1, softcap=30.0, logit_bias=1,
                               allowed_mask=1, num_samples=6,
                               return_logprobs=True), [64] * 4),
    ("vd", 5, 8192, 128256, dict(softcap=30.0), [64]),
    # Launches of 128 rows (no truncation, one sample), both layouts.
    ("vd", 200, 4096, 151936, dict(softcap=30.0, logit_bias=1, allowed_mask=1,
                                   return_logprobs=True), [128, 128]),
    ("dv", 100, 192, 1000, dict(logit_bias=1, return_logprobs=True), [128]),
])
def test_controls_kernel_lowers_for_cuda(layout, b, d, v, kw, launch_rows,
                                         monkeypatch):
  from flashsample_jax import controls
  from pallas_kernels import mosaic_controls
  rows, h_rows = [], []
  real = mosaic_controls._launch
  monkeypatch.setattr(mosaic_controls, "_launch",
                      lambda *a, **k: (rows.append(k["n"]), h_rows.append(a[2].shape[0]),
                                       real(*a, **k))[-1])
  h = jax.ShapeDtypeStruct((b, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((v, d) if layout == "vd" else (d, v), jnp.bfloat16)
  t = jax.ShapeDtypeStruct((b,), jnp.float32)

  def f(h, w, key, t):
    p = _validate.prepare(h, w, key, temperature=t, weight_layout=layout)
    kk = dict(kw)
    if "logit_bias" in kk:
      kk["logit_bias"] = jnp.zeros((v,), jnp.float32)
    if "allowed_mask" in kk:
      kk["allowed_mask"] = jnp.zeros((b, -(-v // 32)), jnp.uint32)
    c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, **kk)
    return mosaic_controls.controls_state(p, c)

  with mosaic_sm90.abstract_h100():
    lowered = jax.jit(f).trace(h, w, jax.random.key(0), t).lower(
        lowering_platforms=("cuda",))
  assert "flashsample_sm90_controls" in lowered.as_text()
  assert rows == launch_rows
  # H goes in with each batch chunk's own rows, padded to 8 only (not to
  # the launch's N); a chunk's sample groups are consecutive launches.
  n = launch_rows[0]
  chunks = -(-b // n)
  groups = len(launch_rows) // chunks
  assert h_rows == [-(-min(n, b - c * n) // 8) * 8
                    for c in range(chunks) for _ in range(groups)]
