"""Tokens of rows holding a NaN or infinite logit, per backend, against the
reference (docs/design.md, "The exactness contract").

  python3 -m benchmarks.experiments.probe_nan_logits [--backends mosaic triton xla]

The exact-input cases' head (``tests/cases.py``) with ``W[7, 3] = inf``:
rows whose hidden state is 0 at column 3 (row 2 is all zeros) have a NaN
logit at id 7 (``0 * inf``), the others ``+-inf``. One JSON line per
(backend, case): the rows whose token differs from the reference's, and
for the cases with a rule per row the pass state of row 2 (max, sum of
``exp(t - max)``, best), which stage 2's flat-row certificate reads.
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from flashsample_jax import api, controls, problem
from tests import cases


def _cases(b: int, v: int) -> dict:
  top_k = jnp.asarray(np.where(np.arange(b) % 2, 0, 30), jnp.int32)
  return {"plain": {}, "bias": dict(logit_bias=jnp.zeros((v,), jnp.float32)),
          "top_k_per_row": dict(top_k=top_k), "softcap": dict(softcap=8.0),
          "softcap_top_k_per_row": dict(softcap=8.0, top_k=top_k)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--backends", nargs="+", default=["mosaic", "triton", "xla"])
  args = ap.parse_args(argv)
  b, v = cases.B, cases.V
  h, w = cases.H.at[2].set(0), cases.W.at[7, 3].set(jnp.inf)
  key, t = cases.KEYS["per_row"], cases.T
  for backend in args.backends:
    for name, kw in _cases(b, v).items():
      got = np.asarray(fs.sample(h, w, key, temperature=t, backend=backend, **kw))
      want = np.asarray(fs.reference.sample(h, w, key, temperature=t, **kw))
      rec = dict(backend=backend, case=name, differ=np.flatnonzero(got != want).tolist(),
                 got=got[got != want].tolist(), want=want[got != want].tolist())
      if "top_k" in kw:
        p = problem.prepare(h, w, key, temperature=t)
        c = controls.prepare_controls(batch=b, vocab_size=v, rows=v, **kw)
        st = api.pass_state(p, c, fs.backends.resolve(backend, p, c), 0)
        rec.update(lse_max_row2=float(np.asarray(st.lse_max)[2]),
                   lse_sum_row2=float(np.asarray(st.lse_sum)[2]),
                   best_row2=np.asarray(st.best_score)[2].tolist())
      print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
