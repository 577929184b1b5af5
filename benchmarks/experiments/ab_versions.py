"""A/B of two checkouts of the package through its public API only.

Times ``fs.sample`` (plain sampling and a few controls) for the package found
on ``sys.path`` and prints one JSON line per point, so that the same script
measures an old and a new commit in one device session:

  git archive OLD flashsample_jax pallas_kernels | tar -x -C .ab/old
  (cd .ab/old && PYTHONPATH=.:../.. python3 -m benchmarks.experiments.ab_versions old)
  python3 -m benchmarks.experiments.ab_versions new

Two jax versions (the same checkout; jax 0.12 installed into a folder, e.g.
by scripts/offline_wheels.sh): ``python3 -m benchmarks.experiments.ab_versions
jax0.11`` and ``PYTHONPATH=DIR python3 -m ...ab_versions jax0.12``, alternated
(benchmarks/jax_versions_gpu.sh).

Points: the default set, or ``--points S:1,256 L:256 S:64:topk_topp``
(plain sampling, or the named control, at those batches), each followed by XLA's dot + categorical on the same inputs
(``control`` "xla"), so that each process carries its own baseline.
``--backend NAME`` (before ``--points``) times that backend instead of auto.

(``-m`` puts the working directory first on ``sys.path``: the old package is
found in ``.ab/old``, the benchmarks in the checkout.)

Only ``flashsample_jax.sample`` and ``flashsample_jax.reference`` are used,
which both commits have; the timing is the benchmarks' own (blocks of async
calls between host syncs, median).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks._timing import median_us

SHAPES = {"S": (4096, 151936), "L": (8192, 128256)}
POINTS = ([("S", b, "plain") for b in (1, 64, 256)] + [("L", b, "plain") for b in (16, 256)]
          + [("S", 1, "topk_topp"), ("S", 64, "topk_topp"), ("S", 64, "logprobs"),
             ("S", 64, "samples4")])
CONTROLS = {"plain": {}, "topk_topp": dict(top_k=50, top_p=0.9),
            "logprobs": dict(return_logprobs=True), "samples4": dict(num_samples=4)}


def main(tag: str, points=POINTS, backend: str = "auto"):
  weights = {}
  for shape, b, ctl in points:
    d, v = SHAPES[shape]
    if shape not in weights:
      kw = jax.random.key(1)
      weights[shape] = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / np.sqrt(d))
                        ).astype(jnp.bfloat16)
    w = weights[shape]
    h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
    key = jax.random.key(7)
    if ctl == "xla":
      f = jax.jit(lambda k, h, w: jax.random.categorical(
          k, jnp.dot(h, w.T, preferred_element_type=jnp.float32) / 0.8))
    else:
      kw = CONTROLS[ctl]
      f = jax.jit(lambda k, h, w, kw=kw: fs.sample(h, w, k, temperature=0.8,
                                                  backend=backend, **kw))
    us, _ = median_us(f, key, h, w, reps=15, inner=30)
    tok = f(key, h, w)
    tok = tok.tokens if hasattr(tok, "tokens") else tok
    print(json.dumps(dict(tag=tag, shape=shape, batch=b, control=ctl, us=round(us, 1),
                          token_sum=int(np.asarray(tok).astype(np.int64).sum()),
                          device=jax.devices()[0].device_kind,
                          jax=jax.__version__)), flush=True)


def _points(args):
  """``["S:1,256", "L:256", "S:64:topk_topp"]`` -> that control (default
  plain sampling) at those batches, each followed by XLA's."""
  out = []
  for arg in args:
    shape, batches, *ctl = arg.split(":")
    for b in batches.split(","):
      out += [(shape, int(b), ctl[0] if ctl else "plain"), (shape, int(b), "xla")]
  return out


if __name__ == "__main__":
  args = sys.argv[1:]
  tag = args.pop(0) if args and not args[0].startswith("--") else "run"
  backend = "auto"
  if args[:1] == ["--backend"]:
    backend = args[1]
    args = args[2:]
  if args[:1] == ["--points"]:
    main(tag, _points(args[1:]), backend)
  else:
    main(tag, backend=backend)
