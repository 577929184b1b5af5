"""The mosaic controls kernel's batch-invariant split against its per-B one
and against the dense route (issue #39), in one process.

For each head, mode and B, timed in alternating rounds
(``_timing.timed_rounds``), random bf16 inputs, per-row keys, T 0.7:

* ``fixed``: ``fs.sample(...)`` through a ``MosaicBackend`` that runs the
  fixed split (each block split over the vocabulary as one block alone;
  without lists 128-row blocks past 64 rows, 64-row ones with the same
  epilogue up to it) for every call, tokens-only ones included;
* ``fixed_narrow``: the fixed split in blocks of 64 rows at every B (its
  own epilogue: other bits; for calls with lists or several samples the
  epilogue they ran before they took the one without lists);
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
to the exact path and what their lists held
(``benchmarks._fallback.exact_path_reasons``, un-timed).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks._fallback import exact_path_reasons
from benchmarks._timing import first_call_seconds, timed_rounds
from benchmarks import batch_invariance
from benchmarks.batch_invariance import TEMPERATURE
from benchmarks.shapes import HEADS, random_head
from flashsample_jax.backends.mosaic import MosaicBackend

MODES = {
    "logprobs": dict(return_logprobs=True),
    "topk_topp": dict(top_k=50, top_p=0.9),
    "topk_topp_logprobs": dict(top_k=50, top_p=0.9, return_logprobs=True),
    "rl_all": dict(top_k=50, top_p=0.9, return_logprobs=True, return_entropy=True,
                   return_raw_logprobs=True),
    # Lists or several samples with no truncation rule: the kernel's epilogue
    # is the one without lists, so that the floats are score_tokens' bits.
    "logprobs_top5": dict(return_logprobs=True, top_logprobs=5),
    "logprobs_samples2": dict(return_logprobs=True, num_samples=2),
    # fs.score_tokens of given ids (every ScoreOutput field), no truncation.
    "score": dict(score=True),
}


class FixedSplitMosaic(MosaicBackend):
  """The fixed split for every call (tokens-only calls included)."""

  def fixed_split(self, c) -> bool:
    del c
    return True


class NarrowFixedSplitMosaic(FixedSplitMosaic):
  """The fixed split in blocks of 64 rows at every batch, their own
  epilogue (which calls with lists or several samples ran before they took
  the one without lists)."""

  def invariant_rows(self, p, c) -> int:
    del p, c
    from pallas_kernels.sm90_controls import BATCH
    return BATCH


# The variants that run fs.sample (the "xla" one is XLA's own program).
BACKENDS = {"fixed": FixedSplitMosaic(), "fixed_narrow": NarrowFixedSplitMosaic(),
            "per_b": MosaicBackend(batch_invariant=False), "dense": "dense"}


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
    if kw.get("score"):
      tok = given_ids(h.shape[0], w.shape[0])
    else:
      tok = jax.vmap(jax.random.categorical)(keys, l)
    if not (kw.get("return_logprobs") or kw.get("score")):
      return tok
    return tok, jnp.take_along_axis(jax.nn.log_softmax(l), tok[:, None], 1)[:, 0]
  return run


def given_ids(batch: int, vocab: int):
  """The ids the score mode scores: spread over the vocabulary."""
  return (jnp.arange(batch, dtype=jnp.int32) * 7919) % vocab


def _call(kw, backend):
  """``(h, w, keys) -> outputs`` of ``fs.sample`` (or ``fs.score_tokens``
  for the score mode) through ``backend``."""
  if kw.get("score"):
    return lambda h, w, k: fs.score_tokens(h, w, given_ids(h.shape[0], w.shape[0]),
                                           temperature=TEMPERATURE, backend=backend)
  return lambda h, w, k: fs.sample(h, w, k, temperature=TEMPERATURE, backend=backend, **kw)


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
    out[name] = jax.jit(_call(kw, BACKENDS[name]))
  return out


def _exact_rows(w, h, keys, kw, names, **tags):
  """Prints the rows each kernel variant's call sends to the exact path."""
  if not _truncates(kw):
    return
  rec = dict(tags, exact_rows={
      name: exact_path_reasons(h, w, keys, temperature=TEMPERATURE, backend=BACKENDS[name],
                               **kw)
      for name in names if name in ("fixed", "fixed_narrow", "per_b")})
  print(json.dumps(rec), flush=True)


def _invariance(w, d: int, head: str, names, batches, full: int = 512):
  """batch_invariance's bit check of each kernel variant (plain and rl
  modes): one JSON line per B."""
  h = jax.random.normal(jax.random.key(7), (full, d), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(3), full)
  for name in names:
    if name not in ("fixed", "fixed_narrow", "per_b"):
      continue
    for mode in ("plain", "rl"):
      # measure prints a JSON line per B.
      batch_invariance.measure(w, h, keys, BACKENDS[name], mode,
                               [b for b in batches if b < full], label=f"{head} {name}")


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", nargs="+", default=["S", "L"], choices=sorted(HEADS))
  ap.add_argument("--batches", nargs="*", type=int, default=[1, 16, 64, 128, 256, 512])
  ap.add_argument("--modes", nargs="+", default=["logprobs", "topk_topp_logprobs"],
                  choices=list(MODES))
  ap.add_argument("--variants", nargs="+", default=["fixed", "per_b"],
                  choices=[*BACKENDS, "xla"])
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--exact-rows", action="store_true")
  ap.add_argument("--invariance", nargs="*", type=int, default=None, metavar="B",
                  help="first, for each kernel variant and batch_invariance mode "
                       "(plain, rl), its bit check at these B against a call of 512")
  args = ap.parse_args(argv)
  for head in args.heads:
    d, _ = HEADS[head]
    w = random_head(head)
    if args.invariance:
      _invariance(w, d, head, args.variants, args.invariance)
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
