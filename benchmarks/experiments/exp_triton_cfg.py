"""Triton plain-sampling configs at one (head, B), next to XLA's dot +
categorical, in one process (the sm90 table's rows were measured on S only;
issue #21 asks for S and L). Tokens of every config are checked against the
table's config (the same key and inputs must give the same tokens).

  python3 -m benchmarks.experiments.exp_triton_cfg L 128

Prints one JSON line per config.
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
from flashsample_jax.backends.triton import TritonBackend
from pallas_kernels.triton_sampler import TritonConfig as C

CANDIDATES = {
    128: [None, C(128, 128, 64, 16, 3, False), C(128, 64, 128, 8, 3, False),
          C(128, 64, 128, 8, 4, False), C(128, 128, 128, 16, 3, False),
          C(64, 64, 128, 4, 4, False), C(128, 64, 64, 8, 4, False)],
    256: [None, C(128, 64, 64, 8, 3, False), C(128, 128, 64, 8, 3, False)],
}


def main(head, b):
  d, v = HEADS[head]
  w = random_head(head, 1.3)
  h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
  key = jax.random.key(3)
  xla = jax.jit(lambda h, w, k: jax.random.categorical(
      k, jnp.dot(h, w.T, preferred_element_type=jnp.float32)))
  print(json.dumps(dict(head=head, b=b, variant="xla",
                        us=round(median_us(xla, h, w, key, reps=11, inner=20)[0], 1))),
        flush=True)
  want = None
  for cfg in CANDIDATES[b]:
    f = jax.jit(lambda h, w, k, cfg=cfg: fs.sample(h, w, k, backend=TritonBackend(config=cfg)))
    rec = dict(head=head, b=b, variant=str(cfg) if cfg else "table")
    try:
      rec["us"] = round(median_us(f, h, w, key, reps=11, inner=20)[0], 1)
      tok = np.asarray(f(h, w, key))
      want = tok if want is None else want
      rec["same_tokens"] = bool(np.all(tok == want))
    except Exception as e:  # pylint: disable=broad-except
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
