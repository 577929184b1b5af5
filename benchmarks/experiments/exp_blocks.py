"""Variants of the blocked batch-major launch (issue #20), at B >= 193.

Measures settings of the heuristic's blocked config in interleaved rounds
(at the power cap a variant's time depends on what ran before it:
docs/performance.md, "Measuring at the power cap") and checks that every variant returns the same tokens as the
heuristic's launch:

  python3 -m benchmarks.experiments.exp_blocks S:256,512 L:256 --rounds 3 \
      --variants blocks,f1,p4_f1,dense

``--variants`` names the variants (see :func:`variant_config`; ``dense``
and ``auto`` are the dense route and ``backend="auto"``); ``xla`` (XLA's
dot + categorical) always runs; ``same_tokens`` compares each variant's
tokens with the first variant's. ``--once NAME`` runs one variant once per
point instead (for Nsight Compute).

What it decided: docs/performance.md, "Routes on the GPU", "Batch blocks" and
"Deep D: epilogue passes and a wgmma in flight". Weight tiles multicast across
clusters of 2 and 4 CTAs were measured with it too; that code is in commit
8a3333b, and was removed because it did not pay.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks._timing import timed_rounds
from benchmarks.shapes import points
from flashsample_jax.backends.mosaic import MosaicBackend
from pallas_kernels.sm90_config import SMEM_BUDGET, pick_blocked_config

_DEFAULT = ("blocks", "f1", "p4_f1")


def variant_config(name, b, d, v):
  """The config a variant name describes: the heuristic's blocked config
  with the epilogue in one pass and no wgmma in flight (the settings of the
  sixteenth session) for ``blocks``, else with ``_``-joined settings
  ``p<epi_passes>``, ``f<mma_in_flight>``, ``e<epi_cols>``, ``u<epi_unroll>``,
  ``d<tile_d>``, ``s<slots>``
  (default: the most slots, up to 8, that fit the SMEM budget),
  ``b<batch_blocks>`` (the batch in that many equal blocks of a multiple of
  64 rows, e.g. ``b2`` at B = 128: two blocks of 64), e.g. ``p4_f1``.
  None where the settings do not apply."""
  cfg = dataclasses.replace(pick_blocked_config(b, d, v), epi_passes=1,
                            mma_in_flight=0)
  keys = {"p": "epi_passes", "f": "mma_in_flight", "e": "epi_cols", "u": "epi_unroll",
          "d": "tile_d", "s": "max_concurrent_steps", "b": "batch_blocks"}
  kw = {} if name == "blocks" else {
      keys[part[0]]: int(part[1:]) for part in name.split("_")}
  try:
    cfg = dataclasses.replace(cfg, **kw)
    if "max_concurrent_steps" not in kw:
      for steps in range(8, 1, -1):
        wide = dataclasses.replace(cfg, max_concurrent_steps=steps)
        if wide.smem_bytes(128, 2) <= SMEM_BUDGET:
          cfg = wide
          break
    cfg.check_problem(n=128, dim=d, rows=v)
  except ValueError:
    return None
  return cfg


def _variants(b, d, v, t, names):
  out = {"xla": jax.jit(lambda h, w, k: jax.random.categorical(
      k, jnp.dot(h, w.T, preferred_element_type=jnp.float32) / t))}
  for name in names:
    if name in ("dense", "auto"):
      out[name] = jax.jit(lambda h, w, k, name=name: fs.sample(
          h, w, k, temperature=t, backend=name))
      continue
    cfg = variant_config(name, b, d, v)
    if cfg is None:
      continue
    be = MosaicBackend(config=cfg)
    out[name] = jax.jit(lambda h, w, k, be=be: fs.sample(h, w, k, temperature=t,
                                                         backend=be))
  return out


def main(specs, rounds, once=None, names=_DEFAULT):
  key = jax.random.key(7)
  for head, d, v, b, w, h in points(specs):
    variants = _variants(b, d, v, jnp.float32(0.7), names)
    if once is not None:
      if once in variants:
        jax.block_until_ready(variants[once](h, w, key))
        print(f"ran {once} head={head} B={b}", flush=True)
      continue
    tokens = {n: np.asarray(f(h, w, key)) for n, f in variants.items()}
    first = next(n for n in variants if n != "xla")
    same = {n: bool((tok == tokens[first]).all())
            for n, tok in tokens.items() if n != "xla"}
    print(json.dumps(dict(head=head, b=b, same_tokens=same)), flush=True)
    timed_rounds(variants, h, w, key, rounds=rounds, head=head, b=b)


if __name__ == "__main__":
  args = sys.argv[1:]
  rounds, once, names = 3, None, _DEFAULT
  if "--rounds" in args:
    i = args.index("--rounds")
    rounds = int(args[i + 1])
    del args[i:i + 2]
  if "--once" in args:
    i = args.index("--once")
    once = args[i + 1]
    del args[i:i + 2]
  if "--variants" in args:
    i = args.index("--variants")
    names = tuple(args[i + 1].split(","))
    del args[i:i + 2]
  main(args, rounds, once, names)
