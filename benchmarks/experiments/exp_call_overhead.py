"""Why does a plain mosaic call time longer than its kernels on the device?

The device trace of back-to-back calls (exp_mosaic_profile.py trace) puts a
B=1 call at ~294 us of kernels and gaps, the benchmark at ~324 us. This
times the same call several ways in one process, shape S:

* ``bench``: as bench_sampler.py (key passed as an argument, T = 1);
* ``const_key``: the key a constant of the jit (T = 0.9, as the trace);
* ``xla_baseline``: jax.random.categorical on materialized logits;
* each with blocks of 10 and of 50 calls between syncs (the first call of a
  block pays the host's whole latency, so blocks of 50 show the steady state);

then a profile of the ``bench`` call: device kernels and host events.

  PYTHONPATH=. python3 benchmarks/exp_call_overhead.py [B ...]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np


import flashsample_jax as fs
from benchmarks import _timing

D, V = 4096, 151936


def fns():
  k7 = jax.random.key(7)
  return {
      "bench": jax.jit(lambda k, h, w: fs.sample(h, w, k, backend="mosaic")),
      "const_key": jax.jit(lambda k, h, w: fs.sample(
          h, w, k7, temperature=0.9, backend="mosaic")),
      "xla_baseline": jax.jit(lambda k, h, w: jax.random.categorical(
          k, jnp.dot(h, w.T, preferred_element_type=jnp.float32))),
  }


def profile(f, args, tag):
  dev, host = _timing.trace_events(f, *args, calls=8)
  host = [e for e in host if e[1] > 3000]
  if not dev:
    print(f"== profile {tag}: no GPU events (run it on a GPU)")
    return
  t0 = dev[0][0]
  print(f"== profile {tag}: last device events (start us, dur us, name)")
  for s, du, n, _line in dev[-16:]:
    print(f"  {(s - t0) / 1e3:9.1f} {du / 1e3:8.1f}  {n[:70]}")
  span = (dev[-1][0] + dev[-1][1] - dev[0][0]) / 1e3
  print(f"  8 calls: device window {span:.1f} us, busy {sum(x[1] for x in dev) / 1e3:.1f} us")
  print(f"== host events > 3 us in the window ({tag})")
  names = {}
  for s, du, ln, n in host:
    if s >= t0:
      key = n[:60]
      c, tot = names.get(key, (0, 0))
      names[key] = (c + 1, tot + du)
  for n, (c, tot) in sorted(names.items(), key=lambda x: -x[1][1])[:25]:
    print(f"  {c:4d} x {tot / c / 1e3:8.1f} us  {n}")


def main():
  batches = [int(x) for x in sys.argv[1:]] or [1, 64]
  print(_timing.device_name(), jax.__version__, flush=True)
  w = (jax.random.normal(jax.random.key(1), (V, D), jnp.float32) / np.sqrt(D)).astype(jnp.bfloat16)
  for b in batches:
    h = jax.random.normal(jax.random.key(b), (b, D), jnp.bfloat16)
    args = (jax.random.key(7), h, w)
    for name, f in fns().items():
      jax.block_until_ready(f(*args))
      t10 = _timing.median_us(f, *args, reps=15, inner=10)[0]
      t50 = _timing.median_us(f, *args, reps=7, inner=50)[0]
      print(f"B={b:4d} {name:13s} inner10 {t10:7.1f} us  inner50 {t50:7.1f} us", flush=True)
    profile(fns()["bench"], args, f"bench B={b}")


if __name__ == "__main__":
  main()
