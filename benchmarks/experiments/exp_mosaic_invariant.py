"""The mosaic controls kernel's batch-invariant split against its per-B one
and against the dense route (issue #39), in one process.

For each head, mode and B, timed in alternating rounds
(``_timing.timed_rounds``), random bf16 inputs, per-row keys, T 0.7:

* ``fixed``: ``fs.sample(...)`` through a ``MosaicBackend`` that runs the
  fixed split (blocks of 64 rows, each split over the vocabulary as one
  block alone) for every call, tokens-only ones included;
* ``per_b``: ``MosaicBackend(batch_invariant=False)`` (128-row blocks
  without lists, the SMs shared among a launch's blocks);
* ``dense``: ``backend="dense"`` (XLA's GEMM, then the package's fused
  noise and stage 2 over the logits; not batch invariant);
* ``xla``: XLA's own way, materialized logits, ``jax.random.categorical``
  per row and, for the modes with log-probabilities and no truncation,
  ``log_softmax`` + gather.

  python3 -m benchmarks.experiments.exp_mosaic_invariant [--heads S L]
      [--batches 1 16 64 128 256 512] [--modes logprobs topk_topp_logprobs]
      [--variants fixed per_b] [--exact-rows]

Prints one JSON line per (head, mode, B, round); with ``--exact-rows``,
for the truncation modes, one more with the rows each kernel variant sends
to the exact path (``benchmarks._fallback.exact_path_rows``, un-timed).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks._fallback import exact_path_rows
from benchmarks._timing import first_call_seconds, timed_rounds
from benchmarks.batch_invariance import TEMPERATURE
from benchmarks.shapes import HEADS, random_head
from flashsample_jax.backends.mosaic import MosaicBackend

MODES = {
    "logprobs": dict(return_logprobs=True),
    "topk_topp": dict(top_k=50, top_p=0.9),
    "topk_topp_logprobs": dict(top_k=50, top_p=0.9, return_logprobs=True),
    "rl_all": dict(top_k=50, top_p=0.9, return_logprobs=True, return_entropy=True,
                   return_raw_logprobs=True),
}


class FixedSplitMosaic(MosaicBackend):
  """The fixed split for every call (tokens-only calls included)."""

  def fixed_split(self, c) -> bool:
    del c
    return True


# The variants that run fs.sample (the "xla" one is XLA's own program).
BACKENDS = {"fixed": FixedSplitMosaic(), "per_b": MosaicBackend(batch_invariant=False),
            "dense": "dense"}


def _truncates(kw) -> bool:
  return any(k in kw for k in ("top_k", "top_p"))


def _xla_way(kw):
  """XLA's own way for plain rows: the logits, categorical per row, and the
  token's ``log_softmax`` when the mode asks for it (None with truncation:
  bench_controls has those baselines)."""
  if _truncates(kw):
    return None

  def run(h, w, keys):
    l = jnp.dot(h, w.T, preferred_element_type=jnp.float32) / TEMPERATURE
    tok = jax.vmap(jax.random.categorical)(keys, l)
    if not kw.get("return_logprobs"):
      return tok
    return tok, jnp.take_along_axis(jax.nn.log_softmax(l), tok[:, None], 1)[:, 0]
  return run


def _variants(kw, names):
  """name -> jitted function of ``(h, w, keys)`` (the weight an argument:
  a closure would compile it into the program as a constant)."""
  out = {}
  for name in names:
    if name == "xla":
      f = _xla_way(kw)
      if f is not None:
        out[name] = jax.jit(f)
      continue
    out[name] = jax.jit(lambda h, w, k, be=BACKENDS[name]: fs.sample(
        h, w, k, temperature=TEMPERATURE, backend=be, **kw))
  return out


def _exact_rows(w, h, keys, kw, names, **tags):
  """Prints the rows each kernel variant's call sends to the exact path."""
  if not _truncates(kw):
    return
  rec = dict(tags, exact_rows={
      name: exact_path_rows(h, w, keys, temperature=TEMPERATURE, backend=BACKENDS[name],
                            **kw)
      for name in names if name in ("fixed", "per_b")})
  print(json.dumps(rec), flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", nargs="+", default=["S", "L"], choices=sorted(HEADS))
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 128, 256, 512])
  ap.add_argument("--modes", nargs="+", default=["logprobs", "topk_topp_logprobs"],
                  choices=list(MODES))
  ap.add_argument("--variants", nargs="+", default=["fixed", "per_b"],
                  choices=["fixed", "per_b", "dense", "xla"])
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--exact-rows", action="store_true")
  args = ap.parse_args(argv)
  for head in args.heads:
    d, _ = HEADS[head]
    w = random_head(head)
    for mode in args.modes:
      for b in args.batches:
        h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
        keys = jax.random.split(jax.random.key(3), b)
        variants = _variants(MODES[mode], args.variants)
        for name, f in variants.items():   # compile times, to budget runs
          print(f"{head} {mode} B={b} {name}: first call "
                f"{first_call_seconds(f, h, w, keys):.1f} s", file=sys.stderr, flush=True)
        timed_rounds(variants, h, w, keys, rounds=args.rounds, head=head, mode=mode, B=b)
        if args.exact_rows:
          _exact_rows(w, h, keys, MODES[mode], args.variants, head=head, mode=mode, B=b)


if __name__ == "__main__":
  main()
