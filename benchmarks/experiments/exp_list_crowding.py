"""How crowded the mosaic controls kernel's candidate lists would be for the
inputs of ``exp_mosaic_invariant`` (S head, h = normal(key(B)), B rows):
for each row, the most of its top-``K`` logits that fall into one CTA, one
warpgroup and one column slot, under the per-B split with ``nb`` blocks
(``132 // nb`` CTAs per block) and the fixed split (132).

Assumed mapping (read from ``pallas_kernels/sm90_common.py`` and
``sm90_controls.py``, not traced from the kernel): tiles of 128 ids; CTA
``c`` of a block takes tiles ``c + i * ctas``; its two compute warpgroups
alternate its tiles; a warpgroup's column slot is the id's column modulo
16. A CTA's list holds ``_wg_candidates(nb)`` values, a slot
``_SLOT_DEPTH`` (docs/performance.md, "RL outputs and batch invariance"); a
slot that holds exactly its depth drops nothing (the kernel's bound is what
fell off, "The controls kernel"). Runs on a CPU (the logits of 512 rows of the S head: ~40 s).

  python3 -m benchmarks.experiments.exp_list_crowding [--batch 512] [--top 50]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.shapes import HEADS, random_head

TILE = 128
SLOTS = 16


def _most_per_group(groups: np.ndarray) -> np.ndarray:
  """Per row of ``groups`` (int ``[B, K]``), the largest count of one value."""
  s = np.sort(groups, axis=1)
  new = np.concatenate([np.ones((len(s), 1), bool), s[:, 1:] != s[:, :-1]], axis=1)
  run_id = np.cumsum(new, axis=1)
  return np.array([np.bincount(r).max() for r in run_id])


def crowding(ids: np.ndarray, ctas: int) -> dict:
  """For top ids ``[B, K]`` on ``ctas`` CTAs per block: how many rows have
  each most-per-CTA count, and the most per warpgroup and per slot."""
  tile = ids // TILE
  cta = tile % ctas
  wg = cta * 2 + (tile // ctas) % 2
  slot = wg * SLOTS + (ids % TILE) % SLOTS
  per_cta = _most_per_group(cta)
  return dict(ctas=ctas, rows_by_most_per_cta=np.bincount(per_cta).tolist(),
              most_per_wg=int(_most_per_group(wg).max()),
              most_per_slot=int(_most_per_group(slot).max()))


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=512)
  ap.add_argument("--top", type=int, default=50)
  ap.add_argument("--ctas", nargs="+", type=int, default=[33, 132])
  args = ap.parse_args(argv)
  d, _ = HEADS["S"]
  w = random_head("S")
  h = jax.random.normal(jax.random.key(args.batch), (args.batch, d), jnp.bfloat16)
  logits = jax.jit(lambda h, w: jnp.dot(h, w.T, preferred_element_type=jnp.float32))(h, w)
  ids = np.asarray(jax.lax.top_k(logits, args.top)[1])
  for ctas in args.ctas:
    print(json.dumps(dict(batch=args.batch, top=args.top, **crowding(ids, ctas))), flush=True)


if __name__ == "__main__":
  main()
