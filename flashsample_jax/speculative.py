"""Speculative decoding: verify drafted tokens from the target's LM head.

A drafter proposed ``K`` tokens per request; the target ran ``K + 1``
positions and hands over their last hidden states. :func:`verify_drafts`
decides, per request, how many drafts to accept and which token follows,
from one fused pass over the head for all ``B x (K + 1)`` rows (no logits
written on the fused backends).

The rows. Row ``(b, j)`` (request ``b``, position ``j``) samples exactly as
``fs.sample(hidden[:, j], weight, k_j, ...)`` with ``k_j =
jax.random.fold_in(key, j)`` (a scalar key) or ``fold_in(key[b], j)`` (one
key per request), with the request's controls; with penalties its output
history is ``output_ids`` plus the drafts before ``j`` (vLLM's rule).

The acceptance draws are a separate stream from the same keys:
``u[b, j] = jax.random.uniform(fold_in(k_j, ACCEPT_STREAM), (B,))[b]`` (a
scalar key) or ``jax.random.uniform(fold_in(k_bj, ACCEPT_STREAM), ())``.

The methods, for a draft ``d`` at a sampled row whose processed (tempered,
transformed, truncated) distribution is ``p``:

* ``"strict"``: accept while ``d`` equals the row's own sample (the token
  ``fs.sample`` returns); the first row that differs emits that sample.
* ``"one_hot"`` (vLLM's default): accept with probability ``p(d)`` (``u <
  p(d)``); at a rejection emit the sample of ``p`` with ``d`` removed (the
  same Gumbel noise, ``d`` left out). Both rules accept with probability
  ``p(d)`` and emit a token distributed as ``p``; they use other draws.
* ``"probabilistic"`` (Leviathan et al.): accept with ``min(1, p(d) /
  q(d))`` for the drafter's probabilities ``q = draft_probs`` (``u q(d) <
  p(d)``); at a rejection emit a sample of ``max(0, p - q)`` renormalized
  (``p`` where that is all zero). This rule needs ``p`` and ``q`` over the
  whole vocabulary: it materializes the ``[B (K + 1), V]`` logits.

Greedy rows (temperature 0) accept while ``d`` is the argmax (lowest id on
ties) and emit the argmax, for every method. After all of a request's
drafts are accepted, position ``K_b`` emits its own sample (the bonus
token).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashsample_jax import api, backends, checks, controls, mesh, problem, stage2

__all__ = ["verify_drafts", "VerifyOutput", "METHODS", "ACCEPT_STREAM",
           "position_keys", "acceptance_uniforms", "draft_history"]

METHODS = ("strict", "one_hot", "probabilistic")
# fold_in data of the acceptance stream ("accp").
ACCEPT_STREAM = 0x61636370


class VerifyOutput(NamedTuple):
  """What :func:`verify_drafts` returns.

  Attributes:
    tokens: int32 ``[B, K + 1]``: ``tokens[b, :n]`` the accepted drafts,
      ``tokens[b, n]`` the token the target emits there (the draw at a
      rejection, or the bonus token after all drafts), ``-1`` after.
    num_accepted: int32 ``[B]``: ``n``.
    logprobs: f32 ``[B, K + 1]`` or None: log-probabilities of ``tokens``
      under the target's processed distribution at their positions (NaN
      after ``n``, and for a row with nothing to sample).
  """

  tokens: Any
  num_accepted: Any
  logprobs: Any


def position_keys(key, batch: int, positions: int):
  """The typed keys of every row, ``[B, positions]``: ``fold_in(key, j)``
  (one key for the batch) or ``fold_in(key[b], j)`` (one per request), and
  whether there is one key per request."""
  data, per_row = problem.key_data(key, batch)
  keys = jax.random.wrap_key_data(data, impl="threefry2x32")
  j = jnp.arange(positions, dtype=jnp.uint32)
  if per_row:
    return jax.vmap(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(j))(keys), True
  row = jax.vmap(lambda i: jax.random.fold_in(keys, i))(j)                 # [K1]
  return jnp.broadcast_to(row[None], (batch, positions)), False


def acceptance_uniforms(keys, per_row: bool):
  """``u [B, K1]`` in [0, 1) of the acceptance stream (module docstring)."""
  accept = lambda k: jax.random.fold_in(k, ACCEPT_STREAM)
  if per_row:
    return jax.vmap(jax.vmap(lambda k: jax.random.uniform(accept(k), ())))(keys)
  b = keys.shape[0]
  return jax.vmap(lambda k: jax.random.uniform(accept(k), (b,)))(keys[0]).T


def draft_history(output_ids, drafts):
  """Each row's output history, ``[B, K1, O + K]``: ``output_ids[b]`` then
  the drafts before position ``j`` (-1 for the rest)."""
  b, k = drafts.shape
  before = jnp.arange(k)[None, :] < jnp.arange(k + 1)[:, None]               # [K1, K]
  hist = jnp.where(before[None], drafts[:, None, :], -1)                     # [B, K1, K]
  if output_ids is None:
    return hist
  out = jnp.broadcast_to(output_ids[:, None, :], (b, k + 1, output_ids.shape[1]))
  return jnp.concatenate([out, hist], axis=2)


def _reached(is_id):
  """bool ``[B, K]``: the positions a request's drafts reach, those before
  its first entry that is no id, and that entry (the rest are ignored).
  NumPy for a NumPy ``is_id`` (a constant inside a trace too)."""
  xp = np if isinstance(is_id, np.ndarray) else jnp
  before = xp.cumprod(is_id, axis=1).astype(bool)
  return xp.concatenate([xp.ones_like(before[:, :1]), before[:, :-1]], axis=1)


def _check_drafts(draft_ids, batch: int, positions: int, vocab_size: int):
  """``draft_ids`` int32 ``[B, K]``, ids after a row's first -1 set to -1.
  Only the positions the drafts reach are checked (:func:`_reached`)."""
  if not hasattr(draft_ids, "dtype") or not hasattr(draft_ids, "shape"):
    raise TypeError(f"draft_ids must be an int array [B, K], got {type(draft_ids).__name__}")
  if not jnp.issubdtype(draft_ids.dtype, jnp.integer) or draft_ids.dtype == jnp.bool_:
    raise TypeError(f"draft_ids.dtype={draft_ids.dtype} must be an integer dtype")
  if draft_ids.shape != (batch, positions - 1):
    raise ValueError(f"draft_ids.shape={tuple(draft_ids.shape)} must be [B, K]=({batch}, "
                     f"{positions - 1}): hidden holds K + 1 = {positions} positions")
  want = f"an id in [0, {vocab_size}) or -1 (no more drafts)"
  if not isinstance(draft_ids, jax.core.Tracer):
    raw = np.asarray(draft_ids).astype(np.int64)
    bad = _reached(raw >= 0) & ((raw < -1) | (raw >= vocab_size))
    if bad.any():
      b, j = np.argwhere(bad)[0]
      raise ValueError(f"draft_ids[{b}, {j}]={raw[b, j]} must be {want}")
  else:
    in_range = controls.ids_in_range(draft_ids, vocab_size)
    ok = jnp.all(in_range | ~_reached(in_range & (draft_ids != -1)))
    checks.debug_check(ok, f"draft_ids must hold {want}")
  d = jnp.asarray(draft_ids, jnp.int32)
  live = jnp.cumprod(d >= 0, axis=1).astype(bool)   # before the row's first -1
  return jnp.where(live, d, -1)


def _check_hidden(hidden):
  if not hasattr(hidden, "shape") or not hasattr(hidden, "dtype"):
    raise TypeError(f"hidden must be an array [B, K + 1, D], got {type(hidden).__name__}")
  if hidden.ndim != 3 or hidden.shape[1] < 1:
    raise ValueError(f"hidden.shape={tuple(hidden.shape)} must be [B, K + 1, D]: the "
                     "target's last hidden states at each request's K + 1 positions")
  return hidden.shape


def _per_request(name, value, batch: int, positions: int):
  """A per-request control (scalar or ``[B]``) for the ``B x K1`` rows."""
  if value is None or not hasattr(value, "ndim") or value.ndim == 0:
    return value
  if value.shape != (batch,):
    raise ValueError(f"{name}.shape={tuple(value.shape)} must be a scalar or [B]=({batch},) "
                     f"(one value per request, applied at each of its {positions} positions)")
  return jnp.repeat(value, positions)


def _allowed_rows(allowed_mask, batch: int, positions: int, vocab_size: int):
  """``allowed_mask`` ``[B, words]`` or ``[B, K1, words]`` as ``[B K1, words]``."""
  if allowed_mask is None:
    return None
  words = -(-vocab_size // 32)
  if getattr(allowed_mask, "ndim", 0) == 3:
    if allowed_mask.shape != (batch, positions, words):
      raise ValueError(f"allowed_mask.shape={tuple(allowed_mask.shape)} must be [B, words] "
                       f"or [B, K + 1, words]=({batch}, {positions}, {words})")
    return allowed_mask.reshape(batch * positions, words)
  if getattr(allowed_mask, "ndim", 0) == 2 and allowed_mask.shape == (batch, words):
    return jnp.repeat(allowed_mask, positions, axis=0)
  raise ValueError(f"allowed_mask.shape={tuple(getattr(allowed_mask, 'shape', ()))} must be "
                   f"[B, words]=({batch}, {words}) or [B, K + 1, words]")


def _check_draft_probs(draft_probs, method: str, drafts, vocab_size: int):
  """``draft_probs`` f32 ``[B, K, V]``, checked (and zeroed) at the positions
  that hold a draft (``drafts`` >= 0): a ragged caller's rows past its
  drafts are ignored, as ``draft_ids``' entries there are."""
  batch, k = drafts.shape
  if method != "probabilistic":
    if draft_probs is not None:
      raise ValueError(f"draft_probs is read only by method='probabilistic', not {method!r}")
    return None
  if draft_probs is None:
    raise ValueError("method='probabilistic' needs draft_probs, the drafter's "
                     f"probabilities f32 [B, K, V]=({batch}, {k}, {vocab_size})")
  if not hasattr(draft_probs, "dtype") or not jnp.issubdtype(draft_probs.dtype, jnp.floating):
    raise TypeError(f"draft_probs must be a float array [B, K, V], got "
                    f"{getattr(draft_probs, 'dtype', type(draft_probs).__name__)}")
  if draft_probs.shape != (batch, k, vocab_size):
    raise ValueError(f"draft_probs.shape={tuple(draft_probs.shape)} must be [B, K, V]="
                     f"({batch}, {k}, {vocab_size})")
  q = jnp.asarray(draft_probs, jnp.float32)
  _check_distributions(q, drafts >= 0)
  return jnp.where((drafts >= 0)[:, :, None], q, 0.0)


# How far a row of draft_probs may sum from 1: bf16 probabilities of a 152k
# vocabulary round each term by at most 2**-9 of itself, far inside it.
_SUM_TOLERANCE = 1e-2


def _check_distributions(q, live) -> None:
  """Refuses draft probabilities that are no distribution: a negative,
  NaN or infinite entry, or a row summing to more than
  :data:`_SUM_TOLERANCE` away from 1 (a negative ``q(d)`` accepts any draft;
  an unnormalized row skews the residual). Concrete ``q``: ``ValueError``
  naming the first bad row; traced: a checkify check while traced checks
  are on (``checks.debug_check``). Rows where ``live`` ``[B, K]`` is False
  are not checked."""
  def flags(q):       # per row: entries finite and >= 0, and the row's sum
    return jnp.all(jnp.isfinite(q) & (q >= 0), axis=-1), jnp.sum(q, axis=-1)
  if isinstance(q, jax.core.Tracer) or isinstance(live, jax.core.Tracer):
    entries, sums = flags(q)
    ok = (~live | (entries & (jnp.abs(sums - 1) <= _SUM_TOLERANCE))).reshape(-1)
    checks.debug_check(jnp.all(ok), "draft_probs row {i} (of B x K) is no distribution: "
                       "entries must be finite and >= 0, each row sum 1", i=jnp.argmin(ok))
    return
  with jax.ensure_compile_time_eval():         # a constant inside a trace too
    entries, sums = (np.asarray(f) for f in flags(q))
    live = np.asarray(live)
  for bad, why in ((live & ~entries, "has a negative, NaN or infinite entry"),
                   (live & ~(np.abs(sums - 1) <= _SUM_TOLERANCE),
                    f"sums to {{}}, not 1 (within {_SUM_TOLERANCE})")):
    if bad.any():
      b, k = np.unravel_index(int(np.argmax(bad)), bad.shape)
      raise ValueError(f"draft_probs[{b}, {k}] {why.format(float(sums[b, k]))}: the "
                       "drafter's probabilities, a distribution over the vocabulary per "
                       "position")


def verify_drafts(hidden, weight, key, draft_ids, *, method="one_hot", temperature=1.0,
                  top_k=None, top_p=None, min_p=None, logit_bias=None, allowed_mask=None,
                  softcap=None, draft_probs=None, repetition_penalty=None,
                  presence_penalty=None, frequency_penalty=None, prompt_ids=None,
                  output_ids=None, return_logprobs=False, truncation_order="hf",
                  weight_layout="vd", vocab_size=None, weight_scale=None, backend="auto",
                  vocab_axis=None):
  """Verifies ``K`` drafted tokens per request (the module docstring has
  the rules, the keys and the acceptance draws).

  Args:
    hidden: ``[B, K + 1, D]``: the target's last hidden states at each
      request's ``K + 1`` positions.
    weight, weight_layout, vocab_size, weight_scale, backend, vocab_axis: as
      :func:`flashsample_jax.sample` (``vocab_axis`` inside ``shard_map``).
    key: a scalar key or ``[B]`` keys (one per request).
    draft_ids: int ``[B, K]``: a request's drafts end at its first ``-1``
      (ragged ``K``); later entries are ignored.
    method: ``"strict"``, ``"one_hot"`` or ``"probabilistic"``.
    temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
      frequency_penalty: per request (scalars or ``[B]``), applied at every
      position, as :func:`flashsample_jax.sample` defines them.
    logit_bias, softcap, truncation_order: as :func:`flashsample_jax.sample`.
    allowed_mask: ``[B, words]`` (one per request) or ``[B, K + 1, words]``
      (a grammar state per position).
    draft_probs: f32 ``[B, K, V]``, the drafter's probabilities
      (``method="probabilistic"`` only).
    prompt_ids, output_ids: ``[B, P]`` / ``[B, O]`` histories; position
      ``j``'s output history is ``output_ids`` plus the drafts before ``j``.
    return_logprobs: also return the tokens' log-probabilities.

  Returns:
    A :class:`VerifyOutput`.

  Raises:
    TypeError, ValueError: bad arguments, naming them (shapes, a ``K`` that
      does not match ``hidden``, ids out of range, ``draft_probs`` missing or
      misshaped, an unknown method), and whatever :func:`flashsample_jax.sample`
      raises for the controls.
  """
  if method not in METHODS:
    raise ValueError(f"method={method!r} must be one of {METHODS}")
  if not isinstance(return_logprobs, bool):
    raise problem.static_arg_error("return_logprobs", return_logprobs, "a bool")
  batch, positions, dim = _check_hidden(hidden)
  axes = mesh.MeshAxes.of(vocab_axis)
  # The head's checks (and the global vocabulary) on one row per request.
  p_req = problem.prepare(hidden[:, 0], weight, key, temperature=temperature,
                          weight_layout=weight_layout, vocab_size=vocab_size,
                          vocab_shards=axes.vocab_shards(), weight_scale=weight_scale)
  vocab = p_req.vocab_size
  drafts = _check_drafts(draft_ids, batch, positions, vocab)
  q = _check_draft_probs(draft_probs, method, drafts, vocab)
  per_request = dict(top_k=top_k, top_p=top_p, min_p=min_p,
                     repetition_penalty=repetition_penalty,
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
  # The controls' own checks, with the request's indices in their messages.
  controls.prepare_controls(batch=batch, vocab_size=vocab, rows=p_req.total_rows,
                            logit_bias=logit_bias, softcap=softcap, prompt_ids=prompt_ids,
                            output_ids=output_ids, truncation_order=truncation_order,
                            **per_request)
  rows = {k: _per_request(k, v, batch, positions) for k, v in per_request.items()}
  penalized = any(v is not None for v in (repetition_penalty, presence_penalty,
                                          frequency_penalty))
  if penalized:
    rows["output_ids"] = draft_history(output_ids, drafts).reshape(batch * positions, -1)
    if prompt_ids is not None:
      rows["prompt_ids"] = jnp.repeat(prompt_ids, positions, axis=0)
  if batch == 0:
    empty = jnp.zeros((0, positions), jnp.int32)
    return VerifyOutput(empty, jnp.zeros((0,), jnp.int32),
                        empty.astype(jnp.float32) if return_logprobs else None)
  keys, per_row = position_keys(key, batch, positions)
  p = _rows_problem(hidden, weight, keys, per_row, vocab,
                    _per_request("temperature", temperature, batch, positions),
                    weight_layout=weight_layout, weight_scale=weight_scale, axes=axes)
  axes.check_weight(p.weight, p.layout, p.weight_scale)
  c = controls.prepare_controls(
      batch=p.batch, vocab_size=vocab, rows=p.total_rows, logit_bias=logit_bias,
      softcap=softcap, truncation_order=truncation_order, return_logprobs=True,
      allowed_mask=_allowed_rows(allowed_mask, batch, positions, vocab), **rows)
  d = jnp.concatenate([drafts, jnp.full((batch, 1), -1, jnp.int32)], axis=1).reshape(-1)
  u = acceptance_uniforms(keys, per_row)
  impl = backends.resolve(backend, p, c)
  if method == "probabilistic":
    return _verify_probabilistic(p, c, d, q, u, batch=batch, axes=axes,
                                 return_logprobs=return_logprobs)
  return _verify(p, c, d, u, backend=impl, axes=axes, method=method, batch=batch,
                 return_logprobs=return_logprobs)


def _rows_problem(hidden, weight, keys, per_row: bool, vocab_size: int, temperature, *,
                  weight_layout: str, weight_scale,
                  axes: mesh.MeshAxes) -> problem.Problem:
  """The problem of the ``B x K1`` rows: row ``(b, j)`` with the key words of
  ``k_j`` and the counters ``fs.sample`` gives row ``b`` under that key
  (``b x V`` for a scalar key, 0 for per-request keys)."""
  batch, positions, dim = hidden.shape
  data = jax.random.key_data(keys.reshape(-1))                    # [B K1, 2]
  p = problem.prepare(hidden.reshape(batch * positions, dim), weight, data,
                      temperature=1.0 if temperature is None else temperature,
                      weight_layout=weight_layout, vocab_size=vocab_size,
                      vocab_shards=axes.vocab_shards(), weight_scale=weight_scale)
  if per_row:
    return p
  b = np.repeat(np.arange(batch, dtype=np.uint64), positions)
  ctr = b * np.uint64(vocab_size)                                  # < 2**63: exact
  return dataclasses.replace(
      p, ctr_hi=jnp.asarray((ctr >> np.uint64(32)).astype(np.uint32)),
      ctr_lo=jnp.asarray((ctr & np.uint64(0xFFFFFFFF)).astype(np.uint32)))


@functools.partial(jax.jit, static_argnames=("backend", "axes", "method", "batch",
                                             "return_logprobs"))
def _verify(p, c, d, u, *, backend, axes, method: str, batch: int, return_logprobs: bool):
  """The fused verification: one pass over W for every row, stage 2, then
  the acceptance."""
  if method == "strict":
    out = api.run(p, c, backend=backend, axes=axes)
    token, lp = out.tokens, out.logprob_truncated
    # A -1 (no draft there, or the bonus slot) never matches: a position
    # with nothing to sample also returns -1.
    accept = (token == d) & (d >= 0)
    emit, lp_emit = token, lp
    lp_draft = lp
  else:
    rows = _one_hot_rows(p, c, d, backend=backend, axes=axes)
    p_d = jnp.where(rows.draft_kept, jnp.exp(rows.t_draft - rows.lse_kept), 0.0)
    greedy = p.temperature == 0
    accept = jnp.where(greedy, rows.token == d, u.reshape(-1) < p_d) & (d >= 0)
    emit = jnp.where(greedy | (d < 0), rows.token, rows.residual)
    t_emit = jnp.where(greedy | (d < 0), rows.t_token, rows.t_residual)
    lp_emit = t_emit - rows.lse_kept
    lp_draft = rows.t_draft - rows.lse_kept
  return _assemble(d, accept, emit, lp_draft, lp_emit, batch, return_logprobs)


def _one_hot_rows(p, c, d, *, backend, axes) -> stage2.DraftRows:
  """The pass without each row's draft id (its allowed bit cleared; with
  penalties the backend does not fuse, the history ids too, scored from
  their weight rows), the draft's own state, and stage 2."""
  offset = axes.vocab_offset(p.weight_rows)
  draft_hist = stage2.History(d[:, None], jnp.zeros((p.batch, 1), jnp.int32))
  pc = c.for_pass()
  if c.penalizes and not backend.fuses_penalties(p, c):
    # The history ids but the draft from their weight rows; the pass skips
    # them and the draft (distinct ids: excluded_mask adds their bits).
    hist = stage2.history(c)
    others = stage2.History(jnp.where(hist.ids == d[:, None], -1, hist.ids), hist.count)
    skipped = stage2.History(jnp.concatenate([others.ids, d[:, None]], axis=1),
                             jnp.concatenate([others.count, draft_hist.count], axis=1))
    st = stage2.state_combine(pc, stage2.candidate_count(p, c))(
        backend.controls_state(p, stage2.pass_controls(pc, skipped, p.vocab_size),
                               vocab_offset=offset),
        stage2.history_state(p, pc, others, vocab_offset=offset))
  else:
    pass_c = dataclasses.replace(
        pc, allowed_mask=stage2.excluded_mask(c, draft_hist, p.vocab_size))
    st = backend.controls_state(p, pass_c, vocab_offset=offset)
  # Scored as the pass scores (without noise where the pass draws none:
  # Controls.for_pass), so that the two states merge.
  st_d = stage2.draft_state(p, pc, d, vocab_offset=offset)
  return stage2.finish_drafts(p, c, stage2.per_sample(st, 1), stage2.per_sample(st_d, 1),
                              d, axis=axes.vocab)


def _assemble(d, accept, emit, lp_draft, lp_emit, batch: int, return_logprobs: bool):
  """Tokens ``[B, K1]``: the accepted drafts, then the emitted token, then -1."""
  shape = (batch, -1)
  d, accept, emit = d.reshape(shape), accept.reshape(shape), emit.reshape(shape)
  positions = d.shape[1]
  n = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
  j = jnp.arange(positions)[None]
  at_n = j == n[:, None]
  tokens = jnp.where(j < n[:, None], d, jnp.where(at_n, emit, -1)).astype(jnp.int32)
  logprobs = None
  if return_logprobs:
    logprobs = jnp.where(j < n[:, None], lp_draft.reshape(shape),
                         jnp.where(at_n & (tokens >= 0), lp_emit.reshape(shape), jnp.nan))
  return VerifyOutput(tokens, n, logprobs)


@functools.partial(jax.jit, static_argnames=("batch", "axes", "return_logprobs"))
def _verify_probabilistic(p, c, d, q, u, *, batch: int, axes, return_logprobs: bool):
  """Leviathan et al.'s rule from materialized logits (it needs ``p`` and
  ``q`` over the whole vocabulary)."""
  perturb = lambda x, t, gid: stage2.perturbed(p, x, t, gid, 1)
  x, t, kept, gid = stage2.materialized_rows(p, c, axes.vocab)
  token, t_token = stage2.draw_kept(p, x, t, kept, gid, perturb)
  token, t_token = token[:, 0].astype(jnp.int32), t_token[:, 0]
  greedy = p.temperature == 0
  # x holds the mask already (materialized_rows): -1 as sample() returns.
  token = jnp.where(controls.nothing_to_sample(x, kept, greedy), -1, token)
  lse = jax.nn.logsumexp(kept, axis=1)
  probs = jnp.exp(kept - lse[:, None])
  q = jnp.concatenate([q, jnp.zeros((batch, 1, q.shape[2]), q.dtype)], axis=1)
  q = q.reshape(p.batch, -1)
  dd = jnp.clip(d, 0, probs.shape[1] - 1)[:, None]
  p_d = jnp.take_along_axis(probs, dd, axis=1)[:, 0]
  q_d = jnp.take_along_axis(q, dd, axis=1)[:, 0]
  # An id past the vocabulary (a traced draft the checks could not refuse)
  # is never accepted, as the fused methods never accept it.
  accept = (jnp.where(greedy, token == d, u.reshape(-1) * q_d < p_d) & (d >= 0)
            & (d < probs.shape[1]))
  res = jnp.maximum(probs - q, 0.0)
  res = jnp.where(jnp.sum(res, axis=1, keepdims=True) > 0, res, probs)
  r_tok, _ = stage2.draw_kept(p, x, jnp.log(res), jnp.log(res), gid, perturb)
  r_tok = r_tok[:, 0].astype(jnp.int32)
  r_tok = jnp.where(jnp.all(res == 0, axis=1), -1, r_tok)
  # A row with nothing to sample (token -1) emits -1, as sample() returns:
  # its probs are NaN, and so its residual draw would be an arbitrary id.
  emit = jnp.where(greedy | (d < 0) | (token < 0), token, r_tok)
  lp = kept - lse[:, None]
  lp_emit = jnp.take_along_axis(lp, jnp.maximum(emit, 0)[:, None], axis=1)[:, 0]
  lp_draft = jnp.take_along_axis(lp, dd, axis=1)[:, 0]
  return _assemble(d, accept, emit, lp_draft, lp_emit, batch, return_logprobs)
