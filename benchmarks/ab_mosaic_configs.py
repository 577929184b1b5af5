"""A/B of mosaic TuningConfigs in one process (PERF_LOG v3): median us per
call of mosaic_sm90.candidates with a fixed config, tokens vs the heuristic."""
import sys, os
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from benchmarks import _timing
from flashsample_jax import _validate
from pallas_kernels import mosaic_sm90 as m

C = m.TuningConfig
CASES = {
    256: [None,
          C(tile_v=64, tile_d=128, max_concurrent_steps=2, epi_cols=16, epi_unroll=2),  # v2
          C(tile_v=128, tile_d=64, max_concurrent_steps=3, epi_cols=16, epi_unroll=1, compute_wgs=2, epi_passes=4),
          C(tile_v=128, tile_d=64, max_concurrent_steps=3, epi_cols=16, epi_unroll=1, compute_wgs=2, epi_passes=8),
          C(tile_v=128, tile_d=64, max_concurrent_steps=2, epi_cols=16, epi_unroll=2, compute_wgs=2, epi_passes=2)],
    128: [None,
          C(tile_v=128, tile_d=128, max_concurrent_steps=2, epi_cols=16, epi_unroll=1),  # v2
          C(tile_v=256, tile_d=64, max_concurrent_steps=2, epi_cols=16, epi_unroll=1, compute_wgs=2, epi_passes=2),
          C(tile_v=128, tile_d=128, max_concurrent_steps=2, epi_cols=16, epi_unroll=2, compute_wgs=2, epi_passes=2)],
}
rows = []
for name, (d, v) in (("S", (4096, 151936)), ("L", (8192, 128256))):
  kw = jax.random.key(d)
  w = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / np.sqrt(d))).astype(jnp.bfloat16)
  for b, cfgs in CASES.items():
    h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
    ref_tok = None
    for cfg in cfgs:
      f = jax.jit(lambda h, w, cfg=cfg: m.candidates(
          _validate.prepare(h, w, jax.random.key(1), temperature=0.9), config=cfg))
      try:
        tok = np.asarray(f(h, w)[1])
        us, _ = _timing.median_us(f, h, w, reps=15)
      except Exception as e:  # noqa: BLE001
        print(name, b, cfg, "FAILED", type(e).__name__, str(e)[:200], flush=True)
        continue
      if ref_tok is None:
        ref_tok = tok
      agree = float((tok == ref_tok).mean())
      line = f"{name} B={b} {us:8.1f} us agree={agree:.4f} {cfg or 'heuristic ' + str(m.pick_config(b, d, v))}"
      print(line, flush=True)
      rows.append(line)
print("\n".join(rows))
