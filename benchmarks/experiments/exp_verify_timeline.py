"""Where a fused verification's time goes: the device kernels of
``fs.verify_drafts`` (one-hot) and of ``fs.sample`` of the same rows, per
kernel name, from a profiler trace (#38).

  python benchmarks/experiments/exp_verify_timeline.py [--head S] [--k 4] [--batch 1]
      [--config plain|qwen3]

Prints, for each call, the summed device time per kernel name (top 15), the
call's span on the device (first kernel start to last kernel end, averaged),
its median wall time per call, the device stream lines the events came on,
and (``--sequence``) the last call's events in order with the idle time
before each, and the host events longer than 20 us in that window (a host
wait inside a call, e.g. a predicate copied back, shows there).
"""

from __future__ import annotations

import argparse
import collections
import json

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name, median_us, trace_events

CONFIGS = {"qwen3": dict(temperature=0.6, top_k=20, top_p=0.95), "plain": dict(temperature=1.0)}


def sequence(device, host, per_call: int):
  """The last call's device events with the gap before each, and the host
  events over 20 us in its window."""
  last = device[-per_call:]
  out, prev = [], None
  for start, dur, kernel, line in last:
    gap = 0.0 if prev is None else (start - prev) / 1e3
    out.append([round(gap, 1), round(dur / 1e3, 1), kernel[:60], line[-20:]])
    prev = start + dur
  lo, hi = last[0][0], last[-1][0] + last[-1][1]
  waits = [[round((s - lo) / 1e3, 1), round(d / 1e3, 1), t[-20:], n[:60]]
           for s, d, t, n in host if lo <= s <= hi and d > 20e3]
  return out, waits


def profile(name, f, *args, calls=6, show_sequence=False):
  device, host = trace_events(f, *args, calls=calls)
  per = collections.Counter()
  for _, dur, kernel, _ in device:
    per[kernel[:70]] += dur / calls / 1e3
  span = (device[-1][0] + device[-1][1] - device[0][0]) / calls / 1e3 if device else 0.0
  print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, call=name,
                        wall_us=round(median_us(f, *args)[0], 1), span_us=round(span, 1),
                        kernels=len(device) // calls,
                        lines=sorted({line for *_, line in device}),
                        top={k: round(v, 1) for k, v in per.most_common(15)})), flush=True)
  if show_sequence and device:
    seq, waits = sequence(device, host, len(device) // calls)
    print(json.dumps(dict(call=name, sequence=seq, host_waits=waits)), flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--head", default="S", choices=sorted(shapes.HEADS))
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--batch", type=int, nargs="+", default=[1])
  ap.add_argument("--config", default="plain", choices=sorted(CONFIGS))
  ap.add_argument("--sequence", action="store_true",
                  help="also the last call's events in order, with gaps and host waits")
  args = ap.parse_args()
  d, v = shapes.HEADS[args.head]
  w = shapes.random_head(args.head, 1.3)
  cfg = CONFIGS[args.config]
  key = jax.random.key(0)
  for b in args.batch:
    h = jax.random.normal(jax.random.key(b), (b, args.k + 1, d), jnp.bfloat16)
    drafts = jax.random.randint(jax.random.key(1), (b, args.k), 0, v, jnp.int32)
    verify = jax.jit(lambda key, h, w, dr: fs.verify_drafts(h, w, key, dr, **cfg))
    sample = jax.jit(lambda key, h, w: fs.sample(h.reshape(-1, d), w, key, **cfg))
    logprobs = jax.jit(lambda key, h, w: fs.sample(h.reshape(-1, d), w, key,
                                                   return_logprobs=True, **cfg))
    print(f"B = {b}, K = {args.k}, {args.config}")
    profile("verify_one_hot", verify, key, h, w, drafts, show_sequence=args.sequence)
    profile("sample", sample, key, h, w, show_sequence=args.sequence)
    profile("sample_logprobs", logprobs, key, h, w, show_sequence=args.sequence)


if __name__ == "__main__":
  main()
