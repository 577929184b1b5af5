"""Where the dense route's wall time goes, part by part (issue #40: top-k +
top-p with an 8-bit head <= 1.2x plain at B <= 16).

  python3 -m benchmarks.experiments.exp_dense_parts [--heads S L]
      [--batches 1 16 64] [--weight-dtypes fp8] [--rounds 3] [--timeline]
      [--flagged N] [--variants NAME ...]

A profiler trace gives each kernel's device time but slows the host enough
that gaps between kernels show which a pipelined run never waits for
(docs/performance.md, "Small batches"); this times, by wall clock in
alternating rounds in one process (``_timing.timed_rounds``), the route cut
after each part, top-k 50 + top-p 0.9 on the dense route with the list
kernels (``DenseBackend()``: the list kernels on a GPU with jax-triton):

* ``dot``: XLA's GEMM as the route runs it (``problem.logits``; hidden
  states padded to ``MIN_GEMM_ROWS_8BIT`` rows for an 8-bit head);
* ``pass``: the route's pass (the GEMM and the list kernels), its state;
* ``no_conditional``: the whole call traced without stage 2's exact path
  (``stage2._exact_path`` as the identity): no conditional. Not exact where
  a row would take that path (the JSON line says how many do: 0 on the
  benchmark's logits), so for timing only;
* ``output_after``: the whole call with the output assembled after the
  conditional (the layout before ``stage2._redo_flagged``'s ``then`` made
  the conditional the call's last step);
* ``row_operands``: the whole call with the exact path's branches taking
  the controls given as numbers, the temperature and the noise counters as
  operands (before ``problem.in_branch`` / ``controls.in_branch`` made them
  in the branch);
* ``two_branches_16``, ``two_branches_64``: the whole call with the exact
  path's two-way conditional (every row redone when one is flagged) up to
  16 / 64 rows, the nested one past them (each left out where its program
  is the call's; the three-way switch they were measured against before is
  gone, docs/performance.md, "The exact path's conditional");
* ``copied_hidden``: the whole call with the exact path's branches reading
  a copy of ``hidden`` made before the conditional, not the call's input;
* ``dense``: the whole call;
* ``plain``: ``fs.sample`` through ``auto`` without controls (the bar's
  denominator).

``--flagged N`` zeroes the first N hidden rows: their logits are all equal,
which no candidate list certifies, so every call takes the exact path (what
a call costs when the conditional's branch runs).

The differences are what each part costs a pipelined caller, gaps and
launches included. One JSON line per (head, dtype, B) with the exact-path
rows and, per variant, the fraction of 8 keys whose tokens equal
``dense``'s, then one per round. With ``--timeline``: the device timelines
of the whole calls instead of the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks._fallback import exact_path_rows
from benchmarks.bench_controls import TOP_K, TOP_P
from benchmarks.experiments._points import add_point_args, points, report, stage2_with
from flashsample_jax import controls, problem, stage2
from flashsample_jax.backends import xla as xla_backend

DENSE = xla_backend.DenseBackend()
TRUNC = dict(top_k=TOP_K, top_p=TOP_P)


def _no_exact_path(p, c, rows, axis, *, then=None):
  """``stage2._exact_path`` left out (its rows kept as they are)."""
  del p, c, axis
  return then(rows) if then else rows


def _output_after(p, c, rows, axis, *, then=None):
  """``stage2._exact_path`` with the output assembled after the conditional
  (the layout before the conditional became the call's last step)."""
  rows = EXACT_PATH(p, c, rows, axis)
  return then(rows) if then else rows


EXACT_PATH = stage2._exact_path  # pylint: disable=protected-access


def _keyed_only(p):
  """``problem.in_branch`` as before it made the counters and a uniform
  temperature in the branch: only the key words."""
  def rebuild():
    k0, k1 = problem.key_words(p.key_data, p.batch)
    return dataclasses.replace(p, k0=k0, k1=k1)
  return rebuild


IN_BRANCH = problem.in_branch


def _copied_hidden(p):
  """``problem.in_branch`` with the branch reading a copy of ``hidden`` made
  before the conditional (a product with a 1 the compiler cannot see), not
  the call's input (docs/performance.md, "Where that host time goes")."""
  one = jnp.where(p.temperature[0] >= 0, 1, 2).astype(p.hidden.dtype)
  return IN_BRANCH(dataclasses.replace(p, hidden=p.hidden * one))


# name -> the attributes patched while the call is traced (stage 2's, or
# "module.name" of problem / controls; none: the call as it is).
VARIANTS = {"no_conditional": {"_exact_path": _no_exact_path},
            "output_after": {"_exact_path": _output_after},
            # The conditional taking every per-row array as an operand.
            "row_operands": {"problem.in_branch": _keyed_only,
                             "controls.in_branch": lambda c: lambda: c},
            # The two-way conditional up to 16 / 64 rows (every row redone
            # when one is flagged).
            "two_branches_16": {"EXACT_COND_ROWS": 16},
            # The branches reading a copy of hidden, not the input.
            "copied_hidden": {"problem.in_branch": _copied_hidden},
            "two_branches_64": {"EXACT_COND_ROWS": 64},
            "dense": {}}


def _gemm(scale):
  """The route's GEMM alone (``problem.logits``), an 8-bit head's hidden
  states padded as ``xla._gemm_rows`` pads them on a GPU."""
  def f(h, w):
    rows = h.shape[0]
    if scale is not None and jax.default_backend() == "gpu":
      h = jnp.pad(h, ((0, max(rows, xla_backend.MIN_GEMM_ROWS_8BIT) - rows), (0, 0)))
    return problem.logits(h, w, "vd", scale)[:rows]
  return f


def _pass(key, scale):
  """The route's pass over the head (GEMM and lists), its state's leaves."""
  def f(h, w):
    p = problem.prepare(h, w, key, temperature=1.0, weight_scale=scale)
    c = controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size, rows=p.weight_rows,
                                  **TRUNC)
    return jax.tree_util.tree_leaves(DENSE.controls_state(p, c.for_pass()))
  return f


def _call(scale):
  """A new function object for the dense call of ``(h, w, key)``: ``jax.jit``
  of one function reuses its first trace, which would answer for the other
  variant."""
  return lambda h, w, k: fs.sample(h, w, k, backend=DENSE, weight_scale=scale, **TRUNC)


def _compiled(scale, h, w, key):
  """name -> the dense call of ``(h, w, key)`` compiled as that variant
  (:data:`VARIANTS`), those whose program is the call's or an earlier
  variant's left out (two_branches_16 up to EXACT_COND_ROWS rows,
  two_branches_64 up to 16 rows and past 64)."""
  out = {}
  for name, patch in VARIANTS.items():
    with stage2_with(patch):
      out[name] = jax.jit(_call(scale)).lower(h, w, key).compile()
  kept, texts = {"dense": out["dense"]}, {out["dense"].as_text()}
  for name, f in out.items():
    if f.as_text() not in texts:
      kept[name] = f
      texts.add(f.as_text())
  return kept


def _variants(key, scale, compiled):
  """name -> function of ``(h, w)``; ``compiled``: :func:`_compiled`'s."""
  calls = {name: functools.partial(lambda f, h, w: f(h, w, key), f)
           for name, f in compiled.items()}
  return {"dot": jax.jit(_gemm(scale)), "pass": jax.jit(_pass(key, scale)), **calls,
          "plain": jax.jit(lambda h, w: fs.sample(h, w, key, weight_scale=scale))}


def _same_tokens(h, w, compiled) -> dict:
  """Per variant, the fraction of 8 keys whose tokens equal the call's
  (1.0 where no row takes the exact path)."""
  keys = jax.random.split(jax.random.key(1), 8)
  full = compiled["dense"]
  return {name: float(np.mean([np.array_equal(f(h, w, k), full(h, w, k)) for k in keys]))
          for name, f in compiled.items() if name != "dense"}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_point_args(ap, heads=["S", "L"], batches=[1, 16, 64], weight_dtypes=["fp8"], rounds=3)
  ap.add_argument("--variants", nargs="+", default=None,
                  help="only these (default: every variant, dot, pass and plain)")
  ap.add_argument("--flagged", type=int, default=0,
                  help="hidden rows zeroed (each takes the exact path)")
  args = ap.parse_args(argv)
  key = jax.random.key(0)
  for w, scale, h, tags in points(args):
    if args.flagged:
      h = h.at[:args.flagged].set(0)
      tags = dict(tags, flagged=args.flagged)
    compiled = _compiled(scale, h, w, key)
    rows = exact_path_rows(h, w, key, backend=DENSE, weight_scale=scale, **TRUNC)
    print(json.dumps(dict(tags, exact_rows=rows, same_tokens=_same_tokens(h, w, compiled))),
          flush=True)
    variants = _variants(key, scale, compiled)
    if args.variants:
      variants = {name: f for name, f in variants.items() if name in args.variants}
    report(args, variants, h, w, tags, traced=tuple(n for n in compiled if n in variants))


if __name__ == "__main__":
  main()
