"""A/B of mosaic TuningConfigs in one process (PERF_LOG): median us per call
of ``mosaic_sm90.candidates`` with a fixed config, tokens vs the heuristic's.

    PYTHONPATH=. python3 benchmarks/ab_mosaic_configs.py [--batches 128 256]
        [--shapes S L] [--inner 30] [--cases NAME ...]

Each batch size runs the heuristic first, then the named cases that fit it
(``CASES``); ``agree`` is the fraction of tokens equal to the heuristic's
(1.0000 expected: every config is exact).
"""
import argparse
import os
import sys

sys.path.insert(0, os.getcwd())
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _timing  # noqa: E402
from benchmarks.bench_sampler import SHAPES  # noqa: E402
from flashsample_jax import _validate  # noqa: E402
from pallas_kernels import mosaic_sm90 as m  # noqa: E402

C = m.TuningConfig
# name -> (batch sizes it is meant for, config)
CASES = {
    # vocabulary on M, ping-pong over tiles of 64 rows at N = 256: each
    # warpgroup's accumulator [64, 256] is 128 registers; 3 slots of Dt = 64.
    "pp64": ((256, 192), C(tile_v=64, tile_d=64, max_concurrent_steps=3,
                           epi_cols=16, compute_wgs=2, pingpong=True)),
    "pp64_f0": ((256, 192), C(tile_v=64, tile_d=64, max_concurrent_steps=3,
                              epi_cols=16, compute_wgs=2, pingpong=True,
                              mma_in_flight=0)),
    "bm_e8_f0": ((128,), C(tile_v=128, tile_d=64, max_concurrent_steps=4,
                           epi_cols=8, compute_wgs=2, pingpong=True,
                           batch_major=True, mma_in_flight=0)),
    # the same with a buffer per warpgroup in column passes, so that both
    # warpgroups' epilogues may run at once (the SMEM saved goes to slots).
    "pp64_p4": ((256, 192), C(tile_v=64, tile_d=64, max_concurrent_steps=4,
                              epi_cols=16, compute_wgs=2, pingpong=True,
                              epi_passes=4, mma_in_flight=0)),
    "pp64_p4_f1": ((256, 192), C(tile_v=64, tile_d=64, max_concurrent_steps=4,
                                 epi_cols=16, compute_wgs=2, pingpong=True,
                                 epi_passes=4)),
    "pp64_p2": ((256, 192), C(tile_v=64, tile_d=64, max_concurrent_steps=3,
                              epi_cols=16, compute_wgs=2, pingpong=True,
                              epi_passes=2, mma_in_flight=0)),
    "pp64_p8": ((256, 192), C(tile_v=64, tile_d=64, max_concurrent_steps=4,
                              epi_cols=16, compute_wgs=2, pingpong=True,
                              epi_passes=8, mma_in_flight=0)),
    "pp64_p4_d128": ((256, 192), C(tile_v=64, tile_d=128,
                                   max_concurrent_steps=2, epi_cols=16,
                                   compute_wgs=2, pingpong=True, epi_passes=4,
                                   mma_in_flight=0)),
    # batch-major at N = 128 with the other settings of v7's notes.
    "bm_f0": ((128,), C(tile_v=128, tile_d=64, max_concurrent_steps=4,
                        epi_cols=16, compute_wgs=2, pingpong=True,
                        batch_major=True, mma_in_flight=0)),
    "bm_e8": ((128,), C(tile_v=128, tile_d=64, max_concurrent_steps=4,
                        epi_cols=8, compute_wgs=2, pingpong=True,
                        batch_major=True)),
    # vocabulary on M ping-pong (v4) at N = 128.
    "pp128": ((128,), C(tile_v=128, tile_d=64, max_concurrent_steps=4,
                        epi_cols=16, compute_wgs=2, pingpong=True)),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", nargs="+", type=int, default=[128, 256])
  ap.add_argument("--shapes", nargs="+", default=["S", "L"])
  ap.add_argument("--cases", nargs="+", default=list(CASES))
  ap.add_argument("--inner", type=int, default=30)
  ap.add_argument("--reps", type=int, default=15)
  args = ap.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  rows = []
  for name in args.shapes:
    d, v = SHAPES[name]
    w = (jax.random.normal(jax.random.key(d), (v, d), jnp.float32)
         * (3.0 / np.sqrt(d))).astype(jnp.bfloat16)
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      cfgs = [("heuristic", None)] + [
          (c, CASES[c][1]) for c in args.cases if b in CASES[c][0]]
      ref_tok = None
      for label, cfg in cfgs:
        f = jax.jit(lambda h, w, cfg=cfg: m.candidates(
            _validate.prepare(h, w, jax.random.key(1), temperature=0.9),
            config=cfg))
        try:
          tok = np.asarray(f(h, w)[1])
          us, _ = _timing.median_us(f, h, w, reps=args.reps, inner=args.inner)
        except Exception as e:  # noqa: BLE001 - report and keep going
          print(name, b, label, "FAILED", type(e).__name__, str(e)[:300],
                flush=True)
          continue
        if ref_tok is None:
          ref_tok = tok
        agree = float((tok == ref_tok).mean())
        shown = cfg or m.pick_config(m.batch_side(b), d, v)
        line = f"{name} B={b} {label:10s} {us:8.1f} us agree={agree:.4f} {shown}"
        print(line, flush=True)
        rows.append(line)
  print("\n".join(rows))


if __name__ == "__main__":
  main()
