"""Stage 2: what every backend's per-row results go through to become tokens.

A backend delivers, per row, either one ``(score, id)`` candidate (plain
sampling: the best over its vocabulary rows) or a
:class:`~pallas_kernels.state.ControlsState` (sampling controls: each
sample's best, an online log-sum-exp, the top-M tempered logits). This module
merges them (chunks, warpgroups, shards: :func:`state_combine`), decides the
truncation rules on the candidates (:func:`finish`), and runs the exact
materialized path for the rare rows the candidates cannot certify. It also
turns several samples of a row into rows of their own
(:func:`samples_as_rows`), for backends that draw those faster.

The tie rule and the greedy rule are :mod:`pallas_kernels.rules`, shared with
the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from flashsample_jax import controls, mesh, noise, problem
from flashsample_jax.problem import Problem
from pallas_kernels import rules
from pallas_kernels.rowdata import Penalties
from pallas_kernels.state import ControlsState, lse_parts, parts_sum, top_m

__all__ = ["ControlsState", "CANDIDATES", "candidate_count", "tempered",
           "perturbed", "pass_scores", "state_combine", "state_from_parts", "topm_merge",
           "History", "history", "history_bits", "penalty_planes", "penalty_rows",
           "pass_controls", "excluded_mask", "history_state", "finish",
           "samples_as_rows", "per_sample", "MergedLists", "merged_lists", "fixed_logsumexp"]

# Candidates per row kept for truncation (top-k / top-p / min-p): the M
# largest tempered logits. Rows whose kept set the candidates cannot certify
# take the exact materialized path (see finish).
CANDIDATES = 128
# Relative distance of the mass before an id from top_p below which a row is
# not certified from the candidates (f32 sums over ~1e5 terms differ by far
# less); such rows are rare and take the exact path.
_TOP_P_MARGIN = 1e-4


def candidate_count(p: Problem, c: controls.Controls) -> int:
  """M: the candidates per row kept for truncation or top-N (at most the
  rows): CANDIDATES with a truncation rule, ``top_k_max + LIST_SLACK``
  where top-k bounds every row's kept set (shorter for the usual k: a
  cheaper select and merge, docs/performance.md, "The list kernels";
  longer past k = 120, up to ``RETURN_KEPT_MAX`` + the slack), and at least
  N + the slack with ``top_logprobs=N`` or ``return_kept=N``. The slack
  holds for every N up to the maximum: with none, the N-th listed value is
  the last and never certified, and every row took the exact path (issue
  #42: at N = 128, all 64 rows of a B = 64 call on an H200, 14x the time).

  Lists are padded to M entries when a shard has fewer rows, so that
  shards' lists merge with one shape."""
  m = CANDIDATES if c.truncates else 0
  if c.top_k_max and c.top_k_max <= controls.RETURN_KEPT_MAX:
    # As long as top-k needs, shorter or longer than CANDIDATES: lists
    # shorter than k + the slack certify no k-th value, and every row of a
    # call with top_k = 128 took the exact path (found by review). Past a
    # k of RETURN_KEPT_MAX (the longest lists any output asks for) rows do.
    m = c.top_k_max + controls.LIST_SLACK
  if c.top_logprobs and not c.raw_top:
    m = max(m, c.top_logprobs + controls.LIST_SLACK)
  if c.return_kept:
    m = max(m, c.return_kept + controls.LIST_SLACK)
  return min(m, p.total_rows)


def raw_count(p: Problem, c: controls.Controls) -> int:
  """The length of the raw logits' lists (``top_logprobs_mode="raw"``):
  N and the same slack as :func:`candidate_count`'s."""
  return min(c.top_logprobs + controls.LIST_SLACK, p.total_rows)


def tempered(p: Problem, x):
  """``x / T`` per row (greedy rows: T = 1). Division, not multiplication by
  ``1 / T``: the reference divides, and the two round differently unless T
  is a power of two."""
  return x / rules.split_temperature(p.temperature[:, None])[1]


def perturbed(p: Problem, x, t, gid, samples: int):
  """Scores ``[B, S, W]`` whose argmax over the last axis is each sample:
  ``t + g`` (greedy rows: ``x``).

  ``x`` and ``t`` are ``[B, W]``, ``gid`` ``[W]`` or ``[B, W]``. One
  expression for every sample, so the program does not grow with S; XLA
  fuses the noise into the reduction that consumes it.
  """
  hi, lo = p.counters(samples, rows_first=True)                  # [B, S]
  hi, lo = noise.add_u32(hi[:, :, None], lo[:, :, None],
                         gid.astype(jnp.uint32)[..., None, :])
  g = noise.gumbel(p.k0[:, None, None], p.k1[:, None, None], hi, lo)
  greedy = p.temperature[:, None, None] == 0
  return rules.perturb(x[:, None], t[:, None], g, greedy)


def pass_scores(p: Problem, c: controls.Controls, x, t, gid):
  """The scores ``[B, S, W]`` of a pass with controls ``c`` whose argmax is
  each sample's best: :func:`perturbed`, or ``x`` itself where the pass
  draws no noise (``Controls.for_pass``: one best serves every sample)."""
  if not c.noise:
    return x[:, None, :]
  return perturbed(p, x, t, gid, c.samples)


def _lse_merge(a, b):
  """Merges online log-sum-exp states ``(max, sum of exp(t - max))``."""
  m = jnp.maximum(a[0], b[0])
  scale = lambda mx: jnp.where(m == -jnp.inf, 0.0, jnp.exp(mx - m))
  return m, a[1] * scale(a[0]) + b[1] * scale(b[0])


def _entropy_merge(a, b, m):
  """Merges :attr:`ControlsState.ent_sum` terms ``(max, sum, terms)`` onto
  the merged max ``m``: ``exp(t - m) (t - m) = e^(a - m) (exp(t - a) (t -
  a) + (a - m) exp(t - a))`` for a part whose max is ``a``."""
  def part(mx, total, terms):
    empty = (mx == -jnp.inf) | (m == -jnp.inf)
    shift = jnp.where(empty, 0.0, mx - m)
    return jnp.where(empty, 0.0, jnp.exp(shift) * (terms + shift * total))
  return part(*a) + part(*b)


def topm_merge(a, b, m: int):
  """Merges candidate lists ``(vals [B, *], ids, bound [B])``: the ``m``
  largest values (ties keep ``a``, lower ids, first) and the larger bound.

  ``bound`` is an upper bound on every value of the row that is in no list
  (``-inf`` for exact lists; a kernel's fixed-depth lists can overflow).
  Listed values at or below the bound are ``-inf`` (they may have unlisted
  equals or neighbours): every producer of a list keeps that, so
  :func:`finish` reads the lists as they are.
  """
  vals = jnp.concatenate([a[0], b[0]], axis=1)
  ids = jnp.concatenate([a[1], b[1]], axis=1)
  bound = jnp.maximum(a[2], b[2])
  vals, j = lax.top_k(jnp.where(vals > bound[:, None], vals, -jnp.inf), m)
  return vals, jnp.take_along_axis(ids, j, axis=1), bound


def state_combine(c: controls.Controls, m: int):
  """The associative merge of two :class:`ControlsState` of the same rows
  over two parts of the vocabulary (the tie rule decides equal scores by
  id; equal candidate values keep ``a``'s first, so give ``a`` the lower
  ids)."""
  def combine(a: ControlsState, b: ControlsState) -> ControlsState:
    take = rules.better(b.best_score, b.best_id, a.best_score, a.best_id)
    pick = lambda x, y: jnp.where(take, y, x)
    lse = _lse_merge((a.lse_max, a.lse_sum), (b.lse_max, b.lse_sum))
    out = ControlsState(
        best_score=pick(a.best_score, b.best_score),
        best_id=pick(a.best_id, b.best_id), best_t=pick(a.best_t, b.best_t),
        lse_max=lse[0], lse_sum=lse[1])
    if c.return_entropy:
      out = out._replace(ent_sum=_entropy_merge((a.lse_max, a.lse_sum, a.ent_sum),
                                                (b.lse_max, b.lse_sum, b.ent_sum), lse[0]))
    if c.raw_lse:
      raw = _lse_merge((a.raw_max, a.raw_sum), (b.raw_max, b.raw_sum))
      out = out._replace(raw_max=raw[0], raw_sum=raw[1])
    if c.raw_top:
      vals, ids, bound = topm_merge((a.raw_vals, a.raw_ids, a.raw_bound),
                                    (b.raw_vals, b.raw_ids, b.raw_bound), a.raw_vals.shape[1])
      out = out._replace(raw_vals=vals, raw_ids=ids, raw_bound=bound)
    if c.return_kept:
      out = out._replace(finite_count=a.finite_count + b.finite_count)
    if c.given_ids is not None:   # one part holds each given id
      out = out._replace(given_t=jnp.maximum(a.given_t, b.given_t))
    if c.lists:
      vals, ids, bound = topm_merge((a.cand_vals, a.cand_ids, a.cand_bound),
                                    (b.cand_vals, b.cand_ids, b.cand_bound), m)
      out = out._replace(cand_vals=vals, cand_ids=ids, cand_bound=bound)
    return out
  return combine


def rl_state(c: controls.Controls, st: ControlsState, t, raw=None,
             gid=None, raw_m: int | None = None) -> ControlsState:
  """``st`` (a block's state, ``lse_max`` its max of ``t``) with the fields
  the RL outputs need (:attr:`controls.Controls.rl_outputs`): the entropy
  terms of ``t [B, W]``, the raw logits' log-sum-exp (``raw [B, W]``;
  None: a block whose raw logits another block covers), the count of
  finite ``t``, for ``c.given_ids`` the ``t`` of each row's given id
  (``gid``: the block's ids, ``[W]`` or ``[B, W]``) and, for top_logprobs
  of the raw logits, the ``raw_m`` largest raw logits (:func:`raw_count`)."""
  b = t.shape[0]
  if c.given_ids is not None:
    ids = gid if gid.ndim == 2 else gid[None, :]
    st = st._replace(given_t=jnp.max(jnp.where(ids == c.given_ids[:, None], t, -jnp.inf),
                                     axis=1))
  if c.return_entropy:
    st = st._replace(ent_sum=controls.entropy_terms(t, st.lse_max))
  if c.raw_lse:
    if raw is None:
      st = st._replace(raw_max=jnp.full((b,), -jnp.inf), raw_sum=jnp.zeros((b,)))
    else:
      # Fenced: the reductions then compile alike in every program that
      # asks for them (sample, score_tokens; docs/design.md, "Determinism
      # and RL"), whatever else reads the block's logits there.
      raw = lax.optimization_barrier(raw)
      rm = jnp.max(raw, axis=1)
      st = st._replace(raw_max=rm, raw_sum=jnp.sum(
          jnp.where(rm[:, None] == -jnp.inf, 0.0, jnp.exp(raw - rm[:, None])), axis=1))
  if c.raw_top:
    m = c.top_logprobs + controls.LIST_SLACK if raw_m is None else raw_m
    if raw is None:
      vals = jnp.full((b, m), -jnp.inf)
      ids = jnp.full((b, m), rules.INT_MAX, jnp.int32)
    else:
      ids_b = jnp.broadcast_to(gid, raw.shape)
      vals, ids = top_m(raw, ids_b, jnp.full((b,), -jnp.inf), m)
    st = st._replace(raw_vals=vals, raw_ids=ids, raw_bound=jnp.full((b,), -jnp.inf))
  if c.return_kept:
    st = st._replace(finite_count=jnp.sum(t > -jnp.inf, axis=1, dtype=jnp.int32))
  return st


def state_from_parts(best_score, best_id, best_t=None, lse_max=None,
                     lse_sum=None, cand_vals=None, cand_ids=None,
                     cand_bound=None, *, m: int, ent_sum=None, raw_max=None,
                     raw_sum=None, finite_count=None, given_t=None) -> ControlsState:
  """One :class:`ControlsState` per row from a kernel's per-part outputs.

  A part is whatever the kernel reduced on its own (a vocabulary tile, a
  warpgroup's tiles), on the LAST axis: ``best_score``/``best_id``/``best_t``
  ``[B, S, P]``, ``lse_max``/``lse_sum`` ``[B, P]`` (None: not asked for),
  candidate lists ``cand_vals``/``cand_ids`` ``[B, K, P]`` with
  ``cand_bound`` ``[B, P]`` (no value of the part that is not listed is
  larger). Lists keep the ``m`` largest values over the parts. The RL
  fields (:func:`rl_state`), each ``[B, P]`` or None: ``ent_sum`` relative
  to the part's ``lse_max``, ``raw_max``/``raw_sum``, ``finite_count``,
  ``given_t``.
  """
  if best_t is None:
    score, tok = rules.argbest(best_score, best_id, axis=2)
    t = jnp.zeros_like(score)
  else:
    score, tok, t = rules.argbest(best_score, best_id, axis=2, carry=best_t)
  b = score.shape[0]
  if lse_max is None:
    mx, total = jnp.zeros((b,), jnp.float32), jnp.ones((b,), jnp.float32)
  else:
    mx, total = lse_parts(lse_max, lse_sum)
  st = ControlsState(best_score=score, best_id=tok, best_t=t, lse_max=mx,
                     lse_sum=total)
  if ent_sum is not None:
    # Each part's terms moved onto the merged max (_entropy_merge's rule).
    empty = (lse_max == -jnp.inf) | (mx[:, None] == -jnp.inf)
    shift = jnp.where(empty, 0.0, lse_max - mx[:, None])
    st = st._replace(ent_sum=parts_sum(
        jnp.where(empty, 0.0, jnp.exp(shift) * (ent_sum + shift * lse_sum))))
  if raw_max is not None:
    st = st._replace(**dict(zip(("raw_max", "raw_sum"), lse_parts(raw_max, raw_sum))))
  if finite_count is not None:
    st = st._replace(finite_count=jnp.sum(finite_count, axis=1, dtype=jnp.int32))
  if given_t is not None:
    st = st._replace(given_t=jnp.max(given_t, axis=1))
  if cand_vals is not None:
    bound = jnp.max(cand_bound, axis=1)
    vals, ids = top_m(cand_vals, cand_ids, bound, m)
    st = st._replace(cand_vals=vals, cand_ids=ids, cand_bound=bound)
  # The merged state is what stage 2 reads: fenced, so that its reductions
  # compile alike in every program that reads them (sample and score_tokens
  # report the same bits; docs/design.md, "Determinism and RL").
  return lax.optimization_barrier(st)


class History(NamedTuple):
  """Each row's history as distinct ids: ``ids`` int32 ``[B, H]`` (each id
  once, ``-1`` for repeats and padding) and ``count`` int32 ``[B, H]``, how
  often the id occurs in ``output_ids``."""

  ids: jax.Array
  count: jax.Array


def history(c: controls.Controls) -> History:
  """The distinct ids of ``prompt_ids`` and ``output_ids`` per row, with
  their output counts: one sort per row, O(H log H), never ``[B, V]``."""
  parts = [(a, flag) for a, flag in ((c.prompt_ids, 0), (c.output_ids, 1))
           if a is not None]
  ids = jnp.concatenate([a for a, _ in parts], axis=1)
  is_out = jnp.concatenate([jnp.full(a.shape, f, jnp.int32) for a, f in parts], axis=1)
  key = jnp.where(ids >= 0, ids, rules.INT_MAX)
  # Two keys, so that XLA keeps an XLA sort kernel: a one-key sort of two
  # operands may become a CUB custom call, which splits the CUDA graph
  # (controls._sort_desc).
  key, is_out = lax.sort((key, is_out), dimension=1, num_keys=2)
  b, h = key.shape
  pos = lax.broadcasted_iota(jnp.int32, (b, h), 1)
  start = jnp.concatenate([jnp.ones((b, 1), bool), key[:, 1:] != key[:, :-1]], axis=1)
  # Where the next run of equal ids starts (h past the last): the outputs
  # of a run are the suffix sums' difference between its start and that.
  starts = jnp.where(start, pos, h)
  nxt = lax.cummin(jnp.concatenate([starts[:, 1:], jnp.full((b, 1), h)], axis=1),
                   axis=1, reverse=True)
  suffix = jnp.concatenate([lax.cumsum(is_out, axis=1, reverse=True),
                            jnp.zeros((b, 1), jnp.int32)], axis=1)
  count = suffix[:, :h] - jnp.take_along_axis(suffix, nxt, axis=1)
  first = start & (key != rules.INT_MAX)
  return History(jnp.where(first, key, -1), jnp.where(first, count, 0))


# Histories up to this many (row, id, id) pairs find their distinct ids by
# comparing every pair (one fusion); longer ones sort (history(): a sort
# and a few scans; their cost: docs/performance.md, "Penalties in the
# kernel").
PAIRWISE_MAX = 2**25


def penalty_planes(c: controls.Controls) -> Penalties:
  """The bit-planes that carry ``c``'s penalties to a kernel (static): what
  :func:`history_bits` makes. Their number grows with the output ids'
  width (``O.bit_length()`` count planes with a frequency penalty)."""
  out_width = 0 if c.output_ids is None else c.output_ids.shape[1]
  return Penalties(
      repetition=c.repetition_penalty is not None,
      presence=c.presence_penalty is not None and out_width > 0,
      frequency=c.frequency_penalty is not None and out_width > 0,
      count_bits=(0 if not out_width else
                  out_width.bit_length() if c.frequency_penalty is not None else
                  1 if c.presence_penalty is not None else 0))


def history_bits(c: controls.Controls):
  """Each row's history for a kernel that applies the penalties per element
  from bit-planes (:class:`~pallas_kernels.rowdata.Penalties` says what
  plane ``k`` holds): ``(ids int32 [B, H], flags bool [B, H, P],
  Penalties)``, each id once per row (``-1`` for repeats and padding) and
  its bit in each plane. ``P`` may be 0 (the penalties change nothing)."""
  pen = penalty_planes(c)
  parts = [(a, flag) for a, flag in ((c.prompt_ids, False), (c.output_ids, True))
           if a is not None]
  ids = jnp.concatenate([a for a, _ in parts], axis=1)
  b, h = ids.shape
  if b * h * h <= PAIRWISE_MAX:
    is_out = jnp.concatenate([jnp.full(a.shape, f) for a, f in parts], axis=1)
    eq = (ids[:, :, None] == ids[:, None, :]) & (ids >= 0)[:, :, None]  # [B, i, j]
    pos = lax.broadcasted_iota(jnp.int32, (h, h), 0)
    earlier = pos < lax.broadcasted_iota(jnp.int32, (h, h), 1)        # i < j
    first = (ids >= 0) & ~jnp.any(eq & earlier, axis=1)
    count = jnp.sum(eq & is_out[:, :, None], axis=1, dtype=jnp.int32)  # outputs equal to j
    ids, count = jnp.where(first, ids, -1), jnp.where(first, count, 0)
  else:
    ids, count = history(c)
  count = count if pen.frequency else jnp.minimum(count, 1)
  flags = ([ids >= 0] if pen.repetition else []) + [
      ((count >> k) & 1) == 1 for k in range(pen.count_bits)]
  flags = (jnp.stack(flags, axis=2) if flags else jnp.zeros((b, h, 0), bool))
  return ids, flags & (ids >= 0)[:, :, None], pen


def penalty_rows(c: controls.Controls, batch: int):
  """``(repetition, presence, frequency)`` f32 ``[B]`` each, the values
  that change nothing where a penalty is off (``pack_rows``' penalties)."""
  value = lambda x, off: (jnp.full((batch,), off, jnp.float32) if x is None
                          else jnp.asarray(x, jnp.float32))
  return (value(c.repetition_penalty, 1.0), value(c.presence_penalty, 0.0),
          value(c.frequency_penalty, 0.0))


def pass_controls(c: controls.Controls, hist: History, vocab_size: int):
  """The controls of the fused pass of a call with penalties: ``c`` without
  them, its allowed mask without the history ids (:func:`excluded_mask`)."""
  return dataclasses.replace(
      c, allowed_mask=excluded_mask(c, hist, vocab_size), repetition_penalty=None,
      presence_penalty=None, frequency_penalty=None, prompt_ids=None, output_ids=None)


def excluded_mask(c: controls.Controls, hist: History, vocab_size: int):
  """``c``'s allowed mask (all ids when None) without the history ids: the
  mask the fused pass runs with, so that it never scores an id whose logit
  a penalty changes (:func:`history_state` scores those)."""
  b, words = hist.ids.shape[0], -(-vocab_size // 32)
  base = (c.allowed_mask if c.allowed_mask is not None
          else jnp.full((b, words), 0xFFFFFFFF, jnp.uint32))
  valid = hist.ids >= 0
  bit = jnp.where(valid, jnp.uint32(1) << (hist.ids % 32).astype(jnp.uint32), 0)
  # The ids are distinct, so their bits are: adding them is OR-ing them.
  clear = jnp.zeros((b, words), jnp.uint32).at[
      jnp.arange(b)[:, None], jnp.where(valid, hist.ids // 32, 0)].add(bit.astype(jnp.uint32))
  return base & ~clear


def history_state(p: Problem, c: controls.Controls, hist: History, *,
                  vocab_offset=0, seen=None) -> ControlsState:
  """The :class:`ControlsState` of the history ids that lie in ``p.weight``'s
  rows (global ids from ``vocab_offset``): their logits from the gathered
  weight rows, transformed and penalized (:func:`controls.transform`), with
  the noise counters of their ids. With the excluded mask's pass
  (:func:`excluded_mask`) it covers every id once, so
  :func:`state_combine` of the two is the penalized row's state.

  Reads ``B x H`` weight rows (one per history id): the cost of penalties,
  against ``V`` rows for the pass. ``seen`` (bool ``[B, H]``): which ids the
  repetition penalty applies to (default: every listed id, which is in the
  history); ``hist.count`` says how often each is in the output.
  """
  local = hist.ids - vocab_offset
  ok = (hist.ids >= 0) & (local >= 0) & (local < p.weight_rows)
  l = _history_logits(p, jnp.clip(local, 0, p.weight_rows - 1))
  gid = jnp.where(ok, hist.ids, rules.INT_MAX)
  x = controls.transform(l, jnp.where(ok, hist.ids, 0), c, p.vocab_size,
                         history=(ok if seen is None else ok & seen, hist.count))
  x = jnp.where(ok, x, -jnp.inf)
  t = tempered(p, x)
  sc = pass_scores(p, c, x, t, jnp.where(ok, hist.ids, 0))          # [B, S, H]
  score, tok, best_t = rules.argbest(sc, gid[:, None, :], axis=2, carry=t[:, None, :])
  mx = jnp.max(t, axis=1)
  st = ControlsState(
      best_score=score, best_id=tok, best_t=best_t, lse_max=mx,
      lse_sum=jnp.sum(jnp.where(mx[:, None] == -jnp.inf, 0.0,
                                jnp.exp(t - mx[:, None])), axis=1))
  # The pass scores every id's raw logit (the history ids are excluded from
  # it by the mask only, which raw logits ignore).
  st = rl_state(c, st, t, gid=gid, raw_m=raw_count(p, c))
  if c.lists:
    m = candidate_count(p, c)
    vals, ids = top_m(t, gid, jnp.full((p.batch,), -jnp.inf), m)
    st = st._replace(cand_vals=vals, cand_ids=ids,
                     cand_bound=jnp.full((p.batch,), -jnp.inf))
  return st


def _history_logits(p: Problem, rows):
  """f32 logits ``[B, H]`` of each row's local vocabulary rows ``rows``
  (int32 ``[B, H]``), from the gathered weight rows."""
  if p.layout == "logits":
    return jnp.take_along_axis(p.weight, rows, axis=1).astype(jnp.float32)
  w = jnp.take(p.weight, rows, axis=0 if p.layout == "vd" else 1)  # [B, H, D] / [D, B, H]
  # A multiply and a row sum (not a dot): XLA fuses the gather into it and
  # reads each weight row once; the products are exact in f32 as the dot's.
  # The sum is parts_sum's fixed tree, so a row's logit (its raw
  # log-probability's) is the same bits whatever the batch (docs/design.md,
  # "Determinism and RL"). A quantized row converts exactly to f32; its
  # scale multiplies the sum, as problem.logits multiplies the dot.
  h = p.hidden.astype(jnp.float32)
  if p.layout == "vd":
    l = parts_sum(h[:, None, :] * w.astype(jnp.float32), axis=2)
  else:
    l = parts_sum(h.T[:, :, None] * w.astype(jnp.float32), axis=0)
  scale = p.scale_of(rows)
  return l if scale is None else l * scale


def per_sample(st: ControlsState, samples: int) -> ControlsState:
  """``st`` with ``samples`` bests per row: a noise-free pass's one best
  (``Controls.for_pass``) stands for every sample (only greedy rows read
  it, and their samples are all the argmax)."""
  if st.best_score.shape[1] == samples:
    return st
  rep = lambda a: jnp.broadcast_to(a, (a.shape[0], samples))
  return st._replace(best_score=rep(st.best_score), best_id=rep(st.best_id),
                     best_t=rep(st.best_t))


def samples_as_rows(p: Problem, samples: int) -> Problem:
  """The problem whose row ``s * B + b`` is sample ``s`` of row ``b``: the
  same hidden row, key and temperature, and that sample's counters, so the
  argmax of its row is that sample's token (for backends whose plain pass
  is cheaper than a pass with several samples per element)."""
  hi, lo = p.counters(samples)                                    # [S, B]
  tile = lambda a: jnp.tile(a, samples)
  return dataclasses.replace(
      p, hidden=jnp.tile(p.hidden, (samples, 1)), k0=tile(p.k0), k1=tile(p.k1),
      ctr_hi=hi.reshape(-1), ctr_lo=lo.reshape(-1),
      temperature=tile(p.temperature),
      key_data=(jnp.tile(p.key_data, (samples, 1)) if p.per_row_keys
                else p.key_data),
      row_base=None)                 # the counters are no longer the rows'


@jax.named_scope("stage2.certify")
def _certify(c: controls.Controls, cand_t, lse, complete, last,
             margin: float = _TOP_P_MARGIN):
  """Thresholds of the truncation rules from the top-M candidates.

  ``cand_t [B, M]`` (descending) holds every value of the row above
  ``last [B]``, an upper bound on the values not listed (ties with it may
  be unlisted). Returns ``(keep [B, M], decided [B], active [B])``: which
  candidates survive every rule; whether that set is exactly the row's
  kept set over the WHOLE vocabulary (every rule's threshold is known from
  the candidates, and at least one rule's kept set lies inside them, or the
  lists hold the whole row), so that sampling among the kept candidates is
  sampling the row; and whether any rule is on for the row. A row with no
  rule on keeps every id: it is decided only where the lists are complete
  (its token is otherwise the pass's own best, which :func:`finish` reads
  for such rows; a caller that samples from the candidates must not).
  Mirrors :func:`controls.keep_mask`.
  ``lse`` is the rows' online log-sum-exp ``(max, sum)``.
  Top-p's edge is keep_mask's own, bit for bit, where the lists hold the
  set its mass is measured over; elsewhere rows where the mass before a
  listed id is within ``margin`` (relative) of ``top_p`` are not certified
  (the normalizer's rounding could move the edge).
  """
  b, m = cand_t.shape
  top = cand_t[:, :1]
  keep = jnp.ones((b, m), bool)
  known = jnp.ones((b,), bool)
  inside = jnp.zeros((b,), bool)
  active = jnp.zeros((b,), bool)
  in_k = jnp.ones((b,), bool)
  # Each rule is "on" exactly where keep_mask applies it (NaN included).
  if c.top_k is not None:
    k = c.top_k
    on = ~(k <= 0)
    thr = jnp.take_along_axis(cand_t, jnp.clip(k - 1, 0, m - 1)[:, None], axis=1)[:, 0]
    thr = jnp.where(k > m, -jnp.inf, thr)           # only used when complete
    keep &= ~on[:, None] | (cand_t >= thr[:, None])
    known &= ~on | (k <= m) | complete
    in_k = ~on | complete | ((k <= m) & (last < thr))
    inside |= on & in_k
    active |= on
  # Min-p's kept set, a prefix of the list where it lies inside it; with
  # truncation_order="vllm" top-p's mass is measured over it too.
  mp_on = jnp.zeros((b,), bool)
  in_mp = jnp.zeros((b,), bool)
  if c.min_p is not None:
    mp = c.min_p
    mp_on = ~(mp <= 0)
    keep_min = ~mp_on[:, None] | (jnp.exp(cand_t - top) >= mp[:, None])
    in_mp = mp_on & (complete | (jnp.exp(last - top[:, 0]) < mp))
  if c.top_p is not None:
    pp = c.top_p
    on = ~(pp >= 1)
    # The mass before each listed id. Where the list holds the whole set
    # top-p's mass is measured over (top-k's, and with "vllm" min-p's, when
    # it lies in the candidates; the whole row when the lists are
    # complete), it is keep_mask's own expression on the same values, so
    # the same bits (controls.nucleus_terms): the edge is decided
    # exactly, however close to p. Elsewhere (top-p over a row the lists
    # do not hold) the normalizer is the online log-sum-exp's, whose
    # rounding differs from keep_mask's sum: rows with an id's mass within
    # ``margin`` of p take the exact path (docs/design.md, "The nucleus
    # edge, bit for bit").
    k_on = (c.top_k > 0) if c.top_k is not None else jnp.zeros((b,), bool)
    restrict_on, restrict_in = k_on, k_on & in_k
    if c.min_p is not None and c.truncation_order == "vllm":
      keep &= keep_min
      restrict_on, restrict_in = k_on | mp_on, restrict_in | in_mp
    tk = jnp.where(keep, cand_t, -jnp.inf)
    listed_set = restrict_in | complete
    z_all = lse[1] * jnp.where(lse[0] == -jnp.inf, 0.0, jnp.exp(lse[0] - top[:, 0]))
    sums, z_set = controls.nucleus_terms(tk)
    before = controls.mass_before(sums, jnp.where(listed_set, z_set, z_all))
    # keep_mask's threshold: the t of the n-th id, n the count of ids with
    # mass < p before them (at least 1). A count, not the smallest such t:
    # rounding may leave the mass before an id a little below the one
    # before its predecessor, and keep_mask counts.
    n_before = jnp.maximum(jnp.sum((before < pp[:, None]) & (tk > -jnp.inf), axis=1), 1)
    thr = jnp.take_along_axis(tk, (n_before - 1)[:, None], axis=1)[:, 0]
    keep &= ~on[:, None] | (tk >= thr[:, None])
    # The nucleus edge lies in the list if a listed id already has mass
    # >= p ranked before it (the mass before an id grows down the list, up to
    # an ulp of rounding, far inside the margin of `near` below).
    edge_inside = jnp.any((tk > -jnp.inf) & (before >= pp[:, None]), axis=1)
    near = ~listed_set & jnp.any((tk > -jnp.inf) & (jnp.abs(before - pp[:, None])
                                                    <= margin * pp[:, None]), axis=1)
    known &= ~on | ((restrict_in | (~restrict_on & edge_inside) | complete) & ~near)
    inside |= on & (complete | (last < thr))
    active |= on
  if c.min_p is not None:
    keep &= keep_min
    inside |= in_mp
    active |= mp_on
  # A row left with no finite candidate (e.g. a traced min_p > 1) keeps
  # nothing in keep_mask: the exact path decides it.
  nonempty = jnp.any(keep & (cand_t > -jnp.inf), axis=1)
  decided = known & (inside | complete) & nonempty
  return keep, decided, active


def _flat_rows(p: Problem, c: controls.Controls, st: ControlsState):
  """Rows whose every allowed ``t`` is zero, bool ``[B]``, from what stage 2
  knows without the logits: a zero hidden row (every logit ``+-0``, or NaN
  where a weight row or scale is not finite), transforms that keep zero
  (no logit bias; presence and frequency penalties 0 for the row: soft-cap,
  repetition penalty, mask and temperature map ``+-0`` to ``+-0`` or
  ``-inf``), and a pass whose max is 0 and whose sum of ``exp(t - max)``
  is exactly the count of allowed ids (:func:`_allowed_count`): each of
  them added ``exp(0) = 1``, so each was 0, whatever a backend's max, best
  and sum do with a NaN. Every truncation rule keeps all of such a
  row's allowed ids, which tie at its top: top-k keeps the ties at its
  k-th value, top-p every id equal to its last kept one and min-p every id
  with ``exp(t - max) = 1 >= m`` (min-p > 1, which keeps nothing, is
  excluded). So its kept set is the pass's whole row, though no candidate
  list holds it (docs/design.md, "Rows of equal logits")."""
  if p.layout == "logits" or c.logit_bias is not None:
    return jnp.zeros((p.batch,), bool)
  flat = (jnp.all(p.hidden == 0, axis=1) & (st.lse_max == 0)
          & (st.lse_sum == _allowed_count(p, c).astype(jnp.float32)))
  for penalty in (c.presence_penalty, c.frequency_penalty):
    if penalty is not None:
      flat &= penalty == 0
  if c.min_p is not None:
    flat &= c.min_p <= 1
  return flat


def _allowed_count(p: Problem, c: controls.Controls):
  """The ids below ``vocab_size`` that ``allowed_mask`` allows, int32 ``[B]``
  (all of them without a mask)."""
  if c.allowed_mask is None:
    return jnp.full((p.batch,), p.vocab_size, jnp.int32)
  bits = c.allowed_mask & controls.valid_bits(c.allowed_mask.shape[1], p.vocab_size)[None]
  return jnp.sum(lax.population_count(bits), axis=1, dtype=jnp.int32)


class _Rows(NamedTuple):
  """What :func:`finish` decides per row, step by step: ``tokens`` int32
  ``[S, B]``, their tempered logits ``t_tok [S, B]``, the kept set's
  log-sum-exp ``lse_kept [S, B]``, the row's ``lse_all [B]``, the top N
  ``(vals [B, N], ids [B, N])`` or None, ``fallback`` bool ``[B]``, the
  rows whose token the exact materialized path redoes, and with the RL
  outputs the entropies ``ent_all``/``ent_kept`` ``[B]`` and the kept set
  ``(ids [B, N], count [B])`` (None where not asked for). ``relist`` bool
  ``[B]``: rows whose token the pass decided but whose top-N list or kept
  set the candidates cannot certify; the exact path redoes their lists
  only, so that their token's floats stay the pass's, the bits
  :func:`score` finds for it (docs/design.md, "Determinism and RL")."""

  tokens: jax.Array
  t_tok: jax.Array
  lse_kept: jax.Array
  lse_all: jax.Array
  top: tuple | None
  fallback: jax.Array
  ent_all: jax.Array | None = None
  ent_kept: jax.Array | None = None
  kept: tuple | None = None
  relist: jax.Array | None = None

  @staticmethod
  def batch_axes(rows: "_Rows") -> "_Rows":
    """The batch axis of each field (for :func:`_redo_flagged`)."""
    pair = lambda x: None if x is None else (0, 0)
    one = lambda x: None if x is None else 0
    return _Rows(1, 1, 1, 0, pair(rows.top), 0, one(rows.ent_all), one(rows.ent_kept),
                 pair(rows.kept), 0)


class MergedLists(NamedTuple):
  """The merged candidate lists as :func:`_certify` reads them: ``vals``
  (descending) and ``ids`` ``[B, M]``, ``last [B]`` (no unlisted value is
  larger) and ``complete [B]`` (the lists hold the whole row)."""

  vals: jax.Array
  ids: jax.Array
  last: jax.Array
  complete: jax.Array


def finish(p: Problem, c: controls.Controls, st: ControlsState, *,
           axis: tuple[str, ...] | None = None, exact_top=None):
  """Tokens and log-probabilities from a controls state (any backend's).

  ``st`` is the state of this shard's rows (:func:`state_combine`'s form);
  with ``axis`` (inside ``shard_map``, the vocabulary sharded over it) the
  shards' states are gathered (one collective, O(B x M) bytes) and merged
  first. Then, in steps: truncated rows are decided on the candidates
  (:func:`_truncate`), the top N read off them (:func:`_top_n`), the rows
  neither can certify redone on the exact materialized path
  (:func:`_exact_path`; the rare uncertified rows gather the full logits
  over ``axis``), and the output assembled (:func:`_output`). Rows with
  nothing to sample (``allowed_mask`` allows nothing, every transformed
  logit is ``-inf``, or truncation keeps nothing) return ``-1``
  (log-probabilities NaN) unless ``c.samples_only`` (then the tokens are
  ``jax.random.categorical``'s): :func:`_nothing_to_sample`.

  Returns:
    ``(tokens int32 [S, B], SampleOutput or None, fallback bool [B])``:
    ``fallback`` marks the rows that took the materialized path.

  ``exact_top``: None, or ``flags bool [B] -> (vals f32 [B, N], ids
  int32 [B, N])``, the exact top N of ``t`` of the flagged rows in
  :func:`controls.top_n`'s order by work that is skipped when no row is
  flagged (a backend's early-exit kernels). Calls whose only uncertified
  rows are those of ``top_logprobs`` (no truncation rule) then take it
  instead of the conditional.
  """
  if axis:
    st = _gather_shards(st, axis, state_combine(c, candidate_count(p, c)))
  rows = _pass_rows(c, st)
  lists = merged_lists(p, c, st) if c.lists else None
  decision = None
  if c.truncates:
    rows, decision = _truncate_decision(p, c, st, lists, rows)
  if c.return_kept:
    rows = _kept_sets(c, st, lists, rows, decision)
  own_exact_top = (exact_top is not None and c.top_logprobs and not c.truncates
                   and not c.return_kept and not c.raw_top)
  if c.raw_top:
    rows = _raw_top_n(p, c, st, rows)
  elif c.top_logprobs:
    rows = _top_n(c, st, lists, rows, exact_top if own_exact_top else None)
  then = functools.partial(_finished, p, c, st, axis=axis)
  if (c.lists or c.raw_top) and not own_exact_top:
    return _exact_path(p, c, rows, axis, then=then)
  return then(rows)


def _finished(p: Problem, c: controls.Controls, st: ControlsState, rows: _Rows, *, axis):
  """finish's result from the decided rows: the output assembled
  (:func:`_output`, :func:`_raw_logprob`) and the rows with nothing to
  sample set (:func:`_nothing_to_sample`)."""
  out = _output(c, rows) if c.returns_output else None
  if out is not None and c.return_raw_logprobs:
    out = out._replace(logprob_raw=_raw_logprob(p, c, st, rows.tokens, axis))
  if not c.samples_only:
    rows, out = _nothing_to_sample(p, c, st, rows, out)
  return rows.tokens, out, rows.fallback | rows.relist


@jax.named_scope("stage2.gather_shards")
def _gather_shards(st: ControlsState, axis, combine) -> ControlsState:
  """Every vocabulary shard's state of these rows, merged in shard order
  (= id order: ties keep lower ids)."""
  parts = mesh.all_gather_tree(st, axis)
  n = jax.tree.leaves(parts)[0].shape[0]
  st = jax.tree.map(lambda a: a[0], parts)
  for i in range(1, n):
    st = combine(st, jax.tree.map(lambda a, i=i: a[i], parts))
  return st


@jax.named_scope("stage2.pass_rows")
def _pass_rows(c: controls.Controls, st: ControlsState) -> _Rows:
  """The rows as the pass left them: its best of each sample, no truncation."""
  tokens = st.best_id.T                                      # [S, B]
  # Rows with NaN or infinite t: the max is what jax.nn.logsumexp gives.
  lse_all = jnp.where(jnp.isfinite(st.lse_max), st.lse_max + jnp.log(st.lse_sum),
                      st.lse_max)
  ent = None
  if c.return_entropy:
    ent = jnp.log(st.lse_sum) - st.ent_sum / st.lse_sum
  return _Rows(tokens=tokens, t_tok=st.best_t.T,
               lse_kept=jnp.broadcast_to(lse_all, tokens.shape), lse_all=lse_all,
               top=None, fallback=jnp.zeros((tokens.shape[1],), bool),
               relist=jnp.zeros((tokens.shape[1],), bool),
               ent_all=ent, ent_kept=ent)


@jax.named_scope("stage2.merged_lists")
def merged_lists(p: Problem, c: controls.Controls, st: ControlsState) -> MergedLists:
  """The merged lists, with what is known of the values they do not hold.
  Values at or below the bound may have unlisted neighbours: only the
  values above it are known to be complete and in order; the lists hold
  -inf in their place (topm_merge)."""
  cand_t, bound = st.cand_vals, st.cand_bound
  if jax.default_backend() == "cpu":
    # XLA's CPU compiler turns a top_k into a sort and back into its fast
    # TopK call only if the sort is read through [0:k] slices; reading
    # single entries (the top, the k-th, the last) folds them into the
    # sort, which then stays a full sort of the chunk (B=4, V=4096: 2.5
    # ms of a 2.6 ms call). The barrier keeps those reads off the sort.
    cand_t = lax.optimization_barrier(cand_t)
  last = jnp.maximum(bound, cand_t[:, -1])
  complete = (bound == -jnp.inf) & ((candidate_count(p, c) >= p.total_rows)
                                    | (last == -jnp.inf))
  return MergedLists(cand_t, st.cand_ids, last, complete)


def _fixed_row_sum(x):
  return parts_sum(x, axis=-1)


def fixed_logsumexp(x):
  """``jax.nn.logsumexp(x, axis=1)``'s expression over ``x [B, M]`` (a row
  of candidates), its sum in :func:`~pallas_kernels.state.parts_sum`'s
  order: a row's bits do not follow the batch around it, as a ``jnp.sum``'s
  do on a GPU (XLA picks the reduction's order for the whole array's shape;
  docs/design.md, "Determinism and RL")."""
  m = jnp.max(x, axis=1)
  safe = jnp.where(jnp.isfinite(m), m, 0.0)
  return jnp.log(_fixed_row_sum(jnp.exp(x - safe[:, None]))) + safe


@jax.named_scope("stage2.kept_lse")
def _kept_lse(keep_t):
  """The kept candidates' log-sum-exp ``[B]`` (``keep_t [B, M]``: ``-inf``
  where not kept): :func:`fixed_logsumexp`, fenced like
  :func:`_kept_entropy`."""
  return lax.optimization_barrier(fixed_logsumexp(lax.optimization_barrier(keep_t)))


@jax.named_scope("stage2.kept_entropy")
def _kept_entropy(keep, vals):
  """The entropy ``[B]`` of the kept candidates (``keep`` over ``vals``
  ``[B, M]``), its sums in :func:`fixed_logsumexp`'s order, fenced so that
  it compiles alike in :func:`finish` and :func:`score` (their bits must
  agree; docs/design.md, "Determinism and RL")."""
  kept_t = lax.optimization_barrier(jnp.where(keep, vals, -jnp.inf))
  return lax.optimization_barrier(controls.entropy(kept_t, _fixed_row_sum))


class _Decision(NamedTuple):
  """How :func:`_truncate` decided: ``keep [B, M]`` over the candidates,
  ``use [B]`` (rows whose token it drew among them), ``active [B]`` (a rule
  on) and ``pick(keep)``, the draw among the kept candidates."""

  keep: jax.Array
  use: jax.Array
  active: jax.Array
  pick: object


def _truncate(p: Problem, c: controls.Controls, st: ControlsState, lists: MergedLists,
              rows: _Rows) -> _Rows:
  """Decides the truncated rows on the candidates: each sample's token among
  the kept candidates, its t and the kept log-sum-exp; rows the candidates
  cannot certify are marked for the exact path."""
  return _truncate_decision(p, c, st, lists, rows)[0]


def _truncate_decision(p: Problem, c: controls.Controls, st: ControlsState,
                       lists: MergedLists, rows: _Rows) -> tuple[_Rows, _Decision]:
  """:func:`_truncate`, with how it decided."""
  certify = functools.partial(_certify, cand_t=lists.vals, lse=(st.lse_max, st.lse_sum),
                              complete=lists.complete, last=lists.last)
  keep, decided, active = certify(c)
  sampled = p.temperature != 0
  # Rows whose rules keep their whole row are decided as rows with no rule
  # on, where the pass's best is their token: where it drew noise, and for
  # greedy rows (the argmax of x) where it did not (Controls.for_pass),
  # which need it only for their kept set (below, greedy rows are
  # certified without one).
  if c.for_pass().noise:
    active &= ~_flat_rows(p, c, st)
  elif c.needs_kept_set:
    active &= ~(_flat_rows(p, c, st) & ~sampled)
  # Rows with no rule on take the pass's best (``use`` below): certified.
  certified = ~active | decided
  # Rows with NaN or infinite logits: keep_mask's sorts and exp(t - max)
  # treat them in ways the candidates do not track; the exact path does.
  finite = ~active | jnp.isfinite(st.lse_max)
  certified &= finite
  if not c.needs_kept_set:  # greedy rows ignore truncation (argmax of x)
    certified |= ~sampled
  use = active & sampled & (st.lse_max > -jnp.inf)
  pick = functools.partial(_pick_kept, p, c.samples, lists, rows, use=use, active=active)
  tokens, t_tok, lse_kept = pick(keep)
  fallback = ~certified
  if c.top_p is not None and not c.needs_kept_set and not c.top_k_max:
    # With top-k on every row (top_k_max), a row whose top-k set the lists
    # hold has its top-p edge decided exactly (_certify), and one whose set
    # they do not hold is not decided at any p: the readings at p -/+ width
    # would decide no row.
    tokens, t_tok, fallback = _top_p_edge(c, certify, pick, finite, tokens, t_tok,
                                          fallback)
  ent_kept = rows.ent_kept
  if c.return_entropy:
    ent_kept = jnp.where(active, _kept_entropy(keep, lists.vals), rows.ent_kept)
  return (rows._replace(tokens=tokens, t_tok=t_tok, lse_kept=lse_kept,
                        fallback=rows.fallback | fallback, ent_kept=ent_kept),
          _Decision(keep=keep, use=use, active=active, pick=pick))


@jax.named_scope("stage2.pick_kept")
def _pick_kept(p: Problem, samples: int, lists: MergedLists, rows: _Rows, keep, *, use, active):
  """Tokens, their t and the kept log-sum-exp of each sample with ``keep``
  (``[B, M]``, over the candidates) applied, in the rows ``use`` (sampled,
  a rule on); the pass's elsewhere."""
  kept_t = jnp.where(keep, lists.vals, -jnp.inf)
  sc = perturbed(p, kept_t, kept_t, lists.ids, samples)               # [B, S, M]
  # The list is sorted by t, not id: ties of the perturbed score must go
  # to the lowest id (the combine rule), not the first list position. One
  # variadic row reduction (with the winner's t), not a max, then a min of
  # the ids that attain it, then a max of their t.
  _, tok, new_t = rules.argbest(sc, lists.ids[:, None], axis=2,
                                carry=lists.vals[:, None])          # [B, S]
  return (jnp.where(use[None], tok.T, rows.tokens),
          jnp.where(use[None], new_t.T, rows.t_tok),
          jnp.where(active[None], _kept_lse(kept_t)[None], rows.lse_kept))


@jax.named_scope("stage2.top_p_edge")
def _top_p_edge(c: controls.Controls, certify, pick, finite, tokens, t_tok, fallback):
  """Rows whose nucleus edge lies within rounding of top_p, decided anyway
  where they can be: the kept sets at p -/+ width are nested around the one
  at p, so if both give the same token (the edge ids rarely win), so does p.
  Not with logprobs: the kept log-sum-exp depends on the edge.

  Each of the two tokens is drawn from the candidates, so each kept set must
  be decided on them over the whole vocabulary (``decided``, not
  ``certified``): at p + width >= 1 top-p is off, its kept set is every id
  (or top-k's / min-p's), and the candidates alone hold it only if they hold
  the row (issue #42: a nucleus of 1628 ids, 128 listed). Computed on every
  call: a second, nested conditional around it cost more than these few
  small fusions (docs/performance.md, "The exact path's conditional")."""
  width = 2 * _TOP_P_MARGIN * c.top_p
  (k_lo, ok_lo, _), (k_hi, ok_hi, _) = (
      certify(dataclasses.replace(c, top_p=c.top_p + d), margin=0.0)
      for d in (-width, width))
  (tok_lo, t_lo, _), (tok_hi, _, _) = pick(k_lo), pick(k_hi)
  same = fallback & ok_lo & ok_hi & finite & jnp.all(tok_lo == tok_hi, axis=0)
  return (jnp.where(same[None], tok_lo, tokens), jnp.where(same[None], t_lo, t_tok),
          fallback & ~same)


@jax.named_scope("stage2.kept_sets")
def _kept_sets(c: controls.Controls, st: ControlsState, lists: MergedLists, rows: _Rows,
               decision: _Decision | None) -> _Rows:
  """Each row's kept set (``return_kept=N``): its N most likely ids and its
  size. Rows with a rule on read it off the kept candidates (certified with
  the token: :func:`_truncate_decision` flags the others); rows with none
  keep every id of finite t: their N most likely are the lists' top N where
  the N-th lies above ``last`` (as :func:`_top_n`), and the size is the
  pass's count of finite t."""
  n = c.return_kept
  ids, count = controls.kept_list(lists.vals, n, ids=lists.ids)
  count = st.finite_count
  certain = (lists.complete | (lists.vals[:, n - 1] > lists.last)) & jnp.isfinite(st.lse_max)
  fallback = ~certain
  if decision is not None:
    r = decision.active
    k_ids, k_count = controls.kept_list(jnp.where(decision.keep, lists.vals, -jnp.inf), n,
                                        ids=lists.ids)
    ids = jnp.where(r[:, None], k_ids, ids)
    count = jnp.where(r, k_count, count)
    fallback &= ~r
  return rows._replace(kept=(ids, count), relist=rows.relist | fallback)


def _raw_lse(st: ControlsState):
  """The raw logits' log-sum-exp ``[B]`` (``jax.nn.logsumexp``'s value for
  rows with non-finite values)."""
  return jnp.where(jnp.isfinite(st.raw_max), st.raw_max + jnp.log(st.raw_sum), st.raw_max)


@jax.named_scope("stage2.raw_top_n")
def _raw_top_n(p: Problem, c: controls.Controls, st: ControlsState, rows: _Rows) -> _Rows:
  """``top_logprobs_mode="raw"``: the N largest raw logits in
  :func:`controls.top_n`'s order off the raw lists, as log-probabilities
  (``rows.top`` then holds those, not logits). Certified as :func:`_top_n`
  certifies; the others take the exact path."""
  n = c.top_logprobs
  last = jnp.maximum(st.raw_bound, st.raw_vals[:, -1])
  complete = (st.raw_bound == -jnp.inf) & ((raw_count(p, c) >= p.total_rows)
                                            | (last == -jnp.inf))
  vals, ids = controls.top_n(st.raw_vals, n, ids=st.raw_ids)
  certain = (complete | (vals[:, n - 1] > last)) & jnp.isfinite(st.raw_max)
  return rows._replace(top=(vals - _raw_lse(st)[:, None], _raw_top_ids(vals, ids)),
                       relist=rows.relist | ~certain)


def _raw_top_ids(raw, ids):
  """``-1`` where the raw logit is ``-inf``, decided on the raw values: as
  log-probabilities a row of ``-inf`` reads NaN, and a finite logit beside
  a ``+inf`` one reads ``-inf`` (the reference keeps its id)."""
  return jnp.where(raw == -jnp.inf, -1, ids)


@jax.named_scope("stage2.top_n")
def _top_n(c: controls.Controls, st: ControlsState, lists: MergedLists, rows: _Rows,
           exact_top) -> _Rows:
  """The N largest t by (t descending, id ascending), controls.top_n's
  order, read off the lists. Certified where the N-th lies above ``last``
  (every value above it is listed, ties included), and for rows with finite
  logits (the exact path follows the reference). ``exact_top`` (see
  :func:`finish`) redoes the others here; else they join ``fallback``."""
  n = c.top_logprobs
  finite = jnp.isfinite(st.lse_max)
  v, i = lists.vals, lists.ids
  certain = lambda top: (lists.complete | (top[0][:, n - 1] > lists.last)) & finite
  if exact_top is None:
    # The lists are ordered by value only.
    top = controls.top_n(v, n, ids=i)
    return rows._replace(top=top, relist=rows.relist | ~certain(top))
  # Lists already in top_n's order (state.top_m(by_id=True)) are read as
  # they are; a row whose list is not (from a merge that keeps equal values
  # in any order) takes the exact kernels too.
  top = (v[:, :n], i[:, :n])
  in_order = jnp.all((v[:, :-1] > v[:, 1:]) | ((v[:, :-1] == v[:, 1:]) & (i[:, :-1] < i[:, 1:]))
                     | (v[:, 1:] == -jnp.inf), axis=1)
  flags = ~(certain(top) & in_order)
  vals, ids = exact_top(flags)
  top = (jnp.where(flags[:, None], vals, top[0]), jnp.where(flags[:, None], ids, top[1]))
  return rows._replace(top=top, relist=rows.relist | flags)


# The exact path redoes at most this many rows on their own (a compacted
# batch: one more read of W, a sort of this many rows); more fallback rows
# in one call redo the whole batch. Fallback rows are rare (about one in
# hundreds to thousands of rows, docs/performance.md, "Routes on the GPU"),
# so at large batches one of them used to cost a materialization of every
# row.
EXACT_ROWS = 8

# Batches of at most this many rows redo every row behind a two-way
# conditional. Larger ones nest a second choice in its taken branch:
# EXACT_ROWS compacted rows, or every row. When one row is flagged the
# compacted branch is cheaper (it sorts EXACT_ROWS rows, not every row), but
# the host updates and relaunches the CUDA graph of every branch on every
# call, flagged or not: up to 16 rows the single branch's smaller graph
# saves more host time a call than the nested one saves when a row is
# flagged (docs/performance.md, "The exact path's conditional").
EXACT_COND_ROWS = 16

# The bytes of one row group's f32 logits ``[rows, V]`` on the exact path
# beyond EXACT_ROWS flagged rows. XLA reserves every branch's buffers for
# every call, taken or not, so a branch that materialized all B rows made
# each call with truncation or top-N hold several ``[B, V]`` buffers; batches
# whose rows need more than this redo their flagged rows in groups of
# exact_group_rows(), one loop step each (docs/performance.md, "The exact
# path's conditional"). High enough that decode batches keep one
# materialization (about 1770 rows of a 152k vocabulary).
EXACT_GROUP_BYTES = 2**30

# Controls fields with one entry (or one row) per batch row.
_ROW_FIELDS = ("top_k", "top_p", "min_p", "allowed_mask", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "prompt_ids", "output_ids",
               "given_ids")


@jax.named_scope("stage2.exact_path")
def _exact_path(p: Problem, c: controls.Controls, rows: _Rows, axis, *, then=None):
  """The fallback rows redone from materialized logits (:func:`_materialized`,
  through :func:`_redo_flagged`), ``then`` applied to the rows (inside the
  conditional)."""
  samples = c.samples

  def redo(ps, cs, sub, flags):
    # flags: the rows redone here (the compacted batch's padding is not).
    sub = sub._replace(fallback=sub.fallback & flags, relist=sub.relist & flags)
    return _materialized(ps, cs, sub, lambda x, t, gid: perturbed(ps, x, t, gid, samples),
                         axis)

  return _redo_flagged(p, c, rows.fallback | rows.relist, rows, _Rows.batch_axes(rows), redo,
                       then=then)


def exact_group_rows(vocab_size: int) -> int:
  """Rows per group of the exact path's every-row branch: as many as
  :data:`EXACT_GROUP_BYTES` of f32 logits hold, at least :data:`EXACT_ROWS`."""
  return max(EXACT_ROWS, EXACT_GROUP_BYTES // (4 * vocab_size))


def _redo_flagged(p: Problem, c: controls.Controls, flags, state, axes, redo, *, then=None):
  """``redo(p, c, state, flags)`` for the rows ``flags`` marks, behind one
  conditional that skips it when no row needs it, and that redoes every row
  at once up to :data:`EXACT_COND_ROWS` rows; in larger batches a second
  conditional inside the first redoes only those rows (a compacted batch of
  :data:`EXACT_ROWS`) when there are that few, else every row at once, or,
  where the batch's logits would exceed :data:`EXACT_GROUP_BYTES`, the
  flagged rows in compacted groups of :func:`exact_group_rows`, one loop
  step each.

  ``state``: a pytree of per-row arrays whose batch axes are ``axes`` (a
  pytree of ints of its structure); ``redo`` returns it with the flagged
  rows replaced.

  On a GPU, XLA keeps such a conditional inside its CUDA graph (decided on
  the device) only if every op of its branches can live in a graph; else it
  copies the predicate to the host on every call, and nothing after it is
  launched until the copy lands (docs/performance.md, "The exact path's
  conditional"). Hence :func:`controls.keep_mask` sorts with two keys (never
  a CUB sort), and the rows are compacted by a prefix sum and a scatter, not
  an argsort. The sharded path's all-gather in the branch may still need
  the host. Inside the graph a conditional node has a cost of its own even
  with trivial branches, so the call meets one when no row is flagged; the
  nested one runs only when some row is.

  ``then`` (default: none): a function of the state applied inside every
  branch, so that the conditional's result is the caller's (finish puts
  the output's assembly there): work after the conditional waited for it
  to be launched apart from the graph (docs/performance.md, "The exact
  path's conditional")."""

  # The per-row arrays that need no per-row input (key words, counters,
  # controls given as one number) are made again inside the branches: as
  # operands XLA would materialize each on every call (same section of
  # docs/performance.md).
  p_in, c_in = problem.in_branch(p), controls.in_branch(c)

  if then is None:
    then = lambda st: st

  def every_row():
    return then(redo(p_in(), c_in(), state, flags))

  count = jnp.sum(flags, dtype=jnp.int32)
  group = exact_group_rows(p.vocab_size)
  if p.batch <= min(EXACT_COND_ROWS, group):
    return lax.cond(count > 0, every_row, lambda: then(state))

  def flagged_first(size):
    # The flagged rows' indices first (a prefix sum), padded with B (which
    # gathers clip and scatters drop) to ``size`` entries.
    pos = jnp.cumsum(flags, dtype=jnp.int32) - 1
    return jnp.full((size,), p.batch, jnp.int32).at[jnp.where(flags, pos, size)].set(
        jnp.arange(p.batch, dtype=jnp.int32), mode="drop")

  def redo_rows(st, idx):
    # Rows idx (B: none) redone as a batch of their own, put back into st.
    take = lambda a, axis: jnp.take(a, idx, axis=axis, mode="clip")
    ps, cs = _take_rows(p_in(), c_in(), idx)
    new = redo(ps, cs, jax.tree.map(take, st, axes), take(flags, 0) & (idx < p.batch))
    put = lambda a, b, axis: (a.at[idx].set(b, mode="drop") if axis == 0
                              else a.at[:, idx].set(b, mode="drop"))
    return jax.tree.map(put, st, new, axes)

  def few_rows():
    return then(redo_rows(state, flagged_first(EXACT_ROWS)))

  def in_groups():
    groups = -(-p.batch // group)
    order = flagged_first(groups * group)
    step = lambda g, st: redo_rows(st, lax.dynamic_slice(order, (g * group,), (group,)))
    return then(lax.fori_loop(0, (count + group - 1) // group, step, state))

  many = every_row if p.batch <= group else in_groups
  some_rows = lambda: lax.cond(count <= EXACT_ROWS, few_rows, many)
  return lax.cond(count > 0, some_rows, lambda: then(state))


def _take_rows(p: Problem, c: controls.Controls, idx):
  """The problem and controls of batch rows ``idx`` (clipped)."""
  take = lambda a: jnp.take(a, idx, axis=0, mode="clip")
  ps = dataclasses.replace(
      p, hidden=take(p.hidden), k0=take(p.k0), k1=take(p.k1), ctr_hi=take(p.ctr_hi),
      ctr_lo=take(p.ctr_lo), temperature=take(p.temperature),
      key_data=take(p.key_data) if p.per_row_keys else p.key_data,
      # Given logits (problem.prepare_logits) are rows of their own.
      weight=take(p.weight) if p.layout == "logits" else p.weight,
      row_base=None)                 # the counters are no longer rows row_base ..
  cs = dataclasses.replace(c, **{name: take(getattr(c, name)) for name in _ROW_FIELDS
                                 if getattr(c, name) is not None})
  return ps, cs


@jax.named_scope("stage2.output")
def _output(c: controls.Controls, rows: _Rows) -> controls.SampleOutput:
  """The :class:`~flashsample_jax.controls.SampleOutput` of the decided rows."""
  out = controls.SampleOutput(rows.tokens, None, None, None)
  if c.return_logprobs:
    out = out._replace(logprob=rows.t_tok - rows.lse_all[None],
                       logprob_truncated=controls.truncated_logprob(rows.t_tok, rows.lse_kept),
                       logsumexp=jnp.broadcast_to(rows.lse_all, rows.tokens.shape))
  if rows.top is not None:
    vals, ids = rows.top       # raw_top: log-probabilities and ids (_raw_top_n)
    out = out._replace(top_ids=ids if c.raw_top else jnp.where(vals == -jnp.inf, -1, ids),
                       top_logprobs=vals if c.raw_top else vals - rows.lse_all[:, None])
  if c.return_entropy:
    out = out._replace(entropy=rows.ent_all, entropy_truncated=rows.ent_kept)
  if c.return_kept:
    out = out._replace(kept_ids=rows.kept[0], kept_count=rows.kept[1])
  return out


@jax.named_scope("stage2.raw_logprob")
def _raw_logprob(p: Problem, c: controls.Controls, st: ControlsState, tokens, axis):
  """``logprob_raw [S, B]``: each token's raw logit (soft-capped, from its
  own weight row as :func:`history_state` scores ids; under ``axis`` from
  the shard that holds it) minus the raw logits' log-sum-exp; NaN for
  ``-1``."""
  # sample and score_tokens compute this in two programs, and a token that
  # sample drew must score with the same bits. The barriers fence the
  # state's reductions and the row's gather-and-sum from what surrounds
  # them, so XLA cannot fuse them differently in the two (on a GPU it did:
  # a few ulp in a few percent of rows; docs/design.md, "Determinism and RL").
  raw_max, raw_sum, tok = lax.optimization_barrier((st.raw_max, st.raw_sum, tokens.T))
  lse = jnp.where(jnp.isfinite(raw_max), raw_max + jnp.log(raw_sum), raw_max)
  offset = mesh.MeshAxes(vocab=axis).vocab_offset(p.weight_rows) if axis else 0
  local = tok - offset
  ok = (tok >= 0) & (local >= 0) & (local < p.weight_rows)
  l = lax.optimization_barrier(_history_logits(p, jnp.clip(local, 0, p.weight_rows - 1)))
  raw = jnp.where(ok, controls.softcapped(l, c), 0.0)
  if axis:   # one shard holds each token's row; the others add 0
    raw = jnp.sum(mesh.all_gather_invariant(raw, axis), axis=0)
  return jnp.where(tok >= 0, raw - lse[:, None], jnp.nan).T


@jax.named_scope("stage2.nothing_to_sample")
def _nothing_to_sample(p: Problem, c: controls.Controls, st: ControlsState,
                       rows: _Rows, out):
  """Rows with nothing to sample return -1 (the reference's rule), their
  log-probabilities NaN. Every transformed logit -inf: the merged best score
  is -inf only then (the noise is finite; greedy rows score x). A sampled
  row whose logits are not all -inf but that truncation leaves empty (a
  traced min_p > 1, a +inf logit under min_p) is never certified on the
  candidates (they vouch for a kept top id), and the exact path returns -1
  for it."""
  empty = st.best_score[:, 0] == -jnp.inf
  masked = None
  if c.allowed_mask is not None:
    masked = controls.none_allowed(c.allowed_mask, p.vocab_size)
    empty |= masked
  tokens = jnp.where(empty[None], -1, rows.tokens)
  if out is not None:
    nan = lambda a, e=tokens < 0: None if a is None else jnp.where(e, jnp.nan, a)
    out = out._replace(tokens=tokens, logprob=nan(out.logprob),
                       logprob_truncated=nan(out.logprob_truncated),
                       logprob_raw=nan(out.logprob_raw))
    if out.kept_ids is not None:
      out = out._replace(kept_ids=jnp.where(empty[:, None], -1, out.kept_ids),
                         kept_count=jnp.where(empty, 0, out.kept_count))
    if out.top_logprobs is not None and masked is not None and not c.raw_top:
      out = out._replace(top_logprobs=nan(out.top_logprobs, masked[:, None]))
  return rows._replace(tokens=tokens), out


def materialized_rows(p: Problem, c: controls.Controls, axis=None):
  """``(x, t, kept, gid)`` of every row from materialized logits: the
  transformed logits ``x [B, vocab_size]``, the tempered ``t``, ``t`` where
  :func:`controls.keep_mask` keeps it (else ``-inf``) and the ids. With
  ``axis``, every shard's logits are gathered first (in global id order)."""
  l = problem.logits(p.hidden, p.weight, p.layout, p.weight_scale)  # [B, local rows]
  if axis:   # every shard's logits, in global id order
    l = jnp.moveaxis(mesh.all_gather_invariant(l, axis), 0, 1).reshape(p.batch, -1)
  gid = lax.iota(jnp.int32, l.shape[1])
  hist = controls.dense_history(c, p.batch, l.shape[1]) if c.penalizes else None
  x = controls.transform(l, gid, c, p.vocab_size, history=hist)[:, :p.vocab_size]
  gid = gid[:p.vocab_size]
  # One value of t for keep_mask's sort and its comparisons (as in the
  # reference): copies of t recomputed in two fusions can round apart by an
  # ulp, and a row could then keep nothing.
  t = lax.optimization_barrier(tempered(p, x))
  kept = jnp.where(controls.keep_mask(t, c), t, -jnp.inf)
  # Materialized once for all its readers: in each exact path (finish's,
  # score's) they then read the same values (docs/design.md, "Determinism
  # and RL").
  return (x, t, lax.optimization_barrier(kept), gid)


def materialized_raw_top(p: Problem, c: controls.Controls, axis=None):
  """``top_logprobs_mode="raw"``'s exact path: the N largest raw logits of
  every row from materialized logits (gathered over ``axis``), as
  log-probabilities, and their ids."""
  l = problem.logits(p.hidden, p.weight, p.layout, p.weight_scale)
  if axis:
    l = jnp.moveaxis(mesh.all_gather_invariant(l, axis), 0, 1).reshape(p.batch, -1)
  raw = controls.raw_logits(l, lax.iota(jnp.int32, l.shape[1]), c, p.vocab_size)
  raw = raw[:, :p.vocab_size]
  vals, ids = controls.top_n(raw, c.top_logprobs)
  return vals - jax.nn.logsumexp(raw, axis=1)[:, None], _raw_top_ids(vals, ids)


def draw_kept(p: Problem, x, t, kept, gid, perturbed):
  """Each sample's token among the kept ids (``[B, S]``) and its t: ``-1``
  for a sampled row that keeps no id (its t is then id 0's; finish's rule),
  while greedy rows take the argmax of x whatever the rules keep."""
  j = jnp.argmax(perturbed(x, kept, gid), axis=2)                # [B, S]
  none = (p.temperature != 0) & jnp.all(kept == -jnp.inf, axis=1)
  j = jnp.where(none[:, None], -1, j)
  return j, jnp.take_along_axis(t, jnp.maximum(j, 0), axis=1)


def _materialized(p: Problem, c: controls.Controls, rows: _Rows, perturbed, axis) -> _Rows:
  """The exact path: full logits, :func:`controls.keep_mask`. Rows
  ``rows.fallback`` take every result from them, rows ``rows.relist``
  their lists only (top N, kept set); the other rows' results are kept."""
  r = rows.fallback
  listed = r | rows.relist
  x, t, kept, gid = materialized_rows(p, c, axis)
  j, new_t = draw_kept(p, x, t, kept, gid, perturbed)
  top = rows.top
  if top is not None:
    # controls.top_n sorts (no lax.top_k, which could take the conditional
    # around this branch to the host on every call).
    if c.raw_top:
      top_t, top_i = materialized_raw_top(p, c, axis)
    else:
      top_t, top_i = controls.top_n(t, top[0].shape[1])
      # A row redone for its list alone keeps its tokens' t from the pass
      # (their log-probabilities'): in its list too, where they are listed.
      # (The pass reports a token's t only with log-probabilities.)
      for tok, tt in zip(rows.tokens, rows.t_tok) if c.return_logprobs else ():
        own = (top_i == tok[:, None]) & ~r[:, None]
        top_t = jnp.where(own, tt[:, None], top_t)
    top = (jnp.where(listed[:, None], top_t, top[0]),
           jnp.where(listed[:, None], top_i, top[1]))
  if rows.ent_all is not None:
    rows = rows._replace(ent_all=jnp.where(r, controls.entropy(t), rows.ent_all),
                         ent_kept=jnp.where(r, controls.entropy(kept), rows.ent_kept))
  if rows.kept is not None:
    ids, count = controls.kept_list(kept, rows.kept[0].shape[1])
    rows = rows._replace(kept=(jnp.where(listed[:, None], ids, rows.kept[0]),
                               jnp.where(listed, count, rows.kept[1])))
  return rows._replace(
      tokens=jnp.where(r[None], j.T.astype(jnp.int32), rows.tokens),
      t_tok=jnp.where(r[None], new_t.T, rows.t_tok),
      lse_kept=jnp.where(r[None], jax.nn.logsumexp(kept, axis=1)[None], rows.lse_kept),
      lse_all=jnp.where(r, jax.nn.logsumexp(t, axis=1), rows.lse_all),
      top=top)


# -- scoring given tokens (flashsample_jax.score_tokens) -------------------------


class Scores(NamedTuple):
  """What :func:`score` finds per row (every field ``[B]``): the given
  id's tempered logit ``t_tok``, the row's log-sum-exp ``lse_all``, the
  kept set's ``lse_kept``, whether the id is in the kept set ``in_kept``,
  the entropies ``ent_all``/``ent_kept`` and the raw log-probability
  ``logprob_raw``."""

  t_tok: jax.Array
  lse_all: jax.Array
  lse_kept: jax.Array
  in_kept: jax.Array
  ent_all: jax.Array
  ent_kept: jax.Array
  logprob_raw: jax.Array


def score(p: Problem, c: controls.Controls, st: ControlsState, *, axis=None) -> Scores:
  """The scores of each row's given id (``c.given_ids``) from a noise-free
  pass's state: the same steps and the same expressions as :func:`finish`
  (the kept set certified on the candidates, the rest on the exact path),
  so that a token :func:`finish` drew gets the log-probabilities it
  reported, bit for bit, from the same pass."""
  if axis:
    st = _gather_shards(st, axis, state_combine(c, candidate_count(p, c)))
  rows = _pass_rows(c, st)
  # NaN-safe: a NaN token (a row of NaN logits, sampled without
  # truncation) is the token sample() returned, scored NaN as it reported.
  in_kept = ~(st.given_t == -jnp.inf)
  sc = Scores(t_tok=st.given_t, lse_all=rows.lse_all, lse_kept=rows.lse_all,
              in_kept=in_kept, ent_all=rows.ent_all, ent_kept=rows.ent_kept,
              logprob_raw=_raw_logprob(p, c, st, c.given_ids[None], axis)[0])
  if not c.truncates:
    return sc
  lists = merged_lists(p, c, st)
  keep, decided, active = _certify(c, lists.vals, (st.lse_max, st.lse_sum),
                                   lists.complete, lists.last)
  active &= ~_flat_rows(p, c, st)      # the kept set is the whole row
  certified = ~active | (decided & jnp.isfinite(st.lse_max))
  kept_t = jnp.where(keep, lists.vals, -jnp.inf)
  listed = jnp.any(keep & (lists.vals > -jnp.inf) & (lists.ids == c.given_ids[:, None]),
                   axis=1)
  sc = sc._replace(lse_kept=jnp.where(active, _kept_lse(kept_t), sc.lse_all),
                   in_kept=jnp.where(active, listed, in_kept),
                   ent_kept=jnp.where(active, _kept_entropy(keep, lists.vals), sc.ent_kept))

  def redo(ps, cs, sub, flags):
    x, t, kept, gid = materialized_rows(ps, cs, axis)
    g = jnp.clip(cs.given_ids, 0, t.shape[1] - 1)[:, None]
    tk = jnp.take_along_axis(kept, g, axis=1)[:, 0]
    new = Scores(t_tok=jnp.take_along_axis(t, g, axis=1)[:, 0],
                 lse_all=jax.nn.logsumexp(t, axis=1),
                 lse_kept=jax.nn.logsumexp(kept, axis=1), in_kept=~(tk == -jnp.inf),
                 ent_all=controls.entropy(t), ent_kept=controls.entropy(kept),
                 logprob_raw=sub.logprob_raw)
    return jax.tree.map(lambda a, b: jnp.where(flags, a, b), new, sub)

  return _redo_flagged(p, c, ~certified, sc, Scores(0, 0, 0, 0, 0, 0, 0), redo)


# -- speculative verification (flashsample_jax.speculative) ---------------------


class DraftRows(NamedTuple):
  """What stage 2 decides per row of a verification, every field ``[B]``:

  ``token``/``t_token``: the row's sample with its draft id among the ids
  (:func:`finish`'s token, that of ``fs.sample``) and its tempered logit;
  ``residual``/``t_residual``: the sample with the same noise over the kept
  ids but the draft id (the one-hot rule's draw at a rejection; ``-1``
  where the draft is the only kept id); ``t_draft``: the draft id's
  tempered logit (``-inf`` for no draft, ``-1``, or a disallowed one);
  ``draft_kept``: whether truncation keeps it; ``lse_kept``: the kept
  set's log-sum-exp (so the draft's probability is ``exp(t_draft -
  lse_kept)`` where kept)."""

  token: jax.Array
  t_token: jax.Array
  residual: jax.Array
  t_residual: jax.Array
  t_draft: jax.Array
  draft_kept: jax.Array
  lse_kept: jax.Array


def draft_state(p: Problem, c: controls.Controls, draft, *, vocab_offset=0) -> ControlsState:
  """The :class:`ControlsState` of each row's draft id alone (int32 ``[B]``,
  ``-1`` for none), from its own weight row as :func:`history_state` scores
  history ids, penalized where it is in the row's history (its count from
  ``output_ids``)."""
  seen = jnp.zeros(draft.shape, bool)
  count = jnp.zeros(draft.shape, jnp.int32)
  valid = draft >= 0
  if c.penalizes:
    if c.prompt_ids is not None:
      seen |= jnp.any(c.prompt_ids == draft[:, None], axis=1)
    if c.output_ids is not None:
      count = jnp.sum(c.output_ids == draft[:, None], axis=1, dtype=jnp.int32)
      seen |= count > 0
  hist = History(jnp.where(valid, draft, -1)[:, None], (count * valid)[:, None])
  return history_state(p, c, hist, vocab_offset=vocab_offset, seen=seen[:, None])


def finish_drafts(p: Problem, c: controls.Controls, st_without: ControlsState,
                  st_draft: ControlsState, draft, *, axis=None) -> DraftRows:
  """Stage 2 of a verification: :func:`finish`'s steps over the state of the
  whole vocabulary (the pass without each row's draft id, ``st_without``,
  merged with the draft's own, ``st_draft``: :func:`draft_state`), plus the
  draw without the draft and the draft's probability.

  ``c``: one sample, ``return_logprobs=True`` (the kept log-sum-exp is
  needed exactly, so no top-p edge shortcut). With ``axis`` the shards'
  states are gathered first, as in :func:`finish`."""
  combine = state_combine(c, candidate_count(p, c))
  if axis:
    st_without = _gather_shards(st_without, axis, combine)
    st_draft = _gather_shards(st_draft, axis, combine)
  st = combine(st_without, st_draft)
  rows = _pass_rows(c, st)
  t_draft = st_draft.lse_max            # the one listed id's t, or -inf
  residual, t_residual = st_without.best_id[:, 0], st_without.best_t[:, 0]
  kept = t_draft > -jnp.inf
  if c.truncates:
    lists = merged_lists(p, c, st)
    rows, dec = _truncate_decision(p, c, st, lists, rows)
    listed = lists.ids == draft[:, None]
    kept = jnp.where(dec.active, jnp.any(dec.keep & listed, axis=1), kept)
    tok_y, t_y, _ = dec.pick(dec.keep & ~listed)
    residual = jnp.where(dec.use, tok_y[0], residual)
    t_residual = jnp.where(dec.use, t_y[0], t_residual)
  out = DraftRows(token=rows.tokens[0], t_token=rows.t_tok[0], residual=residual,
                  t_residual=t_residual, t_draft=t_draft, draft_kept=kept,
                  lse_kept=rows.lse_kept[0])
  if c.truncates:
    def redo(ps, cs, sub, flags):
      sub_out, sub_draft = sub
      return _materialized_drafts(ps, cs, flags, sub_draft, sub_out, axis), sub_draft
    out, _ = _redo_flagged(p, c, rows.fallback, (out, draft),
                           (DraftRows(*(0,) * len(DraftRows._fields)), 0), redo)
  # Nothing to sample (finish's rule): -1; no residual where only the draft
  # was left (its probability is then 1).
  rows, _ = _nothing_to_sample(p, c, st, rows._replace(tokens=out.token[None]), None)
  return out._replace(token=rows.tokens[0],
                      residual=jnp.where(out.t_residual == -jnp.inf, -1, out.residual))


def _materialized_drafts(pb: Problem, c: controls.Controls, rows, draft, out: DraftRows,
                         axis) -> DraftRows:
  """:func:`finish_drafts`'s fields of ``rows`` from materialized logits."""
  perturb = lambda x, t, gid: perturbed(pb, x, t, gid, 1)
  x, t, kept_t, gid = materialized_rows(pb, c, axis)
  tok, t_tok = draw_kept(pb, x, t, kept_t, gid, perturb)
  without = jnp.where(gid[None] == draft[:, None], -jnp.inf, kept_t)
  res, t_res = draw_kept(pb, x, t, without, gid, perturb)
  d = jnp.clip(draft, 0, t.shape[1] - 1)[:, None]
  kept = (draft >= 0) & (jnp.take_along_axis(kept_t, d, axis=1)[:, 0] > -jnp.inf)
  new = DraftRows(token=tok[:, 0].astype(jnp.int32), t_token=t_tok[:, 0],
                  residual=res[:, 0].astype(jnp.int32),
                  t_residual=jnp.where(res[:, 0] < 0, -jnp.inf, t_res[:, 0]),
                  t_draft=out.t_draft, draft_kept=kept,
                  lse_kept=jax.nn.logsumexp(kept_t, axis=1))
  return jax.tree.map(lambda a, b: jnp.where(rows, a, b), new, out)
