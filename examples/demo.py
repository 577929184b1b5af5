"""Demo: sample from a built-in LM-head configuration on whatever device is here.

Builds a random LM head of a real model's size, samples a batch of tokens with
``flashsample_jax.sample`` (backend "auto"), checks the tokens against the
reference (``jax.random.categorical`` on materialized logits), prints them,
and times the sampler against the XLA baseline
(``jax.random.categorical(key, hidden @ W.T)``).

  ./run demo                       # picks the config for this device
  ./run demo --config qwen3-8b --batch 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs

# (D, V) of real LM heads.
CONFIGS = {
    "qwen3-0.6b": (1024, 151936),
    "qwen3-8b": (4096, 151936),
    "llama3-70b": (8192, 128256),
}


def _median_us(f, *args, iters, inner=10):
  """Median per-call time over blocks of ``inner`` back-to-back async calls.

  Blocking on every call would add the host round trip to each sample.
  """
  jax.block_until_ready(f(*args))  # compile + warm up
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner)
  return statistics.median(times) * 1e6


def main(argv=None) -> int:
  dev = jax.devices()[0]
  on_gpu = dev.platform == "gpu"
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", choices=sorted(CONFIGS),
                  default="qwen3-8b" if on_gpu else "qwen3-0.6b")
  ap.add_argument("--batch", type=int, default=64 if on_gpu else 8)
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--backend", default="auto", choices=("auto", *fs.BACKENDS))
  ap.add_argument("--iters", type=int, default=20 if on_gpu else 2,
                  help="timed blocks of 10 calls")
  args = ap.parse_args(argv)

  d, v = CONFIGS[args.config]
  b = args.batch
  kh, kw, ks = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(kh, (b, d), jnp.bfloat16)
  weight = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / d**0.5)).astype(jnp.bfloat16)
  backend = fs.which_backend(hidden, weight, ks, backend=args.backend)
  print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
  print(f"LM head {args.config}: D={d} V={v} bf16 ({v * d * 2 / 1e9:.2f} GB), "
        f"B={b}, temperature={args.temperature}, backend={backend}")

  sample = jax.jit(lambda k, h, w: fs.sample(h, w, k, temperature=args.temperature,
                                             backend=backend))
  reference = jax.jit(lambda k, h, w: fs.reference.sample(
      h, w, k, temperature=args.temperature))

  # 1. Random inputs: agreement with the reference (rounding of a different
  #    summation order may flip a near-tie on a GPU; the contract is >= 99.9%).
  rows = per_row = 0
  for i in range(4):
    key = jax.random.fold_in(ks, i)
    keys = jax.random.split(key, b)
    for k in (key, keys):
      got, want = np.asarray(sample(k, hidden, weight)), np.asarray(reference(k, hidden, weight))
      rows += got.size
      per_row += int((got == want).sum())
  print(f"random inputs: {per_row}/{rows} rows identical to jax.random.categorical "
        f"({100 * per_row / rows:.2f}%)")

  # 2. Exact inputs (small integers, power-of-two temperature): 100% required.
  hx = jnp.round(hidden.astype(jnp.float32) * 2).astype(jnp.bfloat16)
  wx = jnp.round(weight.astype(jnp.float32) * (d**0.5)).astype(jnp.bfloat16)
  ex = jax.jit(lambda k, h, w: fs.sample(h, w, k, temperature=2.0, backend=backend))
  exr = jax.jit(lambda k, h, w: fs.reference.sample(h, w, k, temperature=2.0))
  got, want = np.asarray(ex(ks, hx, wx)), np.asarray(exr(ks, hx, wx))
  exact_ok = bool((got == want).all())
  print(f"exact inputs: {int((got == want).sum())}/{b} rows identical "
        f"({'PASS' if exact_ok else 'FAIL'})")
  print("tokens[:8]:", np.asarray(sample(ks, hidden, weight))[:8].tolist())

  # 3. Timing against the XLA baseline.
  baseline = jax.jit(lambda k, h, w: jax.random.categorical(
      k, jnp.dot(h, w.T, preferred_element_type=jnp.float32)))
  t_fused = _median_us(sample, ks, hidden, weight, iters=args.iters)
  t_base = _median_us(baseline, ks, hidden, weight, iters=args.iters)
  print(f"median time: {backend} {t_fused:,.0f} us | XLA dot + categorical "
        f"{t_base:,.0f} us | speedup {t_base / t_fused:.2f}x "
        f"(median of {args.iters} blocks of 10 async calls)")
  ok = exact_ok and per_row / rows >= 0.999
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
