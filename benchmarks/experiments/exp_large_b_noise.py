"""What the Gumbel noise costs the mosaic kernel at large B (#41).

  python3 -m benchmarks.experiments.exp_large_b_noise [--heads S L]
      [--batches 256 512] [--rounds 2] [--variants base no_logs no_noise]
      [--variants base no_noise no_noise@d64_p4_f1]

From B = 256 the plain kernel runs at the GPU's power cap
(docs/performance.md, "Large batches: what bounds the kernel"), where what
pays is energy per call. Variants (``base``: the shipped kernel):

* ``no_logs``: the noise's two logarithms left out (``g = u``): the
  threefry bits stay. Wrong tokens; it measures what the logs cost.
* ``no_noise``: no noise at all (``g = 0``; the threefry work is then dead
  code). Wrong tokens; the kernel's matmul, transform and argmax alone.

A variant may name a blocked config after ``@`` (``exp_blocks``'
:func:`~benchmarks.experiments.exp_blocks.variant_config` names, e.g.
``no_noise@d64_p4_f1``): the same ablation on that schedule, so the matmul's
time without noise is measured per ring depth and wgmma overlap.

Variants are timed in alternating rounds (docs/performance.md, "Measuring at
the power cap"): per round each variant's wall time per call (blocks of 20),
then its kernel's own time from a profiler trace. The cuBLAS dot alone and
XLA's dot + categorical are timed once per point beside them.

``--sustain SECONDS`` runs each variant (and the dot, and XLA's way) back to
back for that long instead, with ``nvidia-smi`` sampling the SM clock and the
board's power every 100 ms: whether a variant runs at the power cap, and at
what clock.
``--once`` compiles each variant and calls it three times more, nothing
else (for Nsight Compute: ``--launch-skip 2 --launch-count 1`` per variant).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks._timing import device_name, median_us
from benchmarks.experiments.exp_blocks import variant_config
from benchmarks.experiments.exp_small_b_kernel import kernel_us
from flashsample_jax.backends.mosaic import MosaicBackend
from pallas_kernels import threefry

ABLATIONS = {
    "no_logs": lambda k0, k1, hi, lo, log=None: threefry.uniform_from_bits(
        threefry.random_bits(k0, k1, hi, lo)),
    "no_noise": lambda k0, k1, hi, lo, log=None: jnp.zeros(jnp.broadcast_shapes(
        jnp.shape(k0), jnp.shape(hi), jnp.shape(lo)), jnp.float32),
}


@contextlib.contextmanager
def tracing(variant: str):
  """While an ablation traces, the kernels' ``threefry.gumbel`` is its stand-in."""
  keep = threefry.gumbel
  threefry.gumbel = ABLATIONS.get(variant, keep)
  try:
    yield
  finally:
    threefry.gumbel = keep


def split_variant(name: str) -> tuple[str, str | None]:
  """``"no_noise@d64_p4_f1"`` -> ``("no_noise", "d64_p4_f1")``; no ``@``: the
  heuristic's config (None)."""
  ablation, _, config = name.partition("@")
  if ablation != "base" and ablation not in ABLATIONS:
    raise ValueError(f"unknown ablation {ablation!r} in {name!r}")
  return ablation, config or None


def backend(variant: str, interpret: bool = False, *, config=None) -> MosaicBackend:
  """A mosaic backend of a class of its own per variant: ``fs.sample``'s inner
  jit keys its traces on the backend, and equal backends would share one.
  ``config``: a TuningConfig for every launch (None: the heuristic's)."""
  label = "".join(c for c in variant.title() if c.isalnum())
  kind = type(f"{label}Backend", (MosaicBackend,), {})
  return kind(config=config, interpret=True if interpret else None)


def compiled(variant: str, h, w, key, *, interpret: bool = False):
  """Plain sampling at temperature 0.7 on ``variant``'s kernel, compiled;
  None where its named config does not apply to this problem."""
  ablation, config = split_variant(variant)
  cfg = None
  if config is not None:
    b, d = h.shape
    cfg = variant_config(config, b, d, w.shape[0])
    if cfg is None:
      return None
  be = backend(variant, interpret, config=cfg)
  f = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=0.7, backend=be))
  with tracing(ablation):
    jax.block_until_ready(f(h, w, key))
  return f


def xla_ways(h, w, key):
  """``{"dot": ..., "xla": ...}``: the cuBLAS dot alone and XLA's dot +
  ``jax.random.categorical``, compiled."""
  dot = jax.jit(lambda h, w, k: jnp.dot(h, w.T, preferred_element_type=jnp.float32))
  xla = jax.jit(lambda h, w, k: jax.random.categorical(
      k, jnp.dot(h, w.T, preferred_element_type=jnp.float32) / 0.7))
  return {"dot": dot, "xla": xla}


def _smi_samples(path: str) -> list[tuple[float, float, float]]:
  """``(epoch seconds, SM MHz, W)`` of each line nvidia-smi wrote to ``path``
  (its timestamps are local time)."""
  out = []
  with open(path) as f:
    for line in f:
      parts = [p.strip() for p in line.split(",")]
      try:
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
        out.append((t.timestamp(), float(parts[1]), float(parts[2])))
      except (ValueError, IndexError):
        continue
  return out


def sustained(fns: dict, h, w, key, seconds: float) -> list[dict]:
  """Each of ``fns`` called back to back for ``seconds`` (after 0.5 s of
  warm-up), one after the other with a second's pause: its us per call and
  the median SM clock and power nvidia-smi read meanwhile."""
  log = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
  smi = subprocess.Popen(
      ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
       "--format=csv,noheader,nounits", "-lms", "100"],
      stdout=log, stderr=subprocess.DEVNULL)
  windows = []
  try:
    for name, f in fns.items():
      jax.block_until_ready(f(h, w, key))
      t_warm = time.time() + 0.5
      while time.time() < t_warm:
        jax.block_until_ready(f(h, w, key))
      t0, n = time.time(), 0
      while time.time() - t0 < seconds:
        for _ in range(20):
          out = f(h, w, key)
        jax.block_until_ready(out)
        n += 20
      t1 = time.time()
      windows.append((name, t0, t1, (t1 - t0) / n * 1e6))
      time.sleep(1.0)
  finally:
    smi.terminate()
    smi.wait()
    log.close()
  samples = _smi_samples(log.name)
  os.remove(log.name)
  recs = []
  for name, t0, t1, us in windows:
    inside = [(mhz, watts) for t, mhz, watts in samples if t0 <= t <= t1]
    recs.append(dict(variant=name, us_per_call=round(us, 1), samples=len(inside),
                     sm_mhz=statistics.median(m for m, _ in inside) if inside else None,
                     watts=round(statistics.median(p for _, p in inside), 1)
                     if inside else None))
  return recs


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", nargs="+", default=["S", "L"], choices=sorted(shapes.HEADS))
  ap.add_argument("--batches", type=int, nargs="+", default=[256, 512])
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--variants", nargs="+", default=["base", "no_logs", "no_noise"])
  ap.add_argument("--sustain", type=float, default=None,
                  help="seconds of back-to-back calls per variant, with power and clocks")
  ap.add_argument("--once", action="store_true",
                  help="only compile and call each variant three times (Nsight Compute)")
  args = ap.parse_args()
  print(json.dumps(dict(gpu=device_name(), jax=jax.__version__)), flush=True)
  key = jax.random.key(0)
  for head in args.heads:
    d, v = shapes.HEADS[head]
    w = shapes.random_head(head, 1.3)
    for b in args.batches:
      h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
      if args.once:
        for name in args.variants:
          f = compiled(name, h, w, key)
          if f is None:  # its config does not apply here
            continue
          for _ in range(3):
            jax.block_until_ready(f(h, w, key))
          print(json.dumps(dict(head=head, B=b, ran=name)), flush=True)
        continue
      fns = {name: compiled(name, h, w, key) for name in args.variants}
      fns = {name: f for name, f in fns.items() if f is not None}
      toks = {name: f(h, w, key) for name, f in fns.items()}
      first = next(iter(fns))
      rec = dict(head=head, B=b, tokens_equal_first={
          n: float(jnp.mean(toks[first] == t)) for n, t in toks.items()})
      ways = xla_ways(h, w, key)
      for name, f in ways.items():
        rec[f"{name}_wall"] = round(median_us(f, h, w, key, reps=7, inner=20)[0], 1)
      print(json.dumps(rec), flush=True)
      if args.sustain:
        fns.update(ways)  # the dot alone and XLA's way, at the cap too
        for rec in sustained(fns, h, w, key, args.sustain):
          print(json.dumps(dict(head=head, B=b, sustain_s=args.sustain, **rec)), flush=True)
        continue
      for r in range(args.rounds):
        rec = dict(head=head, B=b, round=r)
        for name, f in fns.items():
          rec[f"{name}_wall"] = round(median_us(f, h, w, key, reps=7, inner=20)[0], 1)
          rec[f"{name}_kernel"] = round(kernel_us(f, h, w, key, calls=10), 1)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
