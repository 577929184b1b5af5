"""Plain sampling of an 8-bit head at B = 17..128: the register path's
vocabulary-on-M tiles against the staged batch-major kernel, the dense route
and XLA's way (#40).

  python3 -m benchmarks.experiments.exp_fp8_mid_b [--heads S L]
      [--batches 24 32 48 64 96 128] [--rounds 3]

Plain FP8 sampling takes the dense route past B = 16 (docs/performance.md,
"Quantized heads"), 0.96-1.01x XLA's time at B = 32-256 on the H200
(``sampler_nvidia_h200_fp8_mid_b.md``), where the mosaic heuristic's kernel
at B = 32 (vocabulary on M: the register path, 128 x 128 tiles) measured
1.17x faster than XLA on S. Variants per point:

* ``heuristic``: ``MosaicBackend()`` (vocabulary on M up to N = 48, the
  staged batch-major kernel at 64-128, blocks from 193 rows).
* ``vm128``: vocabulary on M, 128 x 128 tiles, the most slots that fit
  (the register A operand at any N).
* ``vm64``: vocabulary on M, 64 x 128 tiles (half the accumulator).
* ``w128x256``, ``w64x256``, ``w64x512``: vocabulary on M with wider
  steps (Vt x Dt), the most slots that fit (``--variants``): the wide
  steps of B <= 16 (docs/performance.md, "Wide 8-bit steps") past 16 rows,
  where fewer of their slots fit beside H. ``w128x256p4``: the same in
  epilogue passes of 16 columns (a quarter of the accumulator's SMEM copy),
  which with ``--smem-kib 224`` (above ``sm90_config.SMEM_BUDGET``, for
  this experiment only) fits 3 slots at N = 64.
* ``dense``, ``xla``: the dense route; XLA's dot + categorical.

Tokens of each mosaic variant on exact inputs against the reference first;
then alternating rounds of wall time (median of blocks of 20 calls).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name, timed_rounds
from flashsample_jax.backends.mosaic import MosaicBackend
from flashsample_jax.backends.xla import DenseBackend
from pallas_kernels import sm90_config
from pallas_kernels.sm90_config import Schedule, TuningConfig


def vocab_m(n: int, tile_v: int, tile_d: int = 128, epi_passes: int = 1
            ) -> TuningConfig | None:
  """Vocabulary on M for batch side ``n`` (8-bit weight, bf16 H), tiles of
  ``tile_v x tile_d``, the most slots that fit; None where fewer than 2 do."""
  n = -(-n // 16) * 16
  base = TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=tile_v, tile_d=tile_d,
                      epi_cols=16, mma_in_flight=0, max_concurrent_steps=2,
                      epi_passes=min(epi_passes, n // 16))
  steps = sm90_config.most_steps(base, n, 2, 1)
  return dataclasses.replace(base, max_concurrent_steps=steps) if steps >= 2 else None


TILES = {"vm128": (128, 128), "vm64": (64, 128), "w128x256": (128, 256),
         "w64x256": (64, 256), "w64x512": (64, 512), "w128x256p4": (128, 256, 4)}


_BUDGET = sm90_config.SMEM_BUDGET


def backends(b: int, variants=("vm128", "vm64"), d: int = 4096, v: int = 20011) -> dict:
  # The heuristic's config under the package's own SMEM budget, whatever
  # --smem-kib sets for the variants.
  asked, sm90_config.SMEM_BUDGET = sm90_config.SMEM_BUDGET, _BUDGET
  try:
    own = sm90_config.pick_config(sm90_config.batch_side(b), d, v, 2, 1)
  finally:
    sm90_config.SMEM_BUDGET = asked
  out = {"heuristic": MosaicBackend(config=own if asked != _BUDGET else None)}
  for name in variants:
    cfg = vocab_m(b, *TILES[name])
    if cfg is not None:
      out[name] = MosaicBackend(config=cfg)
  return out


def exact(b: int, backend, d: int = 4096, v: int = 20011) -> bool | str:
  from tests import inputs  # pylint: disable=import-outside-toplevel
  h, w, s = inputs.quantized_inputs(b, d, v, seed=b)
  key = jax.random.key(b)
  try:
    got = fs.sample(h, w, key, temperature=0.7, weight_scale=s, backend=backend)
    want = fs.reference.sample(h, w, key, temperature=0.7, weight_scale=s)
    return bool(jnp.all(got == want))
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e)[:300]}"


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S", "L"], choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[24, 32, 48, 64, 96, 128])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--variants", nargs="+", default=["vm128", "vm64"], choices=sorted(TILES))
  ap.add_argument("--smem-kib", type=int, default=None,
                  help="SMEM budget of the variants' slots (the heuristic keeps its own)")
  args = ap.parse_args()
  if args.smem_kib:
    sm90_config.SMEM_BUDGET = args.smem_kib * 1024
  key = jax.random.key(0)
  ok = {}
  for b in args.batches:
    ok[b] = {name: exact(b, be) for name, be in backends(b, args.variants).items()}
    print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, B=b, exact=ok[b],
                          configs={n: str(be.config)
                                   for n, be in backends(b, args.variants).items()})),
          flush=True)
  for head in args.heads:
    d, v = shapes.HEADS[head]
    w, scale = fs.quantize_weight(shapes.random_head(head, 1.3))
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      fns = {}
      for name, be in backends(b, args.variants, d, v).items():
        if ok[b][name] is True:
          fns[name] = jax.jit(lambda h, w, be=be: fs.sample(h, w, key, weight_scale=scale,
                                                              backend=be))
      fns["dense"] = jax.jit(lambda h, w: fs.sample(h, w, key, weight_scale=scale,
                                                    backend=DenseBackend()))
      fns["xla"] = jax.jit(lambda h, w: jax.random.categorical(
          key, jnp.dot(h, w.astype(jnp.bfloat16).T,
                       preferred_element_type=jnp.float32) * scale))
      timed_rounds(fns, h, w, rounds=args.rounds, head=head, B=b)
    del w, scale


if __name__ == "__main__":
  main()
