"""The checker: materializes the logits and calls ``jax.random.categorical``.

This is not a backend; it is what every backend is tested against. It holds
the full ``[B, V]`` logits and uses nothing of this package's noise or
streaming code, so a bug there cannot hide in it. The truncation rules
(top-k, top-p, min-p) are written once, on materialized rows, in
:func:`flashsample_jax.controls.keep_mask`: that function *is* their
definition, and the streaming backends are tested against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashsample_jax import backends, controls as _controls, problem


def _logits(p: problem.Problem):
  """``l = hidden @ W.T`` in f32 ``[B, rows]`` (a quantized ``W`` converted
  to ``hidden``'s dtype, ``l`` then times ``weight_scale``; layout
  "logits": the given logits in f32)."""
  if p.layout == "logits":
    return p.weight.astype(jnp.float32)
  contract = 1 if p.layout == "vd" else 0
  l = jax.lax.dot_general(p.hidden, p.weight.astype(p.hidden.dtype),
                          (((1,), (contract,)), ((), ())),
                          preferred_element_type=jnp.float32)
  if p.weight_scale is not None:
    l = l * p.weight_scale
  return l


def raw_logits(p: problem.Problem, c: _controls.Controls):
  """The raw logits ``[B, vocab_size]``: :func:`_logits`, soft-capped."""
  return _controls.softcapped(_logits(p)[:, :p.vocab_size], c)


def transformed_logits(p: problem.Problem, c: _controls.Controls | None = None):
  """Transformed, untempered f32 logits ``[B, vocab_size]``.

  :func:`_logits`, then soft-cap, bias, penalties and the allowed mask in
  the order of :mod:`flashsample_jax.controls`.
  """
  l = _logits(p)
  x = l[:, :p.vocab_size]
  if c is None:
    return x
  x = _controls.softcapped(x, c)
  if c.logit_bias is not None:
    x = x + c.logit_bias[None, :]
  if c.penalizes:
    x = _controls.penalize(x, c, *_controls.dense_history(c, p.batch, p.vocab_size))
  if c.allowed_mask is not None:
    ids = jnp.arange(p.vocab_size)
    words = c.allowed_mask[:, ids // 32]
    allowed = ((words >> (ids % 32).astype(jnp.uint32)) & 1) == 1
    x = jnp.where(allowed, x, -jnp.inf)
  return x


def _categorical(p, logits, samples):
  """``[S, B]`` draws of ``jax.random.categorical`` (vmapped for row keys)."""
  key = jax.random.wrap_key_data(p.key_data, impl="threefry2x32")
  if p.per_row_keys:
    draw = lambda k, row: jax.random.categorical(k, row, shape=(samples,))
    return jax.vmap(draw)(key, logits).T
  return jax.random.categorical(key, logits, shape=(samples, p.batch))


def _entropy(t):
  """``-sum(q log q)`` of ``q = softmax(t)`` per row, terms of ``q = 0`` left
  out; NaN for a row of ``-inf`` (no distribution) and for a row whose
  softmax is NaN (a NaN or ``+inf`` logit), as its log-probabilities are:
  the ``q > 0`` mask alone would drop the NaN terms and report 0."""
  q = jax.nn.softmax(t, axis=-1)
  h = -jnp.sum(jnp.where(q > 0, q * jax.nn.log_softmax(t, axis=-1), 0.0), axis=-1)
  undefined = jnp.all(t == -jnp.inf, axis=-1) | jnp.any(jnp.isnan(q), axis=-1)
  return jnp.where(undefined, jnp.nan, h)


@jax.jit
def _sample(p: problem.Problem, c: _controls.Controls):
  num_samples, return_logprobs = c.num_samples, c.return_logprobs
  x = transformed_logits(p, c)
  t_col = p.temperature[:, None]
  greedy = p.temperature == 0
  # Greedy rows keep T = 1 for their log-probabilities.
  t = x / jnp.where(t_col == 0, 1.0, t_col)
  # One value of t for every use: XLA may recompute t inside each fusion
  # that reads it, and two copies can round apart by an ulp (x / T becomes
  # x * (1 / T), and LLVM may contract the soft-cap's multiply and the
  # bias's add into an FMA in one copy only). keep_mask would then compare
  # t with a threshold sorted from another copy and keep nothing.
  t = jax.lax.optimization_barrier(t)
  kept = jnp.where(_controls.keep_mask(t, c), t, -jnp.inf) if c.truncates else t
  tokens = jnp.where(greedy[None, :], jnp.argmax(x, axis=-1)[None, :],
                     _categorical(p, kept, c.samples)).astype(jnp.int32)   # [S, B]
  if not c.samples_only:
    # Nothing to sample: -1. Plain sampling (temperature, num_samples)
    # stays categorical's own.
    none = _controls.nothing_to_sample(x, kept, greedy, c.allowed_mask, p.vocab_size)
    tokens = jnp.where(none[None, :], -1, tokens)
  out = tokens if num_samples is not None else tokens[0]
  if not c.returns_output:
    return out
  lse = jax.nn.logsumexp(t, axis=-1)
  lse_kept = jax.nn.logsumexp(kept, axis=-1)
  t_tok = jnp.take_along_axis(t[None], jnp.maximum(tokens, 0)[..., None], axis=2)[..., 0]
  t_tok = jnp.where(tokens < 0, jnp.nan, t_tok)
  lp = _controls.SampleOutput(tokens, None, None, None)
  if return_logprobs:
    lp = lp._replace(logprob=t_tok - lse,
                     logprob_truncated=_controls.truncated_logprob(t_tok, lse_kept),
                     logsumexp=jnp.broadcast_to(lse, tokens.shape))
  if c.raw_top:
    raw = raw_logits(p, c)
    top_r, top_ids = _controls.top_n(raw, c.top_logprobs)
    lp = lp._replace(top_ids=jnp.where(top_r == -jnp.inf, -1, top_ids).astype(jnp.int32),
                     top_logprobs=top_r - jax.nn.logsumexp(raw, axis=-1)[:, None])
  elif c.top_logprobs:
    top_t, top_ids = _controls.top_n(t, c.top_logprobs)
    top_ids = jnp.where(top_t == -jnp.inf, -1, top_ids)
    top_lp = top_t - lse[:, None]
    if c.allowed_mask is not None:
      empty = _controls.none_allowed(c.allowed_mask, p.vocab_size)[:, None]
      top_lp = jnp.where(empty, jnp.nan, top_lp)
    lp = lp._replace(top_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp)
  if c.return_raw_logprobs:
    raw = raw_logits(p, c)
    raw_lp = jax.nn.log_softmax(raw, axis=-1)
    raw_tok = jnp.take_along_axis(raw_lp[None], jnp.maximum(tokens, 0)[..., None],
                                  axis=2)[..., 0]
    lp = lp._replace(logprob_raw=jnp.where(tokens < 0, jnp.nan, raw_tok))
  if c.return_entropy:
    lp = lp._replace(entropy=_entropy(t), entropy_truncated=_entropy(kept))
  if c.return_kept:
    kept_t, kept_ids = _controls.top_n(kept, c.return_kept)
    lp = lp._replace(kept_ids=jnp.where(kept_t > -jnp.inf, kept_ids, -1).astype(jnp.int32),
                     kept_count=jnp.sum(kept > -jnp.inf, axis=-1, dtype=jnp.int32))
  if num_samples is None:
    lp = lp.first_sample()
  return lp


def sample(hidden, weight, key, *, temperature=1.0, weight_layout="vd",
           vocab_size=None, weight_scale=None, backend="auto", top_k=None,
           top_p=None, min_p=None,
           logit_bias=None, allowed_mask=None, softcap=None,
           repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
           prompt_ids=None, output_ids=None, num_samples=None,
           return_logprobs=False, top_logprobs=0, truncation_order="hf",
           return_entropy=False, return_raw_logprobs=False, return_kept=0,
           top_logprobs_mode="processed"):
  """Reference sampler: :func:`flashsample_jax.sample`'s arguments, on one device.

  (The mesh arguments ``vocab_axis``/``batch_axis`` are not taken: compare a
  sharded call with this function on the global arrays.)

  Computes ``l = hidden @ W.T`` in f32, keeps the first ``vocab_size``
  columns, applies the controls (:mod:`flashsample_jax.controls`), and returns
  ``jax.random.categorical(key, kept / T)`` per row (``jax.vmap``-ed over
  per-row keys), or ``argmax`` where ``T == 0``; with any control, ``-1``
  for a row with nothing to sample (every id ``-inf`` after the controls,
  or for a sampled row every id truncated away).

  Args: as :func:`flashsample_jax.sample`; ``backend`` is checked and ignored.

  Returns:
    As :func:`flashsample_jax.sample`.
  """
  backends.check_name(backend)
  # Checked eagerly, outside jit, so concrete values are inspected.
  p = problem.prepare(hidden, weight, key, temperature=temperature,
                      weight_layout=weight_layout, vocab_size=vocab_size,
                      weight_scale=weight_scale)
  c = _controls.prepare_controls(
      batch=p.batch, vocab_size=p.vocab_size, rows=p.weight_rows,
      num_samples=num_samples, return_logprobs=return_logprobs, top_k=top_k,
      top_p=top_p, min_p=min_p, logit_bias=logit_bias, allowed_mask=allowed_mask,
      softcap=softcap, repetition_penalty=repetition_penalty,
      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
      prompt_ids=prompt_ids, output_ids=output_ids, top_logprobs=top_logprobs,
      truncation_order=truncation_order, return_entropy=return_entropy,
      return_raw_logprobs=return_raw_logprobs, return_kept=return_kept,
      top_logprobs_mode=top_logprobs_mode)
  return _sample(p, c)


def sample_logits(logits, key, *, temperature=1.0, vocab_size=None, **controls):
  """Reference for :func:`flashsample_jax.sample_logits`: the same as
  :func:`sample` with ``hidden @ W.T`` replaced by ``logits`` (in f32).

  Args: as :func:`flashsample_jax.sample_logits` (keywords only).
  """
  p = problem.prepare_logits(logits, key, temperature=temperature, vocab_size=vocab_size)
  c = _controls.prepare_controls(batch=p.batch, vocab_size=p.vocab_size,
                                 rows=p.weight_rows, **controls)
  return _sample(p, c)


def verify_drafts(hidden, weight, key, draft_ids, *, method="one_hot", temperature=1.0,
                  draft_probs=None, return_logprobs=False, weight_layout="vd",
                  vocab_size=None, weight_scale=None, backend="auto",
                  allowed_mask=None, prompt_ids=None,
                  output_ids=None, **controls):
  """Reference for :func:`flashsample_jax.verify_drafts`: position by
  position, from materialized logits and ``jax.random.categorical``, the
  rules of :mod:`flashsample_jax.speculative`.

  Args: as :func:`flashsample_jax.verify_drafts` (``backend`` is checked and
  ignored; no ``vocab_axis``).
  """
  from flashsample_jax import speculative            # the contract's constants
  backends.check_name(backend)
  b, positions, _ = hidden.shape
  drafts = np.asarray(draft_ids).astype(np.int32)
  drafts = np.where(np.cumprod(drafts >= 0, axis=1).astype(bool), drafts, -1)
  data, per_row = problem.key_data(key, b)
  base = jax.random.wrap_key_data(data, impl="threefry2x32")
  penalized = any(controls.get(k) is not None for k in
                  ("repetition_penalty", "presence_penalty", "frequency_penalty"))
  accept = np.zeros((b, positions), bool)
  emit = np.zeros((b, positions), np.int32)
  lp_draft = np.zeros((b, positions), np.float32)
  lp_emit = np.zeros((b, positions), np.float32)
  d_all = np.concatenate([drafts, np.full((b, 1), -1, np.int32)], axis=1)
  for j in range(positions):
    key_j = (jax.vmap(lambda k: jax.random.fold_in(k, j))(base) if per_row
             else jax.random.fold_in(base, j))
    hist = None
    if penalized:
      before = np.where(np.arange(positions - 1)[None] < j, drafts, -1)
      hist = before if output_ids is None else np.concatenate(
          [np.asarray(output_ids), before], axis=1)
    mask = allowed_mask
    if mask is not None and mask.ndim == 3:
      mask = mask[:, j]
    p = problem.prepare(hidden[:, j], weight, key_j, temperature=temperature,
                        weight_layout=weight_layout, vocab_size=vocab_size,
                        weight_scale=weight_scale)
    c = _controls.prepare_controls(
        batch=b, vocab_size=p.vocab_size, rows=p.weight_rows, allowed_mask=mask,
        prompt_ids=prompt_ids if penalized else None,
        output_ids=None if hist is None else jnp.asarray(hist), **controls)
    x = transformed_logits(p, c)
    greedy = np.asarray(p.temperature == 0)
    t = jax.lax.optimization_barrier(x / jnp.where(p.temperature[:, None] == 0, 1.0,
                                                   p.temperature[:, None]))
    kept = jnp.where(_controls.keep_mask(t, c), t, -jnp.inf) if c.truncates else t
    lse = jax.nn.logsumexp(kept, axis=1)
    lp = np.asarray(kept - lse[:, None])
    d = d_all[:, j]
    ids = jnp.arange(p.vocab_size)[None]
    sample = lambda logits: np.asarray(_categorical(p, logits, 1)[0])
    argmax = np.asarray(jnp.argmax(x, axis=1))
    nothing = np.asarray(_controls.nothing_to_sample(x, kept, greedy, mask, p.vocab_size))
    token = np.where(nothing, -1, np.where(greedy, argmax, sample(kept)))
    acc_key = (jax.vmap(lambda k: jax.random.fold_in(k, speculative.ACCEPT_STREAM))(key_j)
               if per_row else jax.random.fold_in(key_j, speculative.ACCEPT_STREAM))
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, ()))(acc_key) if per_row
                   else jax.random.uniform(acc_key, (b,)))
    dd = np.clip(d, 0, p.vocab_size - 1)
    if method == "strict":
      acc, residual = token == d, token
    elif method == "one_hot":
      acc = u < np.asarray(jnp.exp(kept - lse[:, None]))[np.arange(b), dd]
      acc &= np.asarray(kept)[np.arange(b), dd] > -np.inf
      without = jnp.where(ids == jnp.asarray(d)[:, None], -jnp.inf, kept)
      residual = np.where(np.asarray(jnp.all(without == -jnp.inf, axis=1)), -1,
                          sample(without))
    else:
      q = np.zeros((b, p.vocab_size), np.float32)
      if j < positions - 1:
        q = np.asarray(draft_probs[:, j], np.float32)
      q_d = q[np.arange(b), dd]
      pf = np.asarray(jnp.exp(kept - lse[:, None]))
      acc = u * q_d < pf[np.arange(b), dd]
      res = np.maximum(pf - q, 0.0)
      res = np.where(res.sum(axis=1, keepdims=True) > 0, res, pf)
      residual = sample(jnp.log(jnp.asarray(res)))
    accept[:, j] = np.where(greedy, token == d, acc) & (d >= 0)
    emit[:, j] = np.where(greedy | (d < 0) | (token < 0), token, residual)
    lp_draft[:, j] = lp[np.arange(b), dd]
    lp_emit[:, j] = np.where(emit[:, j] >= 0, lp[np.arange(b), np.maximum(emit[:, j], 0)],
                             np.nan)
  n = np.sum(np.cumprod(accept, axis=1), axis=1).astype(np.int32)
  j = np.arange(positions)[None]
  tokens = np.where(j < n[:, None], d_all, np.where(j == n[:, None], emit, -1))
  logprobs = None
  if return_logprobs:
    logprobs = np.where(j < n[:, None], lp_draft,
                        np.where((j == n[:, None]) & (tokens >= 0), lp_emit, np.nan))
  return speculative.VerifyOutput(jnp.asarray(tokens, jnp.int32), jnp.asarray(n),
                                  None if logprobs is None else jnp.asarray(logprobs))
