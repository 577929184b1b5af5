"""What a conditional inside XLA's CUDA graph costs the host per call, and
which buffers make XLA update the graph (docs/performance.md, "The exact
path's conditional").

  python3 -m benchmarks.experiments.exp_graph_update [--rows 16] [--steps 40]

XLA keeps a ``lax.cond`` inside its command buffer (a CUDA graph) and, on
every call where a buffer that the graph's commands use has moved (a new
input, new outputs), updates the graph before launching it. A toy program
stands in for the exact path: a branch of ``--steps`` reduce-and-broadcast
steps (two kernels each), never taken, between three steps before and three
after it (so that XLA's graph holds the conditional). Variants:

* ``plain``: the same steps without the conditional (the branch's steps run);
* ``cond_reads_temp``: the branch reads the first steps' result, and the
  last steps write the output: no buffer the branch uses is an input or
  an output;
* ``cond_reads_input``: the branch reads the call's input;
* ``cond_reads_fixed_input``: the branch reads the first steps' result and
  an input passed unchanged on every call (as a weight is);
* ``cond_loop_reads_temp``: as ``cond_reads_temp`` with the branch's steps
  one ``fori_loop`` (a WHILE node of one step's kernels in the graph, if XLA
  keeps it there) instead of ``--steps`` unrolled steps.

If XLA re-recorded only the commands whose buffers moved, the first would
cost the host less than the second.
Each is called with a new input array every call (a decode loop's new hidden
states) and with the same one. Prints one JSON line per variant and input
mode: wall us per call and the host events of the graph's update and launch
per call (``command_buffer::update``, ``cuGraphLaunch``), and the device's
timeline (busy and idle us per call, the last call's kernels with the gap
before each).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks._timing import device_name, median_us
from benchmarks.experiments._points import host_events
from benchmarks.experiments.exp_small_b_timeline import timeline


def _steps(x, steps: int):
  """``steps`` reductions, each broadcast back: two kernels a step."""
  for i in range(steps):
    x = x * 0.5 + jnp.max(x, axis=1, keepdims=True) * (1.0 / (i + 2))
  return x


def _step(i, x):
  """One of ``_steps``' steps with a traced ``i``, for a loop's body."""
  return x * 0.5 + jnp.max(x, axis=1, keepdims=True) * (1.0 / (i + 2).astype(x.dtype))


def _programs(steps: int):
  around = lambda x: _steps(x, 3)
  branch = lambda y: _steps(y, steps)

  def plain(x, go, z):
    return around(branch(around(x)))

  def cond_reads_temp(x, go, z):
    return around(jax.lax.cond(go[0] > 0, branch, lambda y: y, around(x)))

  def cond_reads_input(x, go, z):
    return around(jax.lax.cond(go[0] > 0, branch, lambda y: y, x) + around(x))

  def cond_reads_fixed_input(x, go, z):
    # z: an input passed unchanged on every call (as a weight is)
    return around(jax.lax.cond(go[0] > 0, lambda y: branch(y) + z, lambda y: y, around(x)))
  def cond_loop_reads_temp(x, go, z):
    loop = lambda y: jax.lax.fori_loop(0, steps, _step, y)
    return around(jax.lax.cond(go[0] > 0, loop, lambda y: y, around(x)))
  return {f.__name__: jax.jit(f)
          for f in (plain, cond_reads_temp, cond_reads_input, cond_reads_fixed_input,
                    cond_loop_reads_temp)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--cols", type=int, default=151936)
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--variants", nargs="*", default=None,
                  help="the variants to run (default: all)")
  args = ap.parse_args(argv)
  xs = [jax.random.normal(jax.random.key(i), (args.rows, args.cols)) for i in range(4)]
  go = jnp.asarray([0.0])                            # the branch is never taken
  z = jax.random.normal(jax.random.key(9), (args.rows, args.cols))
  for name, f in _programs(args.steps).items():
    if args.variants and name not in args.variants:
      continue
    for mode in ("same_input", "new_input"):
      calls = iter(range(10**9))
      pick = ((lambda: xs[0]) if mode == "same_input"
              else (lambda: xs[next(calls) % len(xs)]))
      g = lambda _x, _go, f=f, pick=pick: f(pick(), _go, z)
      ev = host_events(g, xs[0], go, calls=20)["events"]
      graph = {k: v for k, v in ev.items()
               if k.startswith(("command_buffer::", "cuGraphLaunch"))}
      t = timeline(g, xs[0], go, calls=20)
      print(json.dumps(dict(gpu=device_name(), jax=jax.__version__, rows=args.rows,
                            steps=args.steps, variant=name, mode=mode,
                            wall_us=round(median_us(g, xs[0], go, reps=7, inner=20)[0], 1),
                            graph_host=graph,
                            **{k: t[k] for k in ("period_us", "busy_us", "idle_us",
                                                 "kernels_per_call", "last_call")})),
            flush=True)


if __name__ == "__main__":
  main()
