"""Guesses about the mosaic kernel's own time at small B (#41).

  python3 -m benchmarks.experiments.exp_small_b_kernel [--heads S L qwen3-1.7b gpt-oss]
      [--batches 1 16] [--rounds 2] [--variants base ctas:132 ctas:126 epi8 n16 pdl per_tile]
      [--weight-dtype bf16|fp8]

At B = 1 and 16 the kernel's own time on the L head was 1.04x that of a
``jnp.sum`` over the same weight (``exp_small_b_timeline``; the other heads'
kernels ran at or below it). Variants (``base``: the heuristic's config):

* ``ctas:N``: a persistent grid of N CTAs. The heuristic runs
  ``sm90_config.balanced_ctas``: the fewest CTAs that keep the number of
  rounds (L: 1002 tiles are 7.6 rounds over 132 SMs, so in the last round
  54 SMs idle while 78 read; 126 CTAs run 8 nearly full rounds);
  ``ctas:132`` is the grid of one CTA per SM it replaced.
* The order in which CTAs walk D (every CTA walks its tile's D steps from
  k = 0, so at any moment the SMs read the same few hundred bytes of many
  rows a power-of-two stride apart): a variant that started tile t's walk
  at ``t % k_steps`` ran at commit 42dc632 (``TuningConfig.rotate_k``,
  removed since: no change, docs/performance.md, "Small batches").
* ``epi8``: epilogue chunks of 8 columns, so that up to 8 rows run with a
  batch side of N = 8 instead of 16: half the noise and argmax work of
  every tile's epilogue, and the last tile's epilogue is the kernel's tail
  after its last weight byte (``exp_cta_spread``).
* ``n16``: the launch of 16 rows' config (batch side 16, epilogue chunks
  of 16 columns), which the heuristic ran up to 8 rows before ``epi8``'s
  batch side of 8 became its own (``sm90_config``'s first table row).
* ``per_tile``: one candidate per tile for XLA's reduction (1187 a row on
  S), as before each compute warpgroup kept a running best over its tiles
  (one candidate per warpgroup, 264 a row; ``sm90_sampler.per_warpgroup``,
  up to 48 rows).
* The launch's last warpgroup reducing every warpgroup's candidate itself
  (an atomic count on a word of the row block, then its reads), so that a
  call is the per-row data's fusion and one kernel: ran at commit 2e62ddd
  (``sm90_finish``, variants ``base`` against ``xla_reduce``), slower than
  XLA's reduction, removed since (docs/performance.md, "Small batches").
* ``pdl``: programmatic dependent launch. Every warpgroup runs
  ``griddepcontrol.wait`` before the frame (so before any read of GMEM),
  which lets the launch start while the kernel before it (the per-row
  data's fusion) still runs: its CTAs' setup overlaps that kernel and the
  launch gap. A prototype: the frame is wrapped while the variant traces.

Variants are timed in alternating rounds (device time per call from a
profiler trace of back-to-back calls, the kernel's own time, and the wall
time of blocks of calls); every variant's tokens are checked against the
reference on exact inputs (any grid gives the same logits there) and
compared with the first variant's on the timed random inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import (device_name, device_period_us, median_us, read_bandwidth,
                                trace_events)
from flashsample_jax import reference
from flashsample_jax.backends.mosaic import MosaicBackend
from pallas_kernels import sm90_common, sm90_sampler


def config(variant: str, b: int, d: int, v: int, w_itemsize: int = 2):
  """The heuristic's config of a ``b``-row launch, changed as ``variant`` says."""
  (_, _, cfg, _), = sm90_sampler.launches(b, d, v, 2, w_itemsize=w_itemsize)
  if variant.startswith("ctas:"):
    return dataclasses.replace(cfg, num_ctas=int(variant[5:]))
  if variant == "epi8":
    return dataclasses.replace(cfg, epi_cols=8)
  if variant == "n16":
    (_, _, cfg, _), = sm90_sampler.launches(max(b, 16), d, v, 2, w_itemsize=w_itemsize)
    return cfg
  assert variant in ("base", "pdl", "per_tile"), variant
  return cfg


@contextlib.contextmanager
def tracing(variant: str):
  """While a ``pdl`` variant traces: every ping-pong frame starts with
  ``griddepcontrol.wait`` in every warpgroup; while ``per_tile`` traces,
  no launch keeps a running best per warpgroup."""
  if variant == "per_tile":
    keep = sm90_sampler.per_warpgroup
    sm90_sampler.per_warpgroup = lambda cfg, n: False
    try:
      yield
    finally:
      sm90_sampler.per_warpgroup = keep
    return
  if variant != "pdl":
    yield
    return
  frame = sm90_common.pingpong_frame

  def waiting_frame(*args, **kwargs):
    plgpu.griddepcontrol_wait()
    return frame(*args, **kwargs)

  sm90_common.pingpong_frame = waiting_frame
  try:
    yield
  finally:
    sm90_common.pingpong_frame = frame


class PerTileBackend(MosaicBackend):
  """The ``per_tile`` variant's backend: a class of its own, so that
  ``fs.sample``'s inner jit does not reuse the base variant's trace (the
  configs are equal)."""


def compiled(variant: str, h, w, key, *, scale=None, interpret: bool = False):
  """Plain sampling on the mosaic backend with ``variant``'s config, compiled
  (``scale``: an 8-bit head's per-row scales)."""
  cfg = config(variant, *h.shape, w.shape[0], w.dtype.itemsize)
  kind = PerTileBackend if variant == "per_tile" else MosaicBackend
  backend = kind(config=cfg, interpret=True if interpret else None)
  f = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=0.7, weight_scale=scale,
                                        backend=backend))
  with tracing(variant):
    jax.block_until_ready(f(h, w, key))
  return f


def kernel_us(f, *args, calls: int = 20) -> float:
  """The sampling kernel's own time per call."""
  device, _ = trace_events(f, *args, calls=calls)
  return sum(d for _, d, n, _ in device if "mosaic" in n) / calls / 1e3


def exact_check(variants, b: int, dim: int = 4096, vocab: int = 32000,
                interpret: bool = False, fp8: bool = False) -> dict:
  """Tokens of each variant on exact inputs equal the reference's."""
  from tests import inputs  # pylint: disable=import-outside-toplevel
  if fp8:
    h, w, scale = inputs.quantized_inputs(b, dim, vocab, seed=b)
  else:
    (h, w), scale = inputs.exact_inputs(b, dim, vocab, seed=b), None
  key = jax.random.key(b)
  ref = reference.sample(h, w, key, temperature=0.7, weight_scale=scale)
  return {v: bool(jnp.all(compiled(v, h, w, key, scale=scale, interpret=interpret)(h, w, key)
                          == ref))
          for v in variants}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S", "L", "qwen3-1.7b", "gpt-oss"],
                  choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--variants", nargs="+", default=["base", "ctas:132"])
  ap.add_argument("--weight-dtype", choices=["bf16", "fp8"], default="bf16",
                  help="fp8: the head quantized per row (fs.quantize_weight, e4m3)")
  args = ap.parse_args()
  variants = args.variants
  fp8 = args.weight_dtype == "fp8"
  print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, weight_dtype=args.weight_dtype,
                        exact_tokens={b: exact_check(variants, b, fp8=fp8)
                                      for b in sorted({1, 16, 64, *args.batches})})),
        flush=True)
  gbs = read_bandwidth(4.0)
  key = jax.random.key(0)
  for head in args.heads:
    d, v = shapes.HEADS[head]
    w, scale = shapes.random_head(head, 1.3), None
    if fp8:
      w, scale = fs.quantize_weight(w)
    floor = v * d * w.dtype.itemsize / gbs * 1e6
    sum_w = jax.jit(lambda w: jnp.sum(w, dtype=jnp.float32))
    sum_device = device_period_us(sum_w, w)
    sum_kernel = max(d for _, d, _, _ in trace_events(sum_w, w, calls=1)[0]) / 1e3
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      fns = {name: compiled(name, h, w, key, scale=scale) for name in variants}
      toks = {name: f(h, w, key) for name, f in fns.items()}
      same = {n: float(jnp.mean(toks[variants[0]] == t)) for n, t in toks.items()}
      for r in range(args.rounds):
        rec = dict(head=head, B=b, round=r, floor_us=round(floor, 1),
                   sum_w_device_us=round(sum_device, 1),
                   sum_w_kernel_us=round(sum_kernel, 1), tokens_equal_first=same)
        for name, f in fns.items():
          rec[f"{name}_wall"] = round(median_us(f, h, w, key, reps=7, inner=20)[0], 1)
          rec[f"{name}_device"] = round(device_period_us(f, h, w, key), 1)
          rec[f"{name}_kernel"] = round(kernel_us(f, h, w, key), 1)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
