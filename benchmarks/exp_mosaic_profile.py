"""Where does the mosaic kernel's time go? (PERF_LOG v4 groundwork)

Two modes, both on the GPU:

* ``time``: median us of ``mosaic_sm90.candidates`` at shape S for several B,
  for the real kernel and for ablations that replace a piece of the epilogue
  by a cheap stand-in of the same data dependence (monkeypatched at trace
  time, so the kernel source is untouched): ``no_logs`` (threefry bits
  straight to a float), ``no_noise`` (no threefry either), ``mul`` (multiply
  by 1/T instead of dividing). Tokens of ablations are meaningless.
* ``ncu``: run one config a few times so that Nsight Compute can profile one
  launch (``ncu -k regex:... --launch-skip 2 --launch-count 1``).

  python3 benchmarks/exp_mosaic_profile.py time
  python3 benchmarks/exp_mosaic_profile.py ncu 256
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import _timing
from flashsample_jax import _validate, noise
from pallas_kernels import mosaic_sm90 as m

D, V = 4096, 151936


def _inputs(b):
  w = (jax.random.normal(jax.random.key(0), (V, D), jnp.float32)
       * (3.0 / np.sqrt(D))).astype(jnp.bfloat16)
  h = jax.random.normal(jax.random.key(b), (b, D), jnp.bfloat16)
  return h, w


def _fn(config=None):
  return jax.jit(lambda h, w: m.candidates(
      _validate.prepare(h, w, jax.random.key(1), temperature=0.9),
      config=config))


def _cheap_bits(k0, k1, hi, lo):
  del k0, k1
  return lax.bitcast_convert_type((hi ^ lo) & np.uint32(0x007FFFFF), jnp.float32)


def _no_logs(k0, k1, hi, lo):
  bits = noise.random_bits(k0, k1, hi, lo)
  return lax.bitcast_convert_type((bits >> 9) | np.uint32(0x3F800000), jnp.float32)


VARIANTS = {
    "full": {},
    "no_logs": {"gumbel": _no_logs},
    "no_noise": {"gumbel": _cheap_bits},
    "mul": {"div": lambda x, y: x * (1.0 / y)},
}


def time_mode(batches=(64, 128)):
  orig_gumbel, orig_div = noise.gumbel, m._div_rn
  rows = []
  for b in batches:
    h, w = _inputs(b)
    for name, patch in VARIANTS.items():
      noise.gumbel = patch.get("gumbel", orig_gumbel)
      m._div_rn = patch.get("div", orig_div)
      try:
        f = _fn()
        jax.block_until_ready(f(h, w))
        us, _ = _timing.median_us(f, h, w, reps=15)
      finally:
        noise.gumbel, m._div_rn = orig_gumbel, orig_div
      line = f"S B={b:4d} {name:9s} {us:8.1f} us  cfg={m.pick_config(m.batch_side(b), D, V)}"
      print(line, flush=True)
      rows.append(line)
  print("\n".join(rows))


def _stream_steps_h_once(*, w_ref, h_ref, w_smem, h_smem, full, empty, layout,
                         vt, dt, S, k_steps, rows, cta, num_ctas, total):
  """Ablation (wrong tokens): each slot gets its H slice once, later steps
  load only the weight slice (the barrier's second arrival is a plain one),
  so the H bytes from L2 fall from (N / Vt) x the weight bytes to ~0."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  @pl.loop(0, total)
  def _step(s):
    slot, i, k = m._ring_step(s, S=S, k_steps=k_steps, empty=empty)
    start = m._tile_start(cta + i * num_ctas, vt, rows)
    w_src = w_ref.at[pl.ds(start, vt), pl.ds(k * dt, dt)]
    bar = full.at[lax.rem(i, 2) * S + slot]
    plgpu.copy_gmem_to_smem(w_src, w_smem.at[slot], bar)

    @pl.when(s < S)
    def _():
      plgpu.copy_gmem_to_smem(h_ref.at[:, pl.ds(k * dt, dt)], h_smem.at[slot], bar)

    @pl.when(s >= S)
    def _():
      plgpu.barrier_arrive(bar)

  @pl.loop(jnp.maximum(total - S, 0), total)
  def _drain(s):
    plgpu.barrier_wait(empty.at[lax.rem(s, S)])


def chunk_mode(batches=(192, 256)):
  """B > 128: one v3 launch (N = 256, cooperative) vs two batch-major
  launches of <= 128 rows (two passes over W, PERF_LOG v7)."""
  global D, V
  rows = []
  for d, v in ((4096, 151936), (8192, 128256)):
    D, V = d, v
    for b in batches:
      h, w = _inputs(b)
      ref = None
      for chunk, cfg in ((256, None), (128, None),
                         (128, _bm(max_concurrent_steps=4, mma_in_flight=1))):
        m.CHUNK_ROWS = chunk
        try:
          f = _fn(cfg)
          tok = np.asarray(f(h, w)[1])
          us, _ = _timing.median_us(f, h, w, reps=15, inner=30)
          same = ref is None or np.array_equal(tok, ref)
          ref = tok if ref is None else ref
          line = (f"D={D} B={b:4d} chunk={chunk} {us:8.1f} us same={same} "
                  f"cfg={cfg or m.pick_config(m.batch_side(m.batch_chunks(b)[0][1]), D, V)}")
        except Exception as e:  # noqa: BLE001
          line = f"D={D} B={b} chunk={chunk} FAILED {type(e).__name__}: {str(e)[:200]}"
        finally:
          m.CHUNK_ROWS = m.MAX_N
        print(line, flush=True)
        rows.append(line)
  print("\n".join(rows))


def l2_mode(batches=(64, 128)):
  """Is the H traffic from L2 what holds B=128 above the floor? Times the
  real kernel, no noise, H loaded once per slot, and both (tokens of the
  ablations are meaningless)."""
  orig_gumbel, orig_stream = noise.gumbel, m._stream_steps
  rows = []
  for b in batches:
    h, w = _inputs(b)
    for name in ("full", "no_noise", "h_once", "h_once+no_noise"):
      if "no_noise" in name:
        noise.gumbel = _cheap_bits
      if "h_once" in name:
        m._stream_steps = _stream_steps_h_once
      try:
        f = _fn()
        jax.block_until_ready(f(h, w))
        us, _ = _timing.median_us(f, h, w, reps=15, inner=30)
        line = f"S B={b:4d} {name:16s} {us:8.1f} us"
      except Exception as e:  # noqa: BLE001
        line = f"S B={b:4d} {name:16s} FAILED {type(e).__name__}: {str(e)[:200]}"
      finally:
        noise.gumbel, m._stream_steps = orig_gumbel, orig_stream
      print(line, flush=True)
      rows.append(line)
  print("\n".join(rows))


def ncu_mode(b):
  h, w = _inputs(b)
  f = _fn()
  for _ in range(4):
    jax.block_until_ready(f(h, w))
  print("done", b, m.pick_config(m.batch_side(b), D, V))


C = m.TuningConfig
# The v3 heuristic's configs (cooperative: both warpgroups share each tile).
V3 = {
    8: C(tile_v=128, tile_d=128, max_concurrent_steps=5, epi_cols=16,
         compute_wgs=2),
    64: C(tile_v=128, tile_d=128, max_concurrent_steps=3, epi_cols=16,
          epi_unroll=2, compute_wgs=2),
    128: C(tile_v=128, tile_d=64, max_concurrent_steps=5, epi_cols=16,
           epi_unroll=2, compute_wgs=2, epi_passes=2),
}


def _pp(**kw):
  base = dict(tile_v=128, tile_d=64, max_concurrent_steps=4, epi_cols=16,
              compute_wgs=2, pingpong=True)
  return C(**{**base, **kw})


V4 = {8: _pp(tile_d=128, max_concurrent_steps=5),
      64: _pp(tile_d=128, max_concurrent_steps=3),
      128: _pp()}


def _bm(**kw):
  base = dict(tile_v=128, tile_d=64, max_concurrent_steps=4, epi_cols=16,
              compute_wgs=2, pingpong=True, batch_major=True)
  return C(**{**base, **kw})


V5 = {64: _bm(tile_d=128, max_concurrent_steps=3),
      128: _bm(max_concurrent_steps=4)}

AB = {
    8: [V4[8], None],
    64: [None, _bm(epi_cols=8, tile_d=128, max_concurrent_steps=3)],
    # Chunks of [N, 8]: half the loop body (the [128, 16] body is 36 KB of
    # SASS, over the instruction cache; PERF_LOG v5).
    128: [None, _bm(epi_cols=8), _bm(epi_cols=8, epi_unroll=2)],
    # N=256: v3 (heuristic) vs batch on M with 64-row tiles (H read 4x).
    # (Per-warpgroup accumulator buffers, tried once, left 2 slots: 1.8-2x
    # slower at N=128 and N=256; results/v4/ab_separate_acc_h200.log.)
    256: [None, _bm(tile_v=64, max_concurrent_steps=3)],
}


# Ring depth (PERF_LOG v7): the consumer holds two slots with one wgmma in
# flight (released one step late); mma_in_flight=0 releases each slot as
# soon as its wgmma is done, so one more slot of the ring is loading.
DEPTH = {
    16: [None, dataclasses.replace(m.pick_config(16, 4096, 151936), mma_in_flight=0)],
    64: [None, _bm(tile_d=128, max_concurrent_steps=3, mma_in_flight=0),
         _bm(tile_d=64, max_concurrent_steps=6, mma_in_flight=0),
         _bm(tile_d=64, max_concurrent_steps=7, mma_in_flight=0)],
    128: [None, _bm(max_concurrent_steps=4, mma_in_flight=0),
          _bm(tile_d=128, max_concurrent_steps=2, mma_in_flight=0)],
}


# 16 < N <= 64: vocabulary on M (v4, as N <= 16) vs batch on M (v5, N
# padded to 64), PERF_LOG v7c.
SMALLN = {
    b: [None] + [C(tile_v=128, tile_d=128, max_concurrent_steps=4, epi_cols=16,
                   compute_wgs=2, pingpong=True, mma_in_flight=f) for f in (0, 1)]
    for b in (24, 32, 48)
}
SMALLN[64] = [None] + [C(tile_v=128, tile_d=128, max_concurrent_steps=3, epi_cols=16,
                         compute_wgs=2, pingpong=True, mma_in_flight=f) for f in (0, 1)]


def ab_mode(batches=(64, 128), table=None, shapes=((4096, 151936), (8192, 128256))):
  """Configs side by side in one process; tokens compared with the first."""
  global D, V
  table = table or AB
  rows = []
  for d, v in shapes:
    D, V = d, v
    for b in batches:
      h, w = _inputs(b)
      ref = None
      for cfg in table[b]:
        f = _fn(cfg)
        try:
          tok = np.asarray(f(h, w)[1])
          us, _ = _timing.median_us(f, h, w, reps=15)
        except Exception as e:  # noqa: BLE001
          rows.append(f"D={D} B={b} {cfg} FAILED {type(e).__name__}: {str(e)[:150]}")
          print(rows[-1], flush=True)
          continue
        ref = tok if ref is None else ref
        cfg = cfg or m.pick_config(m.batch_side(b), D, V)
        line = (f"D={D} B={b:4d} {us:8.1f} us same={np.array_equal(tok, ref)} "
                f"Vt={cfg.tile_v} Dt={cfg.tile_d} S={cfg.max_concurrent_steps} "
                f"C={cfg.epi_cols} u={cfg.epi_unroll} wgs={cfg.compute_wgs} "
                f"passes={cfg.epi_passes} pp={cfg.pingpong} "
                f"bm={cfg.batch_major} inflight={cfg.mma_in_flight}")
        print(line, flush=True)
        rows.append(line)
  print("\n".join(rows))


def calls_mode(b):
  """Every kernel of a full fs.sample call (run under ncu to list them)."""
  import flashsample_jax as fs
  h, w = _inputs(b)
  f = jax.jit(lambda h, w: fs.sample(h, w, jax.random.key(1), temperature=0.9,
                                     backend="mosaic"))
  g = jax.jit(lambda h, w: jax.random.categorical(
      jax.random.key(1), jnp.dot(h, w.T, preferred_element_type=jnp.float32) / 0.9))
  for _ in range(3):
    jax.block_until_ready(f(h, w))
  for _ in range(3):
    jax.block_until_ready(g(h, w))


def trace_mode(b):
  """Device timeline of back-to-back calls (jax.profiler): kernel durations
  and the gaps between them, to see what a call costs besides the kernel."""
  import flashsample_jax as fs
  h, w = _inputs(b)
  fns = {
      "mosaic": jax.jit(lambda h, w: fs.sample(
          h, w, jax.random.key(1), temperature=0.9, backend="mosaic")),
      "xla_baseline": jax.jit(lambda h, w: jax.random.categorical(
          jax.random.key(1),
          jnp.dot(h, w.T, preferred_element_type=jnp.float32) / 0.9)),
  }
  for name, f in fns.items():
    for _ in range(2):
      jax.block_until_ready(f(h, w))
    events, _ = _timing.trace_events(f, h, w, calls=6)
    print(f"== {name} B={b}: {len(events)} device events")
    prev_end = None
    for start, dur, ename, lname in events[-14:]:
      gap = "" if prev_end is None else f"gap {(start - prev_end) / 1e3:7.1f} us"
      print(f"  {ename[:48]:48s} {dur / 1e3:8.1f} us  {gap}  [{lname[:20]}]")
      prev_end = start + dur


if __name__ == "__main__":
  mode = sys.argv[1]
  if mode == "time":
    time_mode(tuple(int(x) for x in sys.argv[2:]) or (64, 128))
  elif mode == "ab":
    ab_mode()
  elif mode == "chunk":
    chunk_mode()
  elif mode == "l2":
    l2_mode()
  elif mode == "smalln":
    ab_mode(batches=tuple(int(x) for x in sys.argv[2:]) or (24, 32, 48),
            table=SMALLN)
  elif mode == "depth":
    ab_mode(batches=(16, 64, 128), table=DEPTH)
  elif mode == "trace":
    trace_mode(int(sys.argv[2]))
  elif mode == "calls":
    calls_mode(int(sys.argv[2]))
  else:
    ncu_mode(int(sys.argv[2]))
