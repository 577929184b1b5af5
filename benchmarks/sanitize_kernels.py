"""A small host program that launches every kernel schedule once, for
compute-sanitizer (memcheck, racecheck, synccheck).

Each launch runs on a small problem and its tokens are checked against the
xla backend, so a sanitizer run also says the kernels still computed the
right thing under instrumentation. Run under the sanitizer, filtered to this
package's kernels (a whole JAX process under racecheck crashed the tool)::

    compute-sanitizer --tool racecheck --kernel-name kns=flashsample \\
        python3 -m benchmarks.sanitize_kernels

tests/test_sanitizers.py runs it under each tool in the GPU suite.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from flashsample_jax import controls, problem, stage2
from flashsample_jax.backends.mosaic import MosaicBackend
from pallas_kernels.sm90_config import Schedule, TuningConfig
from tests import inputs

# One config per schedule and pass structure of the sampling kernel.
PLAIN = {
    "cooperative_1wg": TuningConfig(tile_v=64, tile_d=64, max_concurrent_steps=2,
                                    epi_cols=8),
    "cooperative_2wg": TuningConfig(tile_v=128, tile_d=64, max_concurrent_steps=2,
                                    epi_cols=8, compute_wgs=2, epi_passes=2),
    "pingpong_vocab_m": TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=128,
                                     tile_d=64, max_concurrent_steps=2, epi_cols=16,
                                     mma_in_flight=0),
    "pingpong_vocab_m_passes": TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M,
                                            tile_v=64, tile_d=64, max_concurrent_steps=3,
                                            epi_cols=16, epi_passes=2),
    "pingpong_batch_m": TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128,
                                     tile_d=64, max_concurrent_steps=2, epi_cols=16),
    "pingpong_batch_m_128": TuningConfig(schedule=Schedule.PINGPONG_BATCH_M,
                                         tile_v=128, tile_d=64, max_concurrent_steps=2,
                                         epi_cols=8, mma_in_flight=0),
}


def main() -> int:
  failures = 0
  d, v = 256, 1000
  for name, cfg in PLAIN.items():
    b = 100 if cfg.schedule is Schedule.PINGPONG_BATCH_M and cfg.epi_cols == 8 else 24
    h, w = inputs.exact_inputs(b, d, v, seed=b)
    p = problem.prepare(h, w, jax.random.key(1), temperature=0.5)
    got = jax.jit(lambda p, cfg=cfg: MosaicBackend(config=cfg).candidates(p))(p)
    want = fs.backends.get("xla").candidates(p)
    ok = bool((np.asarray(got[1]) == np.asarray(want[1])).all())
    failures += not ok
    print(f"mosaic {name}: tokens {'ok' if ok else 'DIFFER'}", flush=True)
  # The controls kernel: 64-row launches with every control, 128-row ones.
  for b, kw in ((24, dict(top_k=5, top_p=0.9, softcap=8.0, num_samples=2,
                          return_logprobs=True)),
                (100, dict(logit_bias=True, return_logprobs=True))):
    h, w = inputs.exact_inputs(b, d, v, scale=1, seed=b)
    if kw.get("logit_bias") is True:
      kw = dict(kw, logit_bias=jnp.asarray(np.random.default_rng(0).integers(-2, 3, v),
                                           jnp.float32))
    p = problem.prepare(h, w, jax.random.key(2), temperature=4.0)
    c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, **kw)
    toks = []
    for backend in (MosaicBackend(), fs.backends.get("xla")):
      st = jax.jit(lambda p, c, be=backend: be.controls_state(p, c))(p, c)
      toks.append(np.asarray(stage2.finish(p, c, st)[0]))
    ok = bool((toks[0] == toks[1]).all())
    failures += not ok
    print(f"mosaic controls B={b}: tokens {'ok' if ok else 'DIFFER'}", flush=True)
  try:
    import jax_triton  # noqa: F401
  except ImportError:
    print("triton: jax_triton missing, skipped")
  else:
    for b, kw in ((5, {}), (100, {}), (24, dict(top_k=5, top_p=0.9, softcap=8.0,
                                                 return_logprobs=True))):
      h, w = inputs.exact_inputs(b, d, v, scale=1, seed=b)
      got = fs.sample(h, w, jax.random.key(3), temperature=4.0, backend="triton", **kw)
      want = fs.reference.sample(h, w, jax.random.key(3), temperature=4.0, **kw)
      got, want = (getattr(x, "tokens", x) for x in (got, want))
      ok = bool((np.asarray(got) == np.asarray(want)).all())
      failures += not ok
      print(f"triton B={b} {sorted(kw)}: tokens {'ok' if ok else 'DIFFER'}", flush=True)
  print("kernel runs with different tokens:", failures)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
