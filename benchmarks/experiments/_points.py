"""The measuring points the dense-route experiments share (exp_dense_lists,
exp_dense_parts, exp_list_length): a head, its weight dtype and a batch of
random hidden states, and how a point's variants are reported (alternating
rounds of wall time, or device timelines)."""

from __future__ import annotations

import collections
import contextlib
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from flashsample_jax import api, controls, problem, stage2
from benchmarks import shapes
from benchmarks._timing import device_name, enqueue_us, timed_rounds, trace_events
from benchmarks.experiments.exp_small_b_timeline import timeline

DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8"}


def add_point_args(ap, *, heads, batches, weight_dtypes, rounds: int) -> None:
  """``--heads``, ``--batches``, ``--weight-dtypes``, ``--rounds``,
  ``--timeline`` and ``--enqueue``, with these defaults."""
  ap.add_argument("--heads", nargs="+", default=heads, choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=batches)
  ap.add_argument("--weight-dtypes", nargs="+", default=weight_dtypes,
                  choices=[*DTYPES, "bf16"])
  ap.add_argument("--rounds", type=int, default=rounds)
  ap.add_argument("--timeline", action="store_true")
  ap.add_argument("--enqueue", action="store_true",
                  help="per round, each variant's host time per call too (enqueue_us)")
  ap.add_argument("--host-events", action="store_true",
                  help="each variant's host events per call in a profiler trace, by name "
                       "(where the host's time goes: thunks, graph updates, launches)")


def head(name: str, dtype: str):
  """``(weight, scale)``: the benchmark's random head, quantized per row to
  ``dtype`` (scale None for bf16)."""
  w = shapes.random_head(name)
  if dtype == "bf16":
    return w, None
  return fs.quantize_weight(w, DTYPES[dtype])


def points(args):
  """``(w, scale, h, tags)`` for each head, weight dtype and batch of
  ``args`` (random bf16 hidden states, drawn per B)."""
  for name in args.heads:
    d, _ = shapes.HEADS[name]
    for dtype in args.weight_dtypes:
      w, scale = head(name, dtype)
      for b in args.batches:
        h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
        yield w, scale, h, dict(gpu=device_name(), jax=jax.__version__, head=name,
                                weight=dtype, B=b)


def _enqueue_rounds(variants, h, w, *, rounds: int, **tags) -> None:
  """Per round, one JSON line of each variant's host time per call
  (:func:`benchmarks._timing.enqueue_us`): where a variant's wall time
  follows its host's, the device waits on the host."""
  for r in range(rounds):
    rec = dict(tags, round=r, measure="enqueue_us")
    for name, f in variants.items():
      rec[name] = round(enqueue_us(f, (h, w)), 1)
    print(json.dumps(rec), flush=True)


def host_events(f, *args, calls: int = 20, top: int = 40, synced: bool = False) -> dict:
  """The host events of ``calls`` back-to-back calls in a profiler trace
  (``synced``: each waiting for the last, see ``trace_events``), by name:
  the ``top`` names by time, each ``[count per call, us per call]`` (nested
  events count in their parents too), and the span of the host's events
  per call."""
  _, host = trace_events(f, *args, calls=calls, synced=synced)
  count, time_ns = collections.Counter(), collections.Counter()
  for _, dur, _, name in host:
    if name.startswith("$"):          # Python frames: the caller's, not the call's
      continue
    key = name[:70]
    count[key] += 1
    time_ns[key] += dur
  span = (max(s + d for s, d, _, _ in host) - host[0][0]) / calls / 1e3 if host else 0.0
  return dict(host_span_us=round(span, 1),
              events={n: [round(count[n] / calls, 2), round(t / calls / 1e3, 2)]
                      for n, t in time_ns.most_common(top)})


def report(args, variants, h, w, tags, traced=None) -> None:
  """Alternating rounds of ``variants`` (name -> function of ``(h, w)``), or
  with ``--timeline`` the device timelines of those named in ``traced``
  (every variant by default), one JSON line each."""
  if getattr(args, "host_events", False):
    for name, f in variants.items():
      for synced in (False, True):
        print(json.dumps(dict(tags, variant=name, synced=synced,
                              **host_events(f, h, w, synced=synced))), flush=True)
    return
  if not args.timeline:
    timed_rounds(variants, h, w, rounds=args.rounds, **tags)
    if args.enqueue:
      _enqueue_rounds(variants, h, w, rounds=args.rounds, **tags)
    return
  for name in traced or variants:
    print(json.dumps(dict(tags, variant=name, **timeline(variants[name], h, w, calls=20))),
          flush=True)


@contextlib.contextmanager
def stage2_with(patch):
  """Traces stage 2 with ``patch``'s attributes (``name`` of
  :mod:`flashsample_jax.stage2`, or ``"problem.name"`` / ``"controls.name"``),
  for variants of a call traced in one process. The API's jit is cleared on
  the way in and out: it would otherwise answer one trace with the other's
  program."""
  where = lambda name: ({"problem": problem, "controls": controls}[name.split(".")[0]]
                        if "." in name else stage2, name.split(".")[-1])
  saved = {name: getattr(*where(name)) for name in patch}
  for name, value in patch.items():
    setattr(*where(name), value)
  api.run.clear_cache()
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(*where(name), value)
    api.run.clear_cache()
