"""Is a short call host-bound? The host's time to enqueue one call against
the device's time per call (docs/performance.md, "Small batches").

  python -m benchmarks.experiments.exp_host_period [--heads S] [--batches 1 16]
      [--weight-dtypes bf16 fp8] [--calls 8]

Per head, weight dtype and B, for ``fs.sample`` (auto) and the bare
``jnp.dot`` of the same head: ``enqueue_us``, the wall time of ``calls``
asynchronous calls before any result is awaited, over ``calls`` (the
host's dispatch cost while the device queue is not full: past about 30
calls in flight the host waits for the device, and the figure becomes a
share of the device time); ``wall_us``, the
median per call of blocks of back-to-back calls; ``device_us``, the device
period per call from a profiler trace, and ``traced_host_us``, the host's
time per call (JAX's ``PjitFunction`` event) in that trace: where the
profiler's own host cost exceeds the call's device work, the traced period
includes device time spent waiting for the host; and whether the traced program has
effects (which send a call down JAX's Python dispatch path). When
``enqueue_us`` reaches ``device_us`` the device waits on the host. One JSON
line per point.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name, enqueue_us, median_us, trace_events
from flashsample_jax import dense_lists
from flashsample_jax.backends.xla import DenseBackend

DTYPES = {"bf16": None, "fp8": "float8_e4m3fn", "int8": "int8"}


def traced(f, args, calls: int) -> dict:
  """The device period per call and the host's time per call of ``calls``
  back-to-back calls in a profiler trace (None where there is no device)."""
  device, host = trace_events(f, *args, calls=calls)
  pjit = [d for _, d, _, name in host if name.startswith("PjitFunction")]
  span = (device[-1][0] + device[-1][1] - device[0][0]) if device else None
  return dict(device_us=None if span is None else round(span / calls / 1e3, 1),
              traced_host_us=round(sum(pjit) / len(pjit) / 1e3, 1) if pjit else None)


def programs():
  """name -> function of ``(key, h, w, s)``: plain sampling, the dot alone,
  top-k 50 + top-p 0.9 through ``auto`` and on the dense route with slot
  lists, and the dense route's two list kernels alone on the dot's output
  (jax-triton calls: is their host cost what the device waits on?)."""
  def dot(k, h, w, s):
    del k
    w = w if s is None else w.astype(h.dtype)
    y = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
    return y if s is None else y * s

  def topk_topp(backend):
    return lambda k, h, w, s: fs.sample(h, w, k, weight_scale=s, top_k=50, top_p=0.9,
                                        backend=backend)

  def list_kernels(k, h, w, s):
    from pallas_kernels import triton_lists  # pylint: disable=import-outside-toplevel
    t = dot(k, h, w, s)
    return triton_lists.row_lists(t, 0, 128, slot=dense_lists.slot_size(t.shape[1], 128))

  return {"auto": lambda k, h, w, s: fs.sample(h, w, k, weight_scale=s), "dot": dot,
          "auto_topk_topp": topk_topp("auto"),
          "dense_slots_topk_topp": topk_topp(DenseBackend(list_select="slots")),
          "dot_list_kernels": list_kernels}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S"], choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--weight-dtypes", nargs="+", default=["bf16", "fp8"], choices=list(DTYPES))
  ap.add_argument("--calls", type=int, default=8)
  ap.add_argument("--programs", nargs="+", default=["auto", "dot"], choices=list(programs()))
  ap.add_argument("--smoke", action="store_true", help="a tiny head, for a CPU")
  args = ap.parse_args()
  progs = programs()
  for head in args.heads:
    d, v = (256, 4096) if args.smoke else shapes.HEADS[head]
    w16 = shapes.random_weight(d, v, 3.0)
    for wdt in args.weight_dtypes:
      w, s = (w16, None) if DTYPES[wdt] is None else fs.quantize_weight(w16, DTYPES[wdt])
      for b in args.batches:
        h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
        key = jax.random.key(7)
        for name, fn in ((n, progs[n]) for n in args.programs):
          f = jax.jit(fn)
          a = (key, h, w, s)
          rec = dict(gpu=device_name(), jax=jax.__version__, head=head, weight=wdt, B=b,
                     program=name, effects=bool(jax.make_jaxpr(fn)(*a).effects))
          rec["enqueue_us"] = round(enqueue_us(f, a, args.calls), 1)
          rec["wall_us"] = round(median_us(f, *a, reps=9, inner=20)[0], 1)
          rec.update(traced(f, a, calls=20))
          print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
