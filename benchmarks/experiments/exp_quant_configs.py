"""Configs of the 8-bit register path (vocabulary on M, FP8 e4m3 per-row
scales) at small B, beside bf16 heads with the same tiles
(docs/performance.md, "Quantized heads").

  python -m benchmarks.experiments.exp_quant_configs [--heads S] [--batches 1 16]
      [--variants fp8 fp8_v128_d128 fp8_v64_d256 ...]

Each variant is a weight dtype and a ``TuningConfig`` (None: the
heuristic's), timed on the mosaic backend
in alternating rounds beside the weight-read floor of its dtype and XLA's
way for FP8 (the dot of the converted weight times the scale, then
``jax.random.categorical``). Every FP8 variant's tokens are checked against
the reference on exact inputs first, and against the heuristic's on the
timed inputs. One JSON line per point.

The question the variants ask: what keeps the register path above its
floor? Each step converts its tile and waits for its wgmma; wider steps
spread that over more bytes (``fp8_v128_d128``: the tiles before
``sm90_config.WIDE_8BIT_STEP``). bf16 with ``Dt = 64`` reads rows as
narrow as FP8's ``Dt = 128`` (128 bytes), to tell the row width apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name, median_us, read_bandwidth
from flashsample_jax.backends.mosaic import MosaicBackend
from pallas_kernels import sm90_config
from pallas_kernels.sm90_config import Schedule, TuningConfig

T = 0.7


def _vm(tile_v, tile_d, steps, passes=1):
  return TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=tile_v, tile_d=tile_d,
                      max_concurrent_steps=steps, epi_cols=16, mma_in_flight=0,
                      epi_passes=passes)


def _vm_fit(tile_v, tile_d, passes=1):
  """The register path's tiles with the most slots that fit beside B rows
  (a function of B): the vocabulary-on-M launch past B = 16, where the
  heuristic stages the tile (B >= 49) or narrows it."""
  def config(b):
    cfg = _vm(tile_v, tile_d, 2, passes)
    return dataclasses.replace(cfg, max_concurrent_steps=sm90_config.most_steps(
        cfg, sm90_config.batch_side(b), 2, 1))
  return config


# name -> (weight dtype, config: None for the heuristic's).
VARIANTS = {
    "fp8": ("fp8", None),
    "fp8_v128_d128": ("fp8", _vm(128, 128, 8)),
    "fp8_v64_d256": ("fp8", _vm(64, 256, 8)),
    "fp8_v128_d256": ("fp8", _vm(128, 256, 4)),
    "fp8_v64_d512": ("fp8", _vm(64, 512, 4)),
    "fp8_v128_d256_s3": ("fp8", _vm(128, 256, 3)),
    "fp8_v192_d128": ("fp8", _vm(192, 128, 6)),
    "fp8_vm128_d128_fit": ("fp8", _vm_fit(128, 128)),
    "fp8_vm64_d128_fit": ("fp8", _vm_fit(64, 128)),
    "fp8_vm64_d256_fit": ("fp8", _vm_fit(64, 256)),
    "fp8_vm64_d128_p4_fit": ("fp8", _vm_fit(64, 128, 4)),
    "bf16": ("bf16", None),
    "bf16_d64": ("bf16", dataclasses.replace(_vm(128, 64, 8), mma_in_flight=1)),
    "bf16_d256": ("bf16", dataclasses.replace(_vm(128, 256, 2), mma_in_flight=1)),
}


def sampler(config, **kw):
  """``fs.sample`` on the mosaic backend with ``config`` (see VARIANTS;
  resolved for the batch first where it is a function of it)."""
  backend = MosaicBackend(config=config) if isinstance(config, TuningConfig) else "mosaic"
  return lambda h, w, s, k: fs.sample(h, w, k, temperature=kw.get("temperature", T),
                                      weight_scale=s, backend=backend)


def traced(f, *args):
  """``f`` jitted and run once (compiled)."""
  g = jax.jit(f)
  jax.block_until_ready(g(*args))
  return g


def exact_equal(config, b: int) -> bool:
  """Tokens of an FP8 variant equal the reference's on exact inputs."""
  from tests import inputs  # pylint: disable=import-outside-toplevel
  h, w, s = inputs.quantized_inputs(b, 4096, 32000, seed=b)
  t = inputs.pow2_temperatures(b, greedy_every=5, seed=b)
  key = jax.random.key(b)
  want = np.asarray(fs.reference.sample(h, w, key, temperature=t, weight_scale=s))
  config = config(b) if callable(config) else config
  g = traced(lambda h, w, s, k, t: sampler(config, temperature=t)(h, w, s, k),
             h, w, s, key, t)
  return bool((np.asarray(g(h, w, s, key, t)) == want).all())


def point(weights, d, b, floors, names, rounds):
  h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
  key = jax.random.key(0)
  fns, args = {}, {}
  for name in names:
    kind, config = VARIANTS[name]
    config = config(b) if callable(config) else config
    args[name] = (h, *weights[kind], key)
    fns[name] = traced(sampler(config), *args[name])
  w8, scale = weights["fp8"]
  fns["xla_way"] = jax.jit(lambda h, w, s, k: jax.random.categorical(
      k, (jnp.dot(h, w.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32)
          * s) / T, axis=-1))
  args["xla_way"] = (h, w8, scale, key)
  rec = dict(B=b, floor_fp8_us=round(floors["fp8"], 1), floor_bf16_us=round(floors["bf16"], 1))
  base = {k: np.asarray(fns[k](*args[k])) for k in fns if k in ("fp8", "bf16")}
  for name in names:
    kind = VARIANTS[name][0]
    if kind in base:
      rec[name + "_same_tokens"] = bool((np.asarray(fns[name](*args[name])) == base[kind]).all())
  for _ in range(rounds):
    for name, f in fns.items():
      try:
        us = median_us(f, *args[name], reps=7, inner=20)[0]
      except Exception as e:  # pylint: disable=broad-except
        rec[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        continue
      rec.setdefault(name + "_us", []).append(round(us, 1))
  for name in fns:
    if name + "_us" in rec:
      kind = VARIANTS.get(name, ("fp8",))[0]
      rec[name + "_vs_floor"] = round(min(rec[name + "_us"]) / floors[kind], 3)
  return rec


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S"])
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  ap.add_argument("--rounds", type=int, default=2)
  a = ap.parse_args(argv)
  bw = read_bandwidth()
  print(json.dumps(dict(device=device_name(), jax=jax.__version__,
                        read_GBps=round(bw / 1e9, 1))), flush=True)
  names = list(dict.fromkeys(["fp8", "bf16"] + a.variants))
  exact = {}
  for name in names:
    kind, config = VARIANTS[name]
    if kind == "fp8":
      try:
        exact[name] = [exact_equal(config, b) for b in a.batches]
      except Exception as e:  # pylint: disable=broad-except
        exact[name] = f"{type(e).__name__}: {str(e)[:300]}"
  print(json.dumps(dict(exact_inputs_equal=exact)), flush=True)
  names = [n for n in names if VARIANTS[n][0] != "fp8" or exact.get(n) is not None
           and not isinstance(exact[n], str)]
  for head in a.heads:
    d, v = shapes.HEADS[head]
    wb = shapes.random_weight(d, v)
    weights = {"bf16": (wb, None), "fp8": fs.quantize_weight(wb)}
    floors = {"fp8": v * d / bw * 1e6, "bf16": 2 * v * d / bw * 1e6}
    for b in a.batches:
      print(json.dumps(dict(head=head, **point(weights, d, b, floors, names, a.rounds))),
            flush=True)
    del wb, weights


if __name__ == "__main__":
  main()
