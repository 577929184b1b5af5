"""The sampling-controls cases every backend is checked on (exact inputs).

``scale=1`` and ``T = 4 x`` powers of two: logits with std ~2, so truncation
matters and rows differ; every seventh row is greedy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs
from tests import inputs

B, D, V = 24, 64, 3001
H, W = inputs.exact_inputs(B, D, V, scale=1, seed=1)
T = inputs.pow2_temperatures(B, greedy_every=7, seed=1) * 4
KEYS = {"scalar": jax.random.key(3), "per_row": inputs.row_keys(B, seed=3)}
_R = np.random.default_rng(0)


def _mask(rows):
  return jnp.asarray(_R.integers(0, 2**32, (rows, -(-V // 32)), dtype=np.uint32))


CASES = {
    "top_k": dict(top_k=jnp.asarray(_R.integers(0, 60, B), jnp.int32)),
    "top_k_scalar": dict(top_k=20),
    "top_p": dict(top_p=jnp.asarray(_R.uniform(0.05, 1.0, B), jnp.float32)),
    "min_p": dict(min_p=jnp.asarray(_R.uniform(0.0, 0.5, B), jnp.float32)),
    "k_p_minp": dict(top_k=40, top_p=0.8, min_p=0.02),
    # vLLM's order: top-p's mass over what min-p kept (half the rows keep
    # other ids than with "hf"; tests/test_params.py checks that they do).
    "p_minp_vllm": dict(top_p=0.8, min_p=0.05, truncation_order="vllm"),
    "bias": dict(logit_bias=jnp.asarray(_R.integers(-4, 5, V), jnp.float32)),
    "softcap": dict(softcap=3.0),
    "mask": dict(allowed_mask=_mask(B)),
    "all": dict(top_k=30, top_p=0.9, min_p=0.01, softcap=8.0,
                logit_bias=jnp.asarray(_R.integers(-2, 3, V), jnp.float32),
                allowed_mask=_mask(B)),
}


def _history(rows, width, hi, pad):
  """Ids in [0, hi) (repeats likely when ``hi`` is small), ``pad`` of each
  row's trailing entries -1."""
  ids = _R.integers(0, hi, (rows, width)).astype(np.int32)
  ids[:, width - pad:] = -1
  return jnp.asarray(ids)


# Penalties with exact arithmetic on the integer logits: powers of two for
# the repetition penalty, quarters for presence and frequency. Histories:
# prompts over the whole vocabulary, outputs over its first 80 ids (so ids
# repeat and rows share some); row 1 has no history at all.
_PROMPT = _history(B, 40, V, 7).at[1].set(-1)
_OUTPUT = _history(B, 24, 80, 5).at[1].set(-1)
PENALTIES = dict(
    repetition_penalty=jnp.asarray(_R.choice([0.5, 1.0, 2.0, 4.0], B), jnp.float32),
    presence_penalty=jnp.asarray(_R.choice([-0.5, 0.0, 0.25, 1.0], B), jnp.float32),
    frequency_penalty=jnp.asarray(_R.choice([0.0, 0.25, 0.5, 2.0], B), jnp.float32),
    prompt_ids=_PROMPT, output_ids=_OUTPUT)

CASES.update({
    "top_logprobs": dict(top_logprobs=20),
    "top_logprobs_truncated": dict(top_logprobs=5, top_k=30, top_p=0.9, min_p=0.01),
    "penalties": PENALTIES,
    "penalties_all": dict(CASES["all"], **PENALTIES, top_logprobs=8),
})


def only_one_allowed(rng):
  """``(ids [B], mask)``: a mask that allows one random id per row."""
  only = rng.integers(0, V, B)
  mask = np.zeros((B, -(-V // 32)), np.uint32)
  mask[np.arange(B), only // 32] = (1 << (only % 32)).astype(np.uint32)
  return only, jnp.asarray(mask)


# -- top-p near 1 with a nucleus wider than the candidate lists (issue #42) --
#
# Rows of logits exact in bf16 (row r of ``NUCLEUS_W`` is column r of the
# weight; ``hidden`` one-hot picks it), V = 2048, every row tempered by 1.
# The lists hold CANDIDATES = 128 ids; these rows put the nucleus edge of
# ``top_p`` just past them or just inside them. Before the fix, stage 2's
# "same token at p -/+ width" shortcut read top-p at p + width >= 1 as off
# and sampled the whole row from the 128 candidates, losing winners beyond
# them (about 1e-4 of the rows at p = 1 - 1e-4 .. 1 - 1e-6; never at
# 1 - 1e-3, whose p + width stays below 1).
NUCLEUS_V = 2048
NUCLEUS_TOP_P = (1 - 1e-3, 1 - 1e-4, 1 - 1e-5, 1 - 1e-6)


def _row(*groups):
  """``(count, value)`` groups in order, the rest of the row at -100."""
  r = np.concatenate([np.full(n, v, np.float32) for n, v in groups])
  return np.concatenate([r, np.full(NUCLEUS_V - r.size, -100, np.float32)])


# The nucleus at each of NUCLEUS_TOP_P (ties of the last kept value count).
NUCLEUS_ROWS = {
    # The row: 1628 ids at p >= 1 - 1e-4 (120 at 1 - 1e-3).
    "wide_1628": _row((120, 0), (8, -10), (1500, -11)),
    # Zipf, -2.6 log(rank) in bf16: 47 / 200 / 742 / 1682 ids.
    "zipf": np.asarray(jnp.asarray(-2.6 * np.log(np.arange(1, NUCLEUS_V + 1)),
                                   jnp.bfloat16).astype(jnp.float32)),
    # Just above the lists: one id past them (129) from 1 - 1e-4 on ...
    "above_129": _row((120, 0), (7, -3.5), (1, -4), (1, -4.125)),
    # ... from 1 - 1e-5 on (128 at 1 - 1e-4) ...
    "above_129_late": _row((120, 0), (7, -4.5), (1, -4.75), (1, -5)),
    # ... and six past them (134) from 1 - 1e-4 on.
    "above_134": _row((120, 0), (7, -4.5), (1, -4.75), (6, -5.5)),
    # Just inside: 127 at 1 - 1e-4, all 128 listed ids from 1 - 1e-5 on.
    "inside_128": _row((120, 0), (7, -4.5), (1, -4.75)),
}
NUCLEUS_W = np.stack(list(NUCLEUS_ROWS.values()))        # [rows, V]
# Per-row keys: ``jax.random.split(jax.random.key(2), 65536)[i]`` for these
# i: a few plain ones, then rows that the shortcut got wrong before the fix
# (724 and 3048: the issue's; the others found by a search of 65536 keys on
# each row above, every one of them wrong on some row and top_p).
NUCLEUS_KEY_IDS = (0, 1, 2, 724, 3048, 8134, 2847, 19967, 23752, 996, 10439,
                   39898, 40537, 2977, 14047, 52390)


def nucleus_inputs():
  """``(hidden [R, 64], weight [V, 64], keys [R], labels)``: every row of
  NUCLEUS_ROWS with every key of NUCLEUS_KEY_IDS (``labels[i]``: row i's
  ``(row name, key id)``), exact in bf16; sample with each of NUCLEUS_TOP_P."""
  n, k = len(NUCLEUS_ROWS), len(NUCLEUS_KEY_IDS)
  h = np.zeros((n * k, 64), np.float32)
  h[np.arange(n * k), np.repeat(np.arange(n), k)] = 1.0
  w = np.zeros((NUCLEUS_V, 64), np.float32)
  w[:, :n] = NUCLEUS_W.T
  keys = jax.random.split(jax.random.key(2), 65536)[jnp.asarray(NUCLEUS_KEY_IDS * n)]
  labels = [(name, i) for name in NUCLEUS_ROWS for i in NUCLEUS_KEY_IDS]
  return jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), keys, labels


# Every RL output at once (tests/test_rl.py, the GPU tests of the kernels).
RL = dict(return_entropy=True, return_raw_logprobs=True, return_kept=64,
          return_logprobs=True)


def check_rl(got, want):
  """Tokens and kept sets identical, floats within 1e-5 of the reference's."""
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.kept_ids, want.kept_ids)
  np.testing.assert_array_equal(got.kept_count, want.kept_count)
  for name in ("logprob", "logprob_truncated", "logprob_raw", "entropy",
               "entropy_truncated"):
    np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-5,
                               atol=1e-5, err_msg=name)


def check_rl_on_exact_inputs(backend: str, b: int, penalty: bool = False):
  """A kernel's RL fields (entropy terms, raw log-sum-exp, finite counts)
  through stage 2 against the reference (:func:`check_rl`), on exact inputs
  with per-row keys and power-of-two temperatures: with truncation (the
  noise-free pass), without it (the kept set is every finite id; the pass
  with noise), with six samples (two launches) and, with ``penalty``, a
  repetition penalty (the raw logits are taken before it). Integers in [-1,
  1] at D = 128: logits of magnitude ~30, where f32's rounding of the raw
  log-sum-exp (the largest value) stays below 1e-5 (at D = 512 with [-3, 3]
  it reached 256, one ulp 1.5e-5)."""
  d, v = 128, 5003
  h, w = inputs.exact_inputs(b, d, v, seed=b, scale=1)
  t = inputs.pow2_temperatures(b, greedy_every=9, seed=b)
  keys = inputs.row_keys(b, seed=b)
  per_row_k = jnp.asarray(np.where(np.arange(b) % 4, 40, 0), jnp.int32)
  kws = [dict(top_k=50, top_p=0.9), dict(), dict(top_k=per_row_k, num_samples=6)]
  if penalty:
    hist = jnp.asarray(np.random.default_rng(b).integers(0, v, (b, 16)), jnp.int32)
    kws.append(dict(top_p=0.95, repetition_penalty=2.0, output_ids=hist))
  for kw in kws:
    got = fs.sample(h, w, keys, temperature=t, backend=backend, **kw, **RL)
    want = fs.reference.sample(h, w, keys, temperature=t, **kw, **RL)
    check_rl(got, want)


# Outputs a batch-invariant call reports: every float field bit for bit.
INVARIANT_FIELDS = ("logprob", "logprob_truncated", "logsumexp", "logprob_raw",
                    "entropy", "entropy_truncated", "top_logprobs")
INVARIANT_MODES = {
    "plain": dict(return_logprobs=True, return_entropy=True, return_raw_logprobs=True),
    "qwen3_topk_topp": dict(top_k=20, top_p=0.95, return_logprobs=True,
                            return_entropy=True),
    "top_logprobs": dict(top_logprobs=5),
}


def check_batch_invariance(backend: str, batches=(1, 64, 100, 200), full: int = 260, *,
                           dim: int = 1024, vocab: int = 50000,
                           modes=tuple(INVARIANT_MODES)):
  """docs/design.md, "Determinism and RL": the first B rows of a call of
  ``full`` rows against a call of those B rows, on random bf16 inputs (the
  sums round) with per-row keys at T 0.7: the same tokens and the same
  bits in every float field, plain, with Qwen3's top-k + top-p and with
  top-N log-probabilities (``modes``: of :data:`INVARIANT_MODES`). ``full``
  spans several of every kernel's batch blocks and launches."""
  h, w = inputs.random_inputs(full, dim, vocab, seed=5)
  keys = inputs.row_keys(full, seed=5)
  bits = lambda x: np.asarray(x, np.float32).view(np.uint32)
  # Every mode, B and field is compared before failing, so that one run
  # shows which outputs lose their bits where.
  differ = []
  for mode in modes:
    kw = INVARIANT_MODES[mode]
    run = jax.jit(lambda h, k, kw=kw: fs.sample(h, w, k, temperature=0.7,
                                                backend=backend, **kw))
    whole = run(h, keys)
    for b in batches:
      part = run(h[:b], keys[:b])
      pairs = [("tokens", np.asarray(part.tokens), np.asarray(whole.tokens)[:b])]
      pairs += [(name, bits(getattr(part, name)), bits(getattr(whole, name))[:b])
                for name in INVARIANT_FIELDS if getattr(whole, name) is not None]
      for name, got, want in pairs:
        rows = np.any((got != want).reshape(b, -1), axis=1)
        if rows.any():
          differ.append(f"{mode} B={b} {name}: {int(rows.sum())} rows")
  assert not differ, differ
