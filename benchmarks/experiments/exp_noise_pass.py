"""The dense route's noise pass against ``jax.random.categorical`` on the
same f32 logits, and what in it costs (#40, #41: where ``auto`` takes the
dense route its call reads 0.95-1.0x XLA's way, the GEMM the same).

  python3 -m benchmarks.experiments.exp_noise_pass [--shapes 256x151936 64x151936]
      [--rounds 3]

Programs over logits ``[B, V]`` (random normal, T 1), each a reduction to one
token per row, in alternating rounds (``_timing.timed_rounds``, us):

* ``xla``: ``jax.random.categorical(key, l)``;
* ``ours``: the dense route's pass as it was (``xla_backend.candidates``'s
  block: tempered, perturbed, ids past V masked, first argmax with its
  score);
* ``no_mask``: the same without the mask of ids past V (a no-op here; the
  pass since, where the head has no padding rows);
* ``no_div``: without the division by T (its scores equal ``ours``' at
  T = 1 only);
* ``argmax_only``: the token alone, no gather of its score;
* ``sample_logits``: ``fs.sample_logits`` through ``auto``.

The tokens of every program are checked equal to ``xla``'s first.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax import lax

import flashsample_jax as fs
from benchmarks._timing import device_name, timed_rounds
from flashsample_jax import problem, stage2


def _pass(p, l, *, mask=True, divide=True, gather=True):
  gid = lax.iota(jnp.int32, l.shape[1])
  t = stage2.tempered(p, l) if divide else l
  s = stage2.perturbed(p, l, t, gid, 1)[:, 0]
  if mask:
    s = jnp.where(gid < p.vocab_size, s, -jnp.inf)
  j = jnp.argmax(s, axis=1)
  if not gather:
    return j
  return j, jnp.take_along_axis(s, j[:, None], axis=1)[:, 0]


def programs(key, temperature) -> dict:
  prep = lambda l: problem.prepare_logits(l, key, temperature=temperature)
  tok = lambda r: r[0] if isinstance(r, tuple) else r
  return {
      "xla": jax.jit(lambda l: jax.random.categorical(key, l / temperature)),
      "ours": jax.jit(lambda l: tok(_pass(prep(l), l))),
      "no_mask": jax.jit(lambda l: tok(_pass(prep(l), l, mask=False))),
      "no_div": jax.jit(lambda l: tok(_pass(prep(l), l, divide=False))),
      "argmax_only": jax.jit(lambda l: _pass(prep(l), l, gather=False)),
      "sample_logits": jax.jit(lambda l: fs.sample_logits(l, key, temperature=temperature)),
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", nargs="+", default=["256x151936", "64x151936", "256x128256",
                                                   "64x128256"])
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  key = jax.random.key(0)
  fns = programs(key, 1.0)
  for shape in args.shapes:
    b, v = (int(x) for x in shape.split("x"))
    l = jax.random.normal(jax.random.key(b + v), (b, v), jnp.float32) * 2.0
    want = fns["xla"](l)
    same = {n: bool(jnp.all(f(l) == want)) for n, f in fns.items()}
    print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, B=b, V=v, same=same)),
          flush=True)
    timed_rounds(fns, l, rounds=args.rounds, B=b, V=v)


if __name__ == "__main__":
  main()
