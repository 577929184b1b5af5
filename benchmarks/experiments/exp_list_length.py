"""Candidate lists as long as a concrete ``top_k`` needs against the full
``stage2.CANDIDATES`` (docs/performance.md, "The list kernels").

  python3 -m benchmarks.experiments.exp_list_length [--heads S L]
      [--batches 1 16 64] [--weight-dtypes fp8 bf16] [--rounds 2] [--timeline]

With ``top_k=50`` on every row, stage 2 keeps ``k_bound(50) + LIST_SLACK =
64`` candidates per row (``controls.Controls.top_k_max``); ``full`` is the
same call traced as though top-k's bound were unknown (128 candidates, the
lists before). For each head, weight dtype and B (random inputs, T 1, top-k
50 + top-p 0.9 through ``auto``), one JSON line with the rows each variant
sends to the exact path, whether the two variants' tokens agree over 8 keys
(exactness at full size), and the routes; then alternating rounds
(``_timing.timed_rounds``) of ``short``, ``full`` and ``plain`` (``auto``
without controls). With ``--timeline``: each variant's device timeline
instead of the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import jax
import numpy as np

import flashsample_jax as fs
from benchmarks._fallback import exact_path_rows
from benchmarks.bench_controls import TOP_K, TOP_P
from benchmarks.experiments._points import add_point_args, points, report
from flashsample_jax import controls


@contextlib.contextmanager
def _unbounded_top_k():
  """Traces calls as though no concrete top-k bounded the kept sets."""
  saved = controls._top_k_max  # pylint: disable=protected-access
  controls._top_k_max = lambda top_k: 0  # pylint: disable=protected-access
  try:
    yield
  finally:
    controls._top_k_max = saved  # pylint: disable=protected-access


def _compiled(make, *args, full: bool):
  """``make()`` jitted and compiled for ``args``, with the full lists if
  ``full``. ``make`` returns a new function each time: ``jax.jit`` of one
  function object reuses its first trace, which would answer for the
  other variant."""
  with _unbounded_top_k() if full else contextlib.nullcontext():
    return jax.jit(make()).lower(*args).compile()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_point_args(ap, heads=["S", "L"], batches=[1, 16, 64], weight_dtypes=["fp8", "bf16"],
                 rounds=2)
  args = ap.parse_args(argv)
  trunc = dict(top_k=TOP_K, top_p=TOP_P)
  key = jax.random.key(0)
  for w, scale, h, tags in points(args):
    topk = lambda: lambda h, w, k: fs.sample(h, w, k, weight_scale=scale, **trunc)
    short, full = (_compiled(topk, h, w, key, full=f) for f in (False, True))
    assert short.as_text() != full.as_text(), "one program for both variants"
    keys = jax.random.split(jax.random.key(1), 8)
    same = float(np.mean([np.array_equal(short(h, w, k), full(h, w, k)) for k in keys]))
    rows = exact_path_rows(h, w, key, weight_scale=scale, **trunc)
    with _unbounded_top_k():
      rows_full = exact_path_rows(h, w, key, weight_scale=scale, **trunc)
    route = fs.which_backend(h, w, key, weight_scale=scale, **trunc)
    print(json.dumps(dict(tags, exact_rows=dict(short=rows, full=rows_full),
                          same_tokens=same, route=route)), flush=True)
    variants = {"short": lambda h, w: short(h, w, key),
                "full": lambda h, w: full(h, w, key),
                "plain": jax.jit(lambda h, w: fs.sample(h, w, key, weight_scale=scale))}
    report(args, variants, h, w, tags, traced=("short", "full"))


if __name__ == "__main__":
  main()
