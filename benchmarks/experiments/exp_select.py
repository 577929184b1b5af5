"""Top-M of candidate lists: XLA's two-key sort against a selection kernel.

``python3 -m benchmarks.experiments.exp_select [B ...]`` prints, per batch
size and M, the GPU kernels (us) of ``state.top_m(by_id=True)`` on 924
candidates per row (what the controls kernel's lists leave at 132 SMs)
and of ``sm90_top.top_lists`` on the same candidates, and checks that both
give the same lists.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _timing
from pallas_kernels import sm90_top
from pallas_kernels.state import top_m

L = 924


def _kernels(f, *args):
  events, _ = _timing.trace_events(f, *args, calls=6)
  per = {}
  for _, d, n, _ in events[len(events) // 2:]:
    per.setdefault(n[:60], []).append(d / 1e3)
  return {n: float(np.median(v)) for n, v in per.items()}


def main():
  batches = [int(a) for a in sys.argv[1:]] or [1, 16, 64]
  for b in batches:
    rng = np.random.default_rng(b)
    vals = jnp.asarray(rng.normal(0, 1.3, (b, L)).astype(np.float32))
    ids = jnp.asarray(np.stack([rng.permutation(152064)[:L] for _ in range(b)]).astype(np.int32))
    bound = jnp.full((b,), -jnp.inf)
    for m in (21, 28):
      xla = jax.jit(lambda v, i, bd, m=m: top_m(v, i, bd, m, by_id=True))
      ker = jax.jit(lambda v, i, bd, m=m: sm90_top.top_lists(v, i, bd, m)[:2])
      a, k = xla(vals, ids, bound), ker(vals, ids, bound)
      same = bool(jnp.all(a[0] == k[0]) & jnp.all(a[1] == k[1]))
      tx, tk = _timing.median_us(xla, vals, ids, bound)[0], _timing.median_us(ker, vals, ids, bound)[0]
      print(f"B={b} M={m} same={same} call us: xla {tx:.1f} kernel {tk:.1f}")
      print("   xla   ", {n: round(t, 1) for n, t in _kernels(xla, vals, ids, bound).items()})
      print("   kernel", {n: round(t, 1) for n, t in _kernels(ker, vals, ids, bound).items()})


if __name__ == "__main__":
  main()
