"""Stage 2's candidate lists on the Triton backend (issue #21): top-k 50 +
top-p 0.9 with the tiles' lists paired 0, 1 or 2 times before the top-M
sort (``TritonBackend.list_pairings``), next to Triton's plain sampling and
the mosaic kernel's, in one process. Each point also counts the rows that
take the exact path and checks the tokens against the reference.

  python3 -m benchmarks.experiments.exp_lists S 1,16,64 [0,1,2]

Prints one JSON line per point.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks._fallback import exact_path_rows
from benchmarks._timing import median_us
from benchmarks.shapes import HEADS, random_head
from flashsample_jax.backends.triton import TritonBackend

TOP_K, TOP_P, T = 50, 0.9, 0.7


def main(head, batches, pairings):
  d, v = HEADS[head]
  w = random_head(head)
  key = jax.random.key(7)
  for b in batches:
    h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
    ref = np.asarray(jax.jit(lambda h, w, k: fs.reference.sample(
        h, w, k, temperature=T, top_k=TOP_K, top_p=TOP_P))(h, w, key))
    runs = [("mosaic", "plain", "mosaic", {}), ("mosaic", "topk_topp", "mosaic", None),
            ("triton", "plain", TritonBackend(), {})]
    runs += [("triton", f"topk_topp_pairings{r}", TritonBackend(list_pairings=r), None)
             for r in pairings]
    for name, variant, be, kw in runs:
      kw = dict(top_k=TOP_K, top_p=TOP_P) if kw is None else kw
      f = jax.jit(lambda h, w, k, be=be, kw=kw: fs.sample(
          h, w, k, temperature=T, backend=be, **kw))
      rec = dict(head=head, b=b, backend=name, variant=variant)
      try:
        rec["us"] = round(median_us(f, h, w, key, reps=11, inner=20)[0], 1)
        if kw:
          rec["same_tokens"] = float(np.mean(np.asarray(f(h, w, key)) == ref))
          rec["exact_path_rows"] = exact_path_rows(h, w, key, temperature=T,
                                                   backend=be, **kw)
      except Exception as e:  # pylint: disable=broad-except
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")],
       [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0, 1, 2])
