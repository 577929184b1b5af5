"""Large batches (issue #20) and truncation without the pass's noise.

Part ``blocks``: plain sampling at B >= 128 on the Hopper kernel with the
heuristic's launches (vocabulary-major N = 256 when the PERF_LOG runs were
made; batch blocks since) against batch-major launches in blocks
(``TuningConfig.batch_blocks``: one pass over W from HBM for all rows, work
items of N x 128), next to XLA's dot + categorical, the cuBLAS dot alone and
the dense route, in one process. Tokens of every kernel variant are checked
against the dense route's.

Part ``trunc``: top-k 50 + top-p 0.9 with the truncation rules as Python
constants (the pass draws no noise: ``Controls.for_pass``) and as traced
arguments (the pass draws it, as before), next to plain sampling, on the
mosaic and triton backends.

  python3 -m benchmarks.experiments.exp_large_b blocks S,L 128,256,512,1024
  python3 -m benchmarks.experiments.exp_large_b trunc S 1,16,64,128,256

Prints one JSON line per point.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks._timing import median_us
from benchmarks.shapes import HEADS, random_head
from flashsample_jax.backends.mosaic import MosaicBackend
from pallas_kernels.sm90_config import Schedule, TuningConfig


def _blocked(n: int, blocks: int, tile_d: int, steps: int, mif=None) -> TuningConfig:
  wide = n > 64
  if mif is None:
    mif = 0 if wide else 1
  return TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128, tile_d=tile_d,
                      max_concurrent_steps=steps, epi_cols=8 if wide else 16,
                      mma_in_flight=mif, batch_blocks=blocks)


def blocks(heads, batches):
  for head in heads:
    w = random_head(head, 1.3)
    d, v = HEADS[head]
    for b in batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      t = jnp.float32(0.7)
      key = jax.random.key(7)
      dense = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=t, backend="dense"))
      want = np.asarray(dense(h, w, key))
      variants = {
          "xla": jax.jit(lambda h, w, k: jax.random.categorical(
              k, jnp.dot(h, w.T, preferred_element_type=jnp.float32) / t)),
          "dot": jax.jit(lambda h, w, k: jnp.dot(h, w.T, preferred_element_type=jnp.float32)),
          "dense": dense,
          "mosaic_heuristic": jax.jit(lambda h, w, k: fs.sample(
              h, w, k, temperature=t, backend="mosaic")),
      }
      for n in (128, 64):
        nb = -(-b // n)
        if nb < 2 or nb > 16:
          continue
        # Measured on an H100 (PERF_LOG): one wgmma in flight and blocks
        # of 64 rows lost at every point; kept out of later runs.
        opts = ((64, 4, None), (128, 2, None)) if n == 128 else ()
        for tile_d, steps, mif in opts:
          cfg = _blocked(n, nb, tile_d, steps, mif)
          try:
            cfg.check_problem(n=n, dim=d, rows=v)
          except ValueError as e:
            print(json.dumps(dict(head=head, b=b, skip=f"n{n} dt{tile_d} s{steps}: {e}")))
            continue
          be = MosaicBackend(config=cfg)
          variants[f"blk_n{n}x{nb}_dt{tile_d}_s{steps}_m{cfg.mma_in_flight}"] = jax.jit(
              lambda h, w, k, be=be: fs.sample(h, w, k, temperature=t, backend=be))
      for name, f in variants.items():
        rec = dict(part="blocks", head=head, b=b, variant=name)
        try:
          us, _ = median_us(f, h, w, key, reps=11, inner=20)
          rec["us"] = round(us, 1)
          if name not in ("xla", "dot"):
            rec["same_tokens"] = float(np.mean(np.asarray(f(h, w, key)) == want))
        except Exception as e:  # pylint: disable=broad-except
          rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(rec), flush=True)


def trunc(heads, batches, backends=("mosaic", "triton")):
  for head in heads:
    w = random_head(head, 1.3)
    d, _ = HEADS[head]
    for b in batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      h = h * 3  # logits of std ~4: the candidates decide every row
      key = jax.random.key(7)
      t = jnp.float32(0.7)
      for be in backends:
        try:
          fs.backends.get(be)
        except Exception:  # pylint: disable=broad-except
          continue
        const = jax.jit(lambda h, w, k, be=be: fs.sample(
            h, w, k, temperature=t, backend=be, top_k=50, top_p=0.9))
        traced = jax.jit(lambda h, w, k, tk, tp, be=be: fs.sample(
            h, w, k, temperature=t, backend=be, top_k=tk, top_p=tp))
        plain = jax.jit(lambda h, w, k, be=be: fs.sample(h, w, k, temperature=t, backend=be))
        ref = np.asarray(jax.jit(lambda h, w, k: fs.reference.sample(
            h, w, k, temperature=t, top_k=50, top_p=0.9))(h, w, key))
        for name, f, args in (("plain", plain, (h, w, key)),
                              ("topk_topp_const", const, (h, w, key)),
                              ("topk_topp_traced", traced,
                               (h, w, key, jnp.int32(50), jnp.float32(0.9)))):
          rec = dict(part="trunc", head=head, b=b, backend=be, variant=name)
          try:
            us, _ = median_us(f, *args, reps=11, inner=20)
            rec["us"] = round(us, 1)
            if name != "plain":
              rec["same_tokens"] = float(np.mean(np.asarray(f(*args)) == ref))
          except Exception as e:  # pylint: disable=broad-except
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  part, heads, batches = sys.argv[1], sys.argv[2].split(","), [int(x) for x in sys.argv[3].split(",")]
  extra = sys.argv[4].split(",") if len(sys.argv) > 4 else None
  if part == "blocks":
    blocks(heads, batches)
  else:
    trunc(heads, batches, *( [extra] if extra else []))
