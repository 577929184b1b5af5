"""What the ``lax.cond`` around the exact fallback costs on a GPU.

    python3 -m benchmarks.experiments.exp_cond [B]             # variants
    python3 -m benchmarks.experiments.exp_cond B --finish      # cond vs none
    python3 -m benchmarks.experiments.exp_cond B [B ...] --finish --quick  # cond, plain
    TAG=_x python3 -m benchmarks.experiments.exp_cond B --profile [--plain|--barrier]

``CTL=top_logprobs20`` (environment) runs ``top_logprobs=20`` where the
default runs top-k 50 + top-p 0.9 (``--finish``, ``--profile``).

The exact fallback of the controls path sits behind a ``lax.cond`` whose
predicate is computed on the device. XLA keeps a conditional in its CUDA
graph (command buffer) only if every op of its branches can live in one;
else it copies the predicate to the host on every call and launches nothing
after it until the copy lands.

* default: the plain fused sampler followed by a conditional whose
  (never-taken) branch holds one kind of op each (dot, sort, top_k, cumsum,
  threefry), and the top-k + top-p call. Which conditionals stay in the
  graph: run with ``XLA_FLAGS=--xla_dump_to=DIR`` and read
  ``DIR/*thunk_sequence_after_thunk_passes.txt`` (a ``kConditional`` nested
  under ``kCommandBuffer`` is on the device).
* ``--finish``: top-k + top-p as is, and with the conditional replaced by
  its false branch with the predicate kept alive (an optimization barrier),
  and plain sampling.
* ``--profile``: GPU kernels and host events of two calls from a JAX
  profiler trace, written to ``$OUT/profile_B<B><TAG>.txt``.

Medians in us, one JSON line per variant.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax


import flashsample_jax as fs
from benchmarks import _timing


def _controls():
  """The controls under test (``CTL``): top-k + top-p, or top-N logprobs."""
  if os.environ.get("CTL") == "top_logprobs20":
    return dict(top_logprobs=20)
  return dict(top_k=50, top_p=0.9)


def _barrier_cond(pred, true_fun, false_fun, *operands):
  """Experiment only: the false branch, with the predicate kept alive."""
  pred, out = lax.optimization_barrier((pred, false_fun(*operands)))
  return out


def finish_variants(b, h, w, key):
  """The top-k + top-p call as is, and with its conditional replaced by the
  false branch (the predicate still computed): their difference is what the
  conditional costs beyond the work that decides it."""
  rows = {}
  for name in ("cond",) if "--quick" in sys.argv else ("cond", "barrier"):
    cond = lax.cond
    jax.clear_caches()   # the inner jit would reuse its trace with the cond
    if name == "barrier":
      lax.cond = _barrier_cond
    try:
      f = jax.jit(lambda h, w, key: fs.sample(h, w, key, **_controls()))
      f.lower(h, w, key).compile()
      rows[name] = round(_timing.median_us(f, h, w, key, reps=15, inner=50)[0], 1)
    finally:
      lax.cond = cond
  plain = jax.jit(lambda h, w, key: fs.sample(h, w, key))
  rows["plain"] = round(_timing.median_us(plain, h, w, key, reps=15, inner=50)[0], 1)
  print(json.dumps({"B": b, "controls": _controls(), **rows}), flush=True)


def profile(h, w, key, out_dir):
  """GPU kernels of the last two of five calls, from a JAX profiler trace:
  start (us, from the first listed kernel), duration (us) and name, plus
  the GPU's idle time in that window (launch gaps, host waits)."""
  ctl = {} if "--plain" in sys.argv else _controls()
  if "--barrier" in sys.argv:
    lax.cond = _barrier_cond
  f = jax.jit(lambda h, w, key: fs.sample(h, w, key, **ctl))
  events, host = _timing.trace_events(f, h, w, key, calls=5)
  events = [e[:3] for e in events]
  if not events:
    print("no GPU stream events")
    return
  # The call's main kernel (not the exact path's early-exit launches).
  mains = [i for i, e in enumerate(events) if "flashsample" in e[2]
           and not any(x in e[2] for x in ("tempered_rows", "exact_top"))]
  events = events[mains[-2] - 3:] if len(mains) >= 2 else events
  t0 = events[0][0]
  busy = sum(d for _, d, _ in events)
  lines = [f"{(s - t0) / 1e3:9.1f} {d / 1e3:8.1f}  {n[:90]}" for s, d, n in events]
  span = (events[-1][0] + events[-1][1] - t0) / 1e3
  lines.append(f"window {span:.1f} us, kernels busy {busy / 1e3:.1f} us, "
               f"{len(events)} kernels")
  t_end = events[-1][0] + events[-1][1]
  host = [e for e in host if e[1] > 2000 and t0 - 400_000 <= e[0] <= t_end]
  lines.append("host events over 2 us (start from the first kernel, duration, thread, name):")
  lines += [f"{(s - t0) / 1e3:9.1f} {d / 1e3:8.1f}  {ln[:20]:20s} {n[:90]}"
            for s, d, ln, n in host]
  text = "\n".join(lines)
  print(text, flush=True)
  with open(os.path.join(out_dir, "profile_B%d%s.txt" % (h.shape[0], os.environ.get("TAG", ""))), "w") as fh:
    fh.write(text + "\n")


def _inputs(b):
  d, v = (256, 4096) if "--small" in sys.argv else (4096, 151936)
  kw, kh, kx = jax.random.split(jax.random.key(0), 3)
  w = (jax.random.normal(kw, (v, d), jnp.float32) * (3.0 / d**0.5)).astype(jnp.bfloat16)
  h = jax.random.normal(kh, (b, d), jnp.bfloat16)
  x = jax.random.normal(kx, (b, v), jnp.float32)
  return h, w, x, jax.random.key(1)


def main():
  batches = [int(x) for x in sys.argv[1:] if x.isdigit()] or [64]
  if "--finish" in sys.argv:
    for b in batches:
      h, w, _, key = _inputs(b)
      finish_variants(b, h, w, key)
    return
  b = batches[0]
  h, w, x, key = _inputs(b)
  if "--dump" in sys.argv and "--profile" in sys.argv:   # the HLO the profile ran
    full = jax.jit(lambda h, w, key: fs.sample(h, w, key, top_k=50, top_p=0.9))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "topk_topp_B%d.hlo.txt" % b), "w") as fh:
      fh.write(full.lower(h, w, key).compile().as_text())
  if "--profile" in sys.argv:
    return profile(h, w, key, os.environ.get("OUT", "/tmp"))

  def with_branch(branch):
    def f(h, w, key, x):
      tok = fs.sample(h, w, key)
      if branch is None:
        return tok
      return lax.cond(jnp.any(tok < 0), lambda: branch(h, w, x, tok), lambda: tok)
    return jax.jit(f)

  branches = {
      "no_cond": None,
      "elementwise": lambda h, w, x, tok: tok + 1,
      "dot": lambda h, w, x, tok: jnp.argmax(
          jnp.dot(h, w.T, preferred_element_type=jnp.float32), axis=1).astype(jnp.int32),
      "sort": lambda h, w, x, tok: jnp.argsort(-x, axis=1)[:, 0].astype(jnp.int32),
      "top_k": lambda h, w, x, tok: lax.top_k(x, 64)[1][:, 0],
      "cumsum": lambda h, w, x, tok: jnp.argmax(jnp.cumsum(x, axis=1), axis=1).astype(jnp.int32),
      "threefry": lambda h, w, x, tok: jax.random.categorical(key, x).astype(jnp.int32),
  }
  print(json.dumps({"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "B": b,
                    "device": _timing.device_name()}), flush=True)
  for name, branch in branches.items():
    f = with_branch(branch)
    us = _timing.median_us(f, h, w, key, x, reps=15)[0]
    print(json.dumps({"variant": name, "us": round(us, 1)}), flush=True)
  full = jax.jit(lambda h, w, key: fs.sample(h, w, key, top_k=50, top_p=0.9))
  us = _timing.median_us(full, h, w, key, reps=15)[0]
  print(json.dumps({"variant": "top_k50_top_p0.9", "us": round(us, 1)}), flush=True)
  if "--dump" in sys.argv:   # the optimized HLO of the top-k + top-p call
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "topk_topp_optimized.hlo.txt"), "w") as fh:
      fh.write(full.lower(h, w, key).compile().as_text())


if __name__ == "__main__":
  main()
