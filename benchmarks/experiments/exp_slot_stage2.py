"""The slot-lists route after its Mosaic kernel (#40): the entry kernel's
variants alone, and the call with the exact path's conditional in its
layouts.

  python3 -m benchmarks.experiments.exp_slot_stage2 [--heads S L] [--batches 1 16]
      [--rounds 3] [--skip-kernel] [--skip-call]

For each head and B (FP8 per row, random inputs, top-k 50 + top-p 0.9):

* the entry kernel (``triton_lists.entry_launch``) on the Mosaic kernel's
  entries of that point, per variant (``r``: bits a step of tau's radix
  select; ``w``: warps), its device time per launch from a profiler trace,
  and whether its lists equal the first variant's (a lower ``tau`` may give
  another valid bound, so this is reported, not asserted);
* ``fs.sample`` through mosaic (the slot lists) per call variant, traced
  with the patches in place: ``nested`` (the exact path's conditional with
  a second one inside past 8 rows), ``single`` (one conditional up to 16
  rows: ``stage2.EXACT_COND_ROWS``), ``no_cond`` (the exact path left out:
  for timing only); ``plain`` beside. The tokens of every variant are
  checked equal to the first's; then alternating rounds of wall time, the
  host's time a call (``enqueue_us``), its host events (the CUDA graph's
  update and launch) and one device timeline each.

The committed results of the first version of this script (commit
0de2bf8) also hold the entry kernel with four scans, one an entry (``old``) and
top-p's terms behind an optimization barrier (``fence``: no change).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json

import jax
import numpy as np

import flashsample_jax as fs
from benchmarks._timing import enqueue_us, timed_rounds
from benchmarks.bench_controls import TOP_K, TOP_P
from benchmarks.experiments._points import add_point_args, host_events, points
from benchmarks.experiments.exp_small_b_timeline import timeline
from flashsample_jax import controls, problem, stage2
from pallas_kernels import rowdata, sm90_slots, triton_lists as tls

_ENTRY = tls.entry_launch
_EXACT_PATH = stage2._exact_path  # pylint: disable=protected-access
_COND_ROWS = stage2.EXACT_COND_ROWS
CALLS = {"nested": dict(cond_rows=8, exact=True),
         "single": dict(cond_rows=16, exact=True),
         "no_cond": dict(cond_rows=_COND_ROWS, exact=False)}


def _no_exact_path(p, c, rows, axis, *, then=None):
  del p, c, axis
  return rows if then is None else then(rows)


@contextlib.contextmanager
def _patched(cond_rows: int, exact: bool):
  """The call's code with these choices (jax's caches cleared on both
  sides: fs.sample's inner jits would keep the first variant's trace)."""
  jax.clear_caches()
  stage2.EXACT_COND_ROWS = cond_rows
  stage2._exact_path = _EXACT_PATH if exact else _no_exact_path  # pylint: disable=protected-access
  try:
    yield
  finally:
    stage2.EXACT_COND_ROWS, stage2._exact_path = _COND_ROWS, _EXACT_PATH  # pylint: disable=protected-access
    jax.clear_caches()


def _pc(h, w, scale, key):
  """The checked ``(Problem, Controls)`` of this point's truncated call."""
  p = problem.prepare(h, w, key, weight_scale=scale)
  c = controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size, rows=p.total_rows,
                                top_k=TOP_K, top_p=TOP_P)
  return p, c


def _entries(h, w, scale, key):
  """The Mosaic slot kernel's entries of this point, as the route makes them."""
  p, _ = _pc(h, w, scale, key)
  rows = rowdata.pack_rows(k0=p.k0, k1=p.k1, temperature=p.temperature,
                           ctr_hi=p.ctr_hi[None], ctr_lo=p.ctr_lo[None])
  f = jax.jit(lambda: sm90_slots.slot_entries(
      p.hidden, p.weight, rows, 0, layout=p.layout, vocab_size=p.vocab_size,
      scale=p.weight_scale))
  return f()


def kernel_variants(h, w, scale, key, tags) -> None:
  ent = _entries(h, w, scale, key)
  fields = tuple(ent[k] for k in tls.ENTRY_FIELDS)
  b = h.shape[0]
  m = stage2.candidate_count(*_pc(h, w, scale, key))
  first = None
  for radix, warps in itertools.product((2, 4), (8, 16)):
    f = jax.jit(functools.partial(lambda *fs_, r, nw: _ENTRY(fs_, m, b, radix=r, num_warps=nw),
                                  r=radix, nw=warps))
    out = jax.device_get(f(*fields))
    first = first or out
    same = all(np.array_equal(out[k], first[k]) for k in ("cand_vals", "cand_ids"))
    tl_ = timeline(f, *fields, calls=20)
    us = {n: t for n, t in tl_["per_kernel"].items() if "entry" in n}
    print(json.dumps(dict(tags, part="entry_kernel", radix=radix, warps=warps, kernel_us=us,
                          same_lists=same,
                          bound_finite=int(np.isfinite(out["cand_bound"]).sum()))), flush=True)


def call_variants(h, w, scale, key, tags, rounds: int) -> None:
  keys = jax.random.split(key, 8)
  compiled, toks = {}, {}
  for name, kw in CALLS.items():
    with _patched(**kw):
      f = jax.jit(lambda h_, w_, k: fs.sample(h_, w_, k, backend="mosaic", weight_scale=scale,
                                              top_k=TOP_K, top_p=TOP_P))
      compiled[name] = f.lower(h, w, key).compile()
    toks[name] = np.stack([np.asarray(compiled[name](h, w, k)) for k in keys])
  print(json.dumps(dict(tags, part="same_tokens",
                        **{n: bool(np.array_equal(t, toks["nested"])) for n, t in toks.items()})),
        flush=True)
  variants = {n: functools.partial(lambda h_, w_, f: f(h_, w_, key), f=f)
              for n, f in compiled.items()}
  variants["plain"] = jax.jit(lambda h_, w_: fs.sample(h_, w_, key, weight_scale=scale)
                              ).lower(h, w).compile()
  timed_rounds(variants, h, w, rounds=rounds, part="call", **tags)
  for r in range(rounds):
    print(json.dumps(dict(tags, part="enqueue_us", round=r,
                          **{n: round(enqueue_us(f, (h, w)), 1) for n, f in variants.items()})),
          flush=True)
  for name, f in variants.items():
    ev = host_events(f, h, w, top=14)
    print(json.dumps(dict(tags, part="host_events", variant=name, **ev)), flush=True)
    print(json.dumps(dict(tags, part="timeline", variant=name, **timeline(f, h, w, calls=20))),
          flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_point_args(ap, heads=["S", "L"], batches=[1, 16], weight_dtypes=["fp8"], rounds=3)
  ap.add_argument("--skip-kernel", action="store_true")
  ap.add_argument("--skip-call", action="store_true")
  args = ap.parse_args(argv)
  key = jax.random.key(0)
  for w, scale, h, tags in points(args):
    if not args.skip_kernel:
      kernel_variants(h, w, scale, key, tags)
    if not args.skip_call:
      call_variants(h, w, scale, key, tags, args.rounds)


if __name__ == "__main__":
  main()
