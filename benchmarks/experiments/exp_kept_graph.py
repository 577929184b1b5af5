"""Which RL output takes the exact path's conditional out of the CUDA graph
(issue #39, docs/performance.md "The exact path's conditional").

  XLA_FLAGS=--xla_dump_to=$OUT/dump python3 -m benchmarks.experiments.exp_kept_graph \
      [--head S] [--batch 16] [--sets none kept64 ...]

Compiles and runs, once each, top-k 50 + top-p 0.9 sampling (``--weight-dtype
fp8``: an FP8 head, the dense route with its list kernels) with each output
set of ``bench_controls.RL_OUTPUTS`` (``none``: tokens only), each in its own
jitted function named ``rl_<set>``, so that XLA's dump holds one module per
set. Then, for every ``*thunk_sequence_after_thunk_passes.txt`` of those
modules, prints the thunks at the top level of the sequence (a
``kConditional`` there, not nested under a ``kCommandBuffer``, is decided on
the host: its predicate is copied back on every call) and the custom calls
and sorts of the optimized HLO.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

import jax
import jax.numpy as jnp

import flashsample_jax as fs
from benchmarks import shapes
from benchmarks.bench_controls import RL_OUTPUTS, TOP_K, TOP_P
from benchmarks.experiments._points import DTYPES, head

SETS = {"none": {}, **RL_OUTPUTS}


def _function(name: str, kw: dict, key, backend: str, scale):
  def f(h, w):
    return fs.sample(h, w, key, backend=backend, top_k=TOP_K, top_p=TOP_P,
                     weight_scale=scale, **kw)
  f.__name__ = f"rl_{name}"
  return jax.jit(f)


def _top_level_thunks(text: str) -> list[str]:
  """The kinds of the thunks with the least indentation in a dumped thunk
  sequence, in order (nested sequences of command buffers and branches are
  indented further)."""
  lines = [l for l in text.splitlines() if re.search(r"\bk[A-Z]\w+", l)]
  if not lines:
    return []
  depth = min(len(l) - len(l.lstrip()) for l in lines)
  return [re.search(r"\bk[A-Z]\w+", l).group(0) for l in lines
          if len(l) - len(l.lstrip()) == depth]


def report(dump: str, name: str) -> None:
  for path in sorted(glob.glob(os.path.join(dump, f"*jit_rl_{name}*thunk_sequence_after_thunk_passes.txt"))):
    print(f"== {os.path.basename(path)}")
    print("   top level:", " ".join(_top_level_thunks(open(path).read())))
  for path in sorted(glob.glob(os.path.join(dump, f"*jit_rl_{name}*after_optimizations.txt"))):
    hlo = open(path).read()
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    sorts = len(re.findall(r"\bsort\(", hlo))
    conds = len(re.findall(r" conditional\(", hlo))
    print(f"   {os.path.basename(path)}: custom calls {calls}, sorts {sorts}, conditionals {conds}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--head", default="S", choices=sorted(shapes.HEADS))
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
  ap.add_argument("--backend", default="auto")
  ap.add_argument("--weight-dtype", default="bf16", choices=["bf16", *DTYPES],
                  help="the head quantized per row (8-bit heads take the dense route's lists)")
  args = ap.parse_args(argv)
  m = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
  if not m:
    raise SystemExit("set XLA_FLAGS=--xla_dump_to=DIR")
  d, _ = shapes.HEADS[args.head]
  w, scale = head(args.head, args.weight_dtype)
  h = jax.random.normal(jax.random.key(args.batch), (args.batch, d), jnp.bfloat16)
  key = jax.random.key(0)
  for name in args.sets:
    jax.block_until_ready(_function(name, SETS[name], key, args.backend, scale)(h, w))
  for name in args.sets:
    report(m.group(1), name)


if __name__ == "__main__":
  main()
