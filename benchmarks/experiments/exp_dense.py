"""Why the dense route (XLA's dot, then one fused noise + argmax pass) is
slower than XLA's own dot + ``jax.random.categorical`` at large B (issue
#20): variants of the second pass, next to the baseline, the dense backend
and the auto route, in one process. Tokens of every variant are checked
against the baseline's.

* ``baseline``: ``jax.random.categorical(k, dot(h, w))``;
* ``dense``: ``fs.sample(backend="dense")`` (T = 1 as a [B] array);
* ``jr_tempered``: the baseline with the logits divided by a [B] T;
* ``pkg_token``: the package's noise (``stage2.perturbed``), argmax only;
* ``pkg_best``: the same, and the best score gathered (the dense route's
  ``(score, id)``);
* ``auto``: ``fs.sample``'s own pick.

  python3 -m benchmarks.experiments.exp_dense S:256,512 L:256,512

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
from flashsample_jax import problem, stage2


def _dot(h, w):
  return jnp.dot(h, w.T, preferred_element_type=jnp.float32)


def _pkg(k, h, w, best: bool):
  p = problem.prepare(h, w, k, temperature=1.0)
  l = _dot(p.hidden, p.weight)
  gid = jax.lax.iota(jnp.int32, l.shape[1])
  s = stage2.perturbed(p, l, stage2.tempered(p, l), gid, 1)[:, 0]
  j = jnp.argmax(s, axis=1)
  if not best:
    return j
  return j, jnp.take_along_axis(s, j[:, None], axis=1)[:, 0]


VARIANTS = {
    "baseline": lambda k, h, w: jax.random.categorical(k, _dot(h, w)),
    "dense": lambda k, h, w: fs.sample(h, w, k, backend="dense"),
    "jr_tempered": lambda k, h, w: jax.random.categorical(
        k, _dot(h, w) / jnp.ones((h.shape[0], 1), jnp.float32)),
    "pkg_token": lambda k, h, w: _pkg(k, h, w, False),
    "pkg_best": lambda k, h, w: _pkg(k, h, w, True)[0],
    "auto": lambda k, h, w: fs.sample(h, w, k),
}


def main(points):
  for spec in points:
    head, batches = spec.split(":")
    d, v = HEADS[head]
    w = random_head(head)
    key = jax.random.key(7)
    for b in map(int, batches.split(",")):
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      want = None
      for name, f in VARIANTS.items():
        f = jax.jit(f)
        tok = np.asarray(f(key, h, w))
        if want is None:
          want = tok
        us, _ = median_us(f, key, h, w, reps=11, inner=20)
        print(json.dumps(dict(head=head, B=b, variant=name, us=round(us, 1),
                              same_tokens=bool((tok == want).all()))), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
