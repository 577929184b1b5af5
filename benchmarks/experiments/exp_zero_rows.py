"""What a batch padded with zero hidden rows costs with top-k + top-p
(docs/design.md, "Rows of equal logits"; docs/performance.md, "The exact
path's conditional").

  python3 -m benchmarks.experiments.exp_zero_rows [--heads S L]
      [--batches 16 64] [--weight-dtypes bf16 fp8] [--rounds 3] [--zero N]
      [--enqueue] [--variants NAME ...]

A zero hidden row's logits all tie, so no candidate list holds its kept set
(every id), and it took the exact path on every call. Where the pass draws
noise (a rule given per row, as a serving loop passes its requests'
settings) stage 2 now takes its token off the pass; where it draws none
(top-k and top-p given as numbers) its sampled zero rows still take the
exact path. Variants, timed in alternating rounds in one process
(``_timing.timed_rounds``), each a compiled call of ``auto`` with top-k 50
+ top-p 0.9:

* ``per_row``: the rules as ``[B]`` arrays (the pass draws noise), no zero row;
* ``per_row_zero``: the same with the first ``--zero`` rows zeroed;
* ``per_row_zero_greedy``: the zero rows at temperature 0 (greedy rows
  skip truncation; the README's advice before);
* ``numbers``, ``numbers_zero``: the rules as numbers (no noise in the
  pass), without and with the zero rows;
* ``..._before``: each traced as before (``stage2._flat_rows`` finding no
  row: the exact path on every call with a zero row);
* ``plain``: ``fs.sample`` without controls.

One JSON line per (head, dtype, B) with each variant's exact-path rows and
whether its tokens equal its ``_before``'s on 8 keys, then one per round
(``--enqueue``: and one per round of each variant's host time per call).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from benchmarks.bench_controls import TOP_K, TOP_P
from benchmarks.experiments._points import add_point_args, points, report, stage2_with
from flashsample_jax import api, backends, controls, problem, stage2

# Stage 2 as before zero rows were decided on the pass.
_BEFORE = {"_flat_rows": lambda p, c, st: jnp.zeros((p.batch,), bool)}


def _inputs(h, zero: int):
  """name -> ``(hidden, temperature, rules)`` of each variant."""
  b = h.shape[0]
  hz = h.at[:zero].set(0)
  per_row = dict(top_k=jnp.full((b,), TOP_K, jnp.int32),
                 top_p=jnp.full((b,), TOP_P, jnp.float32))
  numbers = dict(top_k=TOP_K, top_p=TOP_P)
  one, greedy = jnp.ones((b,), jnp.float32), jnp.ones((b,), jnp.float32).at[:zero].set(0)
  base = {"per_row": (h, one, per_row), "per_row_zero": (hz, one, per_row),
          "numbers": (h, one, numbers), "numbers_zero": (hz, one, numbers)}
  return {**base, **{f"{name}_before": x for name, x in base.items()},
          "per_row_zero_greedy": (hz, greedy, per_row)}


def _split(rules):
  """``(arrays, numbers)``: the rules given per row (traced arguments of a
  call: the pass then draws noise) and those given as numbers."""
  arrays = {k: v for k, v in rules.items() if isinstance(v, jax.Array)}
  return arrays, {k: v for k, v in rules.items() if k not in arrays}


def _compiled(name, w, scale, key, hidden, temperature, rules):
  """The variant's call, compiled, as a function of ``key``."""
  arrays, numbers = _split(rules)

  def call(h, w, k, t, arrays):
    return fs.sample(h, w, k, temperature=t, weight_scale=scale, **arrays, **numbers)

  with stage2_with(_BEFORE if name.endswith("_before") else {}):
    f = jax.jit(call).lower(hidden, w, key, temperature, arrays).compile()
  return lambda k: f(hidden, w, k, temperature, arrays)


def _exact_rows(w, scale, key, hidden, temperature, rules, before: bool) -> int:
  """Rows of the call that take the exact path (un-timed; traced as the
  call is)."""
  arrays, numbers = _split(rules)

  def flagged(h, w, k, t, arrays):
    p = problem.prepare(h, w, k, temperature=t, weight_scale=scale)
    c = controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size,
                                  rows=p.weight_rows, **arrays, **numbers)
    impl = backends.resolve("auto", p, c)
    st = stage2.per_sample(api.pass_state(p, c.for_pass(), impl, 0), c.samples)
    return stage2.finish(p, c, st, exact_top=impl.exact_top(p, c))[2]

  with stage2_with(_BEFORE if before else {}):
    return int(np.asarray(jax.jit(flagged)(hidden, w, key, temperature, arrays)).sum())


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_point_args(ap, heads=["S"], batches=[16, 64], weight_dtypes=["bf16", "fp8"], rounds=3)
  ap.add_argument("--zero", type=int, default=1, help="hidden rows zeroed")
  ap.add_argument("--variants", nargs="+", default=None,
                  help="only these (default: every variant and plain)")
  args = ap.parse_args(argv)
  key = jax.random.key(0)
  for w, scale, h, tags in points(args):
    tags = dict(tags, zero=args.zero, top_k=TOP_K, top_p=TOP_P)
    inputs = _inputs(h, args.zero)
    if args.variants:
      inputs = {name: x for name, x in inputs.items() if name in args.variants}
    calls = {name: _compiled(name, w, scale, key, *x) for name, x in inputs.items()}
    keys = jax.random.split(jax.random.key(1), 8)
    same = {name: all(np.array_equal(np.asarray(calls[name](k)),
                                     np.asarray(calls[f"{name}_before"](k))) for k in keys)
            for name in inputs if f"{name}_before" in inputs}
    rows = {name: _exact_rows(w, scale, key, *x, before=name.endswith("_before"))
            for name, x in inputs.items()}
    print(json.dumps(dict(tags, exact_rows=rows, same_tokens_as_before=same)), flush=True)
    variants = {name: (lambda f: lambda h, w: f(key))(f) for name, f in calls.items()}
    if not args.variants or "plain" in args.variants:
      variants["plain"] = jax.jit(lambda h, w: fs.sample(h, w, key, weight_scale=scale))
    report(args, variants, h, w, tags)


if __name__ == "__main__":
  main()
