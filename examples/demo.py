"""Demo: sample from an LM head of a real model's shape on whatever device is here.

The head's weights are random (no checkpoint is downloaded): only the shape is
the real model's. Samples a batch of tokens with ``flashsample_jax.sample``
(backend "auto"), checks them against the reference
(``flashsample_jax.reference.sample``: ``jax.random.categorical`` on the
materialized logits), prints them, and times the sampler against the plain
JAX way of doing the same thing: the f32 logits from ``lax.dot_general``,
divided by the temperature, then ``jax.random.categorical`` (``argmax`` at
temperature 0).

The fused kernels run on CUDA GPUs (``mosaic``: Hopper; ``triton``: sm80 and
later); elsewhere ``backend="auto"`` takes one of the package's XLA routes
(``dense`` or the streaming ``xla`` backend), so on a CPU the timing compares
two XLA programs and says nothing about the kernels. A backend named with
``--backend`` that cannot run here is refused in one line, with its reason.

  ./run demo                       # picks the config for this device
  ./run demo --config qwen3-8b --batch 64 --temperature 0.7
  ./run demo --backend xla         # the streaming backend, whatever auto would pick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import flashsample_jax as fs
from flashsample_jax import backends
from flashsample_jax.backends.xla import XlaBackend

# (D, V) of real LM heads, and "tiny" (no model's: a quick smoke run).
CONFIGS = {
    "tiny": (64, 1000),
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


def baseline_sampler(temperature: float):
  """The unfused sampler the fused one replaces, jitted: ``f(key, hidden, weight)``.

  The same math as the fused sampler and the reference: f32 logits of
  ``hidden [B, D]`` against ``weight [V, D]`` (contracting D in place, as
  ``lax.dot_general`` does without a transpose), divided by ``temperature``,
  then ``jax.random.categorical``; ``temperature == 0`` is the argmax.
  """
  def f(key, hidden, weight):
    logits = lax.dot_general(hidden, weight, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    if temperature == 0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)
  return jax.jit(f)


def _is_kernel(name: str) -> bool:
  """Whether backend ``name`` is a fused kernel (not one of the XLA routes,
  which materialize or stream the logits with XLA's own ops)."""
  return not isinstance(backends.get(name), XlaBackend)


def _can_run(name: str, hidden, weight, key) -> bool:
  try:
    fs.which_backend(hidden, weight, key, backend=name)
  except NotImplementedError:
    return False
  return True


def route_note(chosen: str, backend: str, kernels_here) -> str | None:
  """What the timing line means when ``backend`` (what ``--backend chosen``
  resolved to) is not a fused kernel; None when it is one.

  Args:
    chosen: the ``--backend`` argument ("auto" or a name).
    backend: the backend that ran.
    kernels_here: the fused kernels' names that can run this call here.
  """
  if _is_kernel(backend):
    return None
  tail = "the ratio compares two XLA programs and says nothing about the GPU kernels"
  if chosen != "auto":
    return f"(you chose {backend!r}, an XLA route, not a fused kernel: {tail})"
  if not kernels_here:
    return (f"(no fused kernel on this device: auto picked {backend!r}, an XLA route; "
            f"{tail})")
  return (f"(auto picked {backend!r}, an XLA route, over the fused kernels that can run "
          f"here ({', '.join(kernels_here)}): it measured faster for this call; {tail})")


def main(argv=None) -> int:
  dev = jax.devices()[0]
  on_gpu = dev.platform == "gpu"
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", choices=sorted(CONFIGS),
                  default="qwen3-8b" if on_gpu else "qwen3-0.6b")
  ap.add_argument("--batch", type=int, default=64 if on_gpu else 8)
  ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  ap.add_argument("--backend", default="auto", choices=("auto", *backends.BACKENDS))
  ap.add_argument("--iters", type=int, default=20 if on_gpu else 2,
                  help="timed blocks of 10 calls")
  args = ap.parse_args(argv)
  if args.batch < 1 or args.iters < 1:
    ap.error(f"--batch={args.batch} and --iters={args.iters} must be >= 1")
  if not args.temperature >= 0:  # also rejects NaN
    ap.error(f"--temperature={args.temperature} must be >= 0 (0 means greedy)")

  d, v = CONFIGS[args.config]
  b, temp = args.batch, args.temperature
  kh, kw, ks = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(kh, (b, d), jnp.bfloat16)
  weight = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / d**0.5)).astype(jnp.bfloat16)
  try:
    backend = fs.which_backend(hidden, weight, ks, backend=args.backend)
  except NotImplementedError as e:  # a named backend that this device cannot run
    print(f"demo.py: error: --backend {args.backend} cannot run here: {e}", file=sys.stderr)
    return 2
  print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
  print(f"LM head: RANDOM weights in {args.config}'s shape (D={d}, V={v}, bf16, "
        f"{v * d * 2 / 1e9:.2f} GB); B={b}, temperature={temp}, backend={backend}")

  sample = jax.jit(lambda k, h, w: fs.sample(h, w, k, temperature=temp, backend=backend))
  reference = jax.jit(lambda k, h, w: fs.reference.sample(h, w, k, temperature=temp))

  # 1. Random inputs: agreement with the reference (rounding of a different
  #    summation order may flip a near-tie on a GPU; the contract is >= 99.9%).
  rows = same = 0
  for i in range(4):
    key = jax.random.fold_in(ks, i)
    for k in (key, jax.random.split(key, b)):
      got, want = np.asarray(sample(k, hidden, weight)), np.asarray(reference(k, hidden, weight))
      rows += got.size
      same += int((got == want).sum())
  print(f"random inputs: {same}/{rows} rows identical to fs.reference.sample "
        f"({100 * same / rows:.2f}%)")

  # 2. Exact inputs (small integers: every logit exact in f32): 100% required.
  hx = jnp.round(hidden.astype(jnp.float32) * 2).astype(jnp.bfloat16)
  wx = jnp.round(weight.astype(jnp.float32) * (d**0.5)).astype(jnp.bfloat16)
  got, want = np.asarray(sample(ks, hx, wx)), np.asarray(reference(ks, hx, wx))
  exact_ok = bool((got == want).all())
  print(f"exact inputs: {int((got == want).sum())}/{b} rows identical "
        f"({'PASS' if exact_ok else 'FAIL'})")
  print("tokens[:8]:", np.asarray(sample(ks, hidden, weight))[:8].tolist())

  # 3. Timing against the same sampling done unfused.
  t_fused = _median_us(sample, ks, hidden, weight, iters=args.iters)
  t_base = _median_us(baseline_sampler(temp), ks, hidden, weight, iters=args.iters)
  print(f"median us per call ({args.iters} blocks of 10): fs.sample[{backend}] "
        f"{t_fused:,.0f} | dot_general + categorical {t_base:,.0f} | "
        f"time ratio fs.sample / that {t_fused / t_base:.2f}")
  note = route_note(args.backend, backend, [
      n for n in backends.BACKENDS if _is_kernel(n) and _can_run(n, hidden, weight, ks)])
  if note:
    print(note)
  ok = exact_ok and same / rows >= 0.999
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
