"""What each of a score's per-element streams costs in the mosaic controls
kernel (issue #39: plain scoring against XLA's materialized way), in one
process.

Random bf16 inputs, T 1 (a trainer's usual score), the batch-invariant
split that ``fs.score_tokens`` runs (``exp_mosaic_invariant``'s
``fixed`` backend). Each kernel variant is the pass alone (the backend's
``controls_state``, no stage 2) with fewer of a score's streams:

* ``score``: every stream a score runs (log-sum-exp, entropy terms, the
  raw logits' log-sum-exp, the given id's t, the argmax of x);
* ``no_raw``: without the raw log-sum-exp;
* ``no_raw_ent``: and without the entropy terms;
* ``lse``: the log-sum-exp and the argmax only;
* ``bare``: the argmax of x only (the GEMM with the least epilogue);

and, for scale: ``call`` (``fs.score_tokens``, stage 2 included), ``dot``
(the cuBLAS dot alone, f32 out) and ``xla`` (the logits, ``log_softmax``
and a gather).

  python3 -m benchmarks.experiments.exp_score_streams [--heads S] [--rows 1024]

Prints one JSON line per (head, N, round).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks._timing import first_call_seconds, timed_rounds
from benchmarks.experiments.exp_mosaic_invariant import FixedSplitMosaic, given_ids
from benchmarks.shapes import HEADS, random_head
from flashsample_jax import api, mesh, scoring
from flashsample_jax.params import SamplingParams

# Controls changed from a score's, per kernel variant.
STREAMS = {
    "score": {},
    "no_raw": dict(return_raw_logprobs=False),
    "no_raw_ent": dict(return_raw_logprobs=False, return_entropy=False),
    "lse": dict(return_raw_logprobs=False, return_entropy=False, given_ids=None),
    "bare": dict(return_raw_logprobs=False, return_entropy=False, given_ids=None,
                 return_logprobs=False),
}


def _pass(mods: dict, backend):
  """``(h, w, tok) -> ControlsState`` of the score's pass with ``mods``."""
  def run(h, w, tok):
    defaults = {k: getattr(SamplingParams(), k) for k in scoring._controls_names()}
    ctl = scoring._settings(None, dict(defaults, temperature=1.0))
    p, c = api.prepare_call(h, w, jax.random.key(0), weight_layout="vd", vocab_size=None,
                            weight_scale=None, axes=mesh.MeshAxes.of(None, None),
                            controls=ctl)
    c = dataclasses.replace(c, given_ids=tok, noise=False)
    c = dataclasses.replace(c, **mods)
    return backend.controls_state(p, c)
  return run


def _xla(h, w, tok):
  l = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
  return jnp.take_along_axis(jax.nn.log_softmax(l), tok[:, None], 1)[:, 0]


def _dot(h, w, tok):
  del tok
  return jnp.dot(h, w.T, preferred_element_type=jnp.float32)


def variants(names, backend):
  out = {}
  for name in names:
    if name in STREAMS:
      out[name] = jax.jit(_pass(STREAMS[name], backend))
    elif name == "call":
      out[name] = jax.jit(lambda h, w, tok: fs.score_tokens(h, w, tok, backend=backend))
    elif name == "dot":
      out[name] = jax.jit(_dot)
    elif name == "xla":
      out[name] = jax.jit(_xla)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", nargs="+", default=["S"], choices=sorted(HEADS))
  ap.add_argument("--rows", nargs="+", type=int, default=[1024])
  ap.add_argument("--variants", nargs="+",
                  default=[*STREAMS, "call", "dot", "xla"],
                  choices=[*STREAMS, "call", "dot", "xla"])
  ap.add_argument("--rounds", type=int, default=2)
  args = ap.parse_args(argv)
  backend = FixedSplitMosaic()
  for head in args.heads:
    d, v = HEADS[head]
    w = random_head(head)
    for n in args.rows:
      h = jax.random.normal(jax.random.key(n), (n, d), jnp.bfloat16)
      tok = given_ids(n, v)
      fns = variants(args.variants, backend)
      for name, f in fns.items():
        print(f"{head} N={n} {name}: first call {first_call_seconds(f, h, w, tok):.1f} s",
              file=sys.stderr, flush=True)
      timed_rounds(fns, h, w, tok, rounds=args.rounds, head=head, N=n)


if __name__ == "__main__":
  main()
