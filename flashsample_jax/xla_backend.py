"""The ``xla`` backend: pure JAX, streams over vocabulary chunks.

Each step of a ``fori_loop`` computes the logits of one chunk of the
vocabulary, adds the noise and keeps a running best ``(score, id)`` per row,
so no ``[B, V]`` array is ever live. Runs on any JAX device and is the
fallback for ``backend="auto"``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from flashsample_jax import _core, _validate, controls, noise
from flashsample_jax._validate import Problem

# Elements of the [B, Vc] chunk. On a GPU 2**22 f32 values (16 MiB of
# logits, about as much again for the scores): measured on an H200
# (PERF_LOG.md), 2**20 left the GEMMs too small (B=256: 1.7x slower). On a
# CPU, where each chunk's slice of W is a copy, 2**20 keeps memory small.
_CHUNK_ELEMENTS = {"gpu": 2**22}
_DEFAULT_CHUNK_ELEMENTS = 2**20
_MIN_CHUNK = 512


def _platform() -> str:
  return jax.default_backend()


def chunk_size(batch: int, rows: int) -> int:
  """Vocabulary rows per chunk: a fixed number of elements, a multiple of 128."""
  elements = _CHUNK_ELEMENTS.get(_platform(), _DEFAULT_CHUNK_ELEMENTS)
  c = max(_MIN_CHUNK, elements // max(batch, 1))
  c = (c // 128) * 128
  return min(c, rows)


# How _stream walks the chunks (measured on an H200, benchmarks/PERF_LOG.md):
# on a GPU, static slices of W fuse into XLA's GEMM, while a fori_loop's
# dynamic slice is copied out of W first (a [chunk, D] copy per step: 2.7x
# slower at B=64). So there chunks are unrolled, each one's matmul ordered
# after the previous chunk's result by an optimization barrier (else XLA may
# run every chunk's matmul first and hold all their outputs at once). On a
# CPU a static slice is a copy too and unrolling only raises memory, and past
# MAX_UNROLLED chunks the loop keeps the program small.
MAX_UNROLLED = {"gpu": 32}


def _stream(p: Problem, block, combine, vc: int):
  """Folds ``block(hidden, w_chunk, start, width)`` over the vocabulary.

  The first chunk seeds the state (rather than constants): in the loop form
  the carry then varies over the same shard_map axes as the data, which
  shard_map(check_vma=True) requires.
  """
  rows = p.weight_rows
  axis = 0 if p.layout == "vd" else 1
  n_full = rows // vc
  state = block(p.hidden, lax.slice_in_dim(p.weight, 0, vc, axis=axis), 0, vc)

  def step(state, w, start, width):
    hidden, state = lax.optimization_barrier((p.hidden, state))
    return combine(state, block(hidden, w, start, width))

  if n_full <= MAX_UNROLLED.get(_platform(), 0):
    for i in range(1, n_full):
      w = lax.slice_in_dim(p.weight, i * vc, (i + 1) * vc, axis=axis)
      state = step(state, w, i * vc, vc)
  else:
    def body(i, state):
      start = i * vc
      w = lax.dynamic_slice_in_dim(p.weight, start, vc, axis=axis)
      return combine(state, block(p.hidden, w, start, vc))
    state = lax.fori_loop(1, n_full, body, state)
  tail = rows - n_full * vc
  if tail:
    w = lax.slice_in_dim(p.weight, n_full * vc, rows, axis=axis)
    state = step(state, w, n_full * vc, tail)
  return state


def candidates(p: Problem, *, vocab_offset=0, chunk: int | None = None):
  """Best ``(score f32 [B], global id int32 [B])`` over ``p.weight``'s rows.

  Args:
    p: the validated problem.
    vocab_offset: global vocabulary id of the weight's first row (non-zero
      when ``weight`` is one shard of a vocabulary-sharded head).
    chunk: vocabulary rows per step; default :func:`chunk_size`.
  """
  vc = min(chunk or chunk_size(p.batch, p.weight_rows), p.weight_rows)
  offset = jnp.asarray(vocab_offset, jnp.int32)

  def block(hidden, w, start, width):
    gid = offset + start + lax.iota(jnp.int32, width)
    l = _core.logits(hidden, w, p.layout)
    s = _core.scores(l, gid, p.k0, p.k1, p.ctr_hi, p.ctr_lo, p.temperature,
                     p.vocab_size)
    return _core.row_best(s, gid)

  return _stream(p, block, _core.combine, vc)


# -- sampling controls ---------------------------------------------------------

# Candidates kept per row for truncation (top-k / top-p / min-p): the M
# largest tempered logits. Rows whose kept set the candidates cannot certify
# take the exact materialized fallback (see sample_with_controls).
CANDIDATES = 128
# Relative distance of the mass before an id from top_p below which a row is
# not certified from the candidates (f32 sums over ~1e5 terms differ by far
# less); such rows are rare and take the exact path.
_TOP_P_MARGIN = 1e-4


def _sample_counters(p: Problem, samples: int, global_batch: int):
  """Base noise counters ``(hi, lo) uint32 [B, S]`` of every sample (DESIGN.md
  section 1).

  Scalar key: ``(s * B + row) * vocab_size`` with ``B`` the global batch and
  ``row`` the global row; per-row keys: ``s * vocab_size``. Sample 0 is the
  problem's own ``(ctr_hi, ctr_lo)``.
  """
  if samples == 1:
    return p.ctr_hi[:, None], p.ctr_lo[:, None]
  s = lax.iota(jnp.uint32, samples - 1) + jnp.uint32(1)           # [S - 1]
  if p.per_row_keys:
    hi, lo = noise.mul_u32_wide(s, jnp.uint32(p.vocab_size))
    hi, lo = (jnp.broadcast_to(a, (p.batch, samples - 1)) for a in (hi, lo))
  else:
    rows = (jnp.arange(p.batch, dtype=jnp.uint32) + jnp.asarray(p.row_offset, jnp.uint32))
    rows = rows[:, None] + s[None] * jnp.uint32(global_batch)
    hi, lo = noise.mul_u32_wide(rows, jnp.uint32(p.vocab_size))
  return (jnp.concatenate([p.ctr_hi[:, None], hi], axis=1),
          jnp.concatenate([p.ctr_lo[:, None], lo], axis=1))


def _tempered(p: Problem, x):
  t = p.temperature[:, None]
  return x / jnp.where(t == 0, 1.0, t)          # greedy rows: T = 1


def _perturbed(p: Problem, x, t, gid, samples: int, global_batch: int):
  """Scores ``[B, S, W]`` whose argmax over the last axis is each sample:
  ``t + g`` (greedy rows: ``x``).

  ``x`` and ``t`` are ``[B, W]``, ``gid`` ``[W]`` or ``[B, W]``. One
  expression for every sample, so the program does not grow with S; XLA
  fuses the noise into the reduction that consumes it.
  """
  hi, lo = _sample_counters(p, samples, global_batch)
  hi, lo = noise.add_u32(hi[:, :, None], lo[:, :, None],
                         gid.astype(jnp.uint32)[..., None, :])
  g = noise.gumbel(p.k0[:, None, None], p.k1[:, None, None], hi, lo)
  return jnp.where(p.temperature[:, None, None] == 0, x[:, None], t[:, None] + g)


def _lse_merge(a, b):
  """Merges online log-sum-exp states ``(max, sum of exp(t - max))``."""
  m = jnp.maximum(a[0], b[0])
  scale = lambda mx: jnp.where(m == -jnp.inf, 0.0, jnp.exp(mx - m))
  return m, a[1] * scale(a[0]) + b[1] * scale(b[0])


def _topm_merge(a, b, m: int):
  """Merges candidate lists ``(vals [B, *], ids, bound [B])``: the ``m``
  largest values (ties keep ``a``, lower ids, first) and the larger bound.

  ``bound`` is an upper bound on every value of the row that is in no list
  (``-inf`` for the xla backend's exact per-chunk lists; the mosaic kernel's
  fixed-depth lists can overflow). Listed values at or below the bound are
  ``-inf`` (they may have unlisted equals or neighbours): every producer of
  a list keeps that, so :func:`finish_controls` reads the lists as they are.
  """
  vals = jnp.concatenate([a[0], b[0]], axis=1)
  ids = jnp.concatenate([a[1], b[1]], axis=1)
  bound = jnp.maximum(a[2], b[2])
  vals, j = lax.top_k(jnp.where(vals > bound[:, None], vals, -jnp.inf), m)
  return vals, jnp.take_along_axis(ids, j, axis=1), bound


def _certify(p: Problem, c: controls.Controls, cand_t, lse, complete, last,
             margin: float = _TOP_P_MARGIN):
  """Thresholds of the truncation rules from the top-M candidates.

  ``cand_t [B, M]`` (descending) holds every value of the row above
  ``last [B]``, an upper bound on the values not listed (ties with it may
  be unlisted). Returns ``(keep [B, M], certified [B])``: which candidates
  survive every rule, and whether that set is exactly the rows' kept set
  (every rule's threshold is known from the candidates, and at least one
  rule's kept set lies inside them). Mirrors :func:`controls.keep_mask`.
  Rows where the mass before a listed id is within ``margin`` (relative) of
  ``top_p`` are not certified (rounding could move the nucleus edge).
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
  if c.top_p is not None:
    pp = c.top_p
    on = ~(pp >= 1)
    tk = jnp.where(keep, cand_t, -jnp.inf)
    # The normalizer: over the top-k set when it lies in the candidates
    # (the last prefix sum), else (top-k off) over the whole row, from the
    # online log-sum-exp. The prefix sums are of exp(t - top), normalized
    # after: the sum and the cumsum are then one pass, not two in a row
    # (the rounding differs from keep_mask's by far less than the margin).
    e = jnp.exp(tk - top)
    cs = jnp.cumsum(e, axis=1)
    z_all = lse[1] * jnp.where(lse[0] == -jnp.inf, 0.0, jnp.exp(lse[0] - top[:, 0]))
    k_on = (c.top_k > 0) if c.top_k is not None else jnp.zeros((b,), bool)
    z = jnp.where(k_on, cs[:, -1], z_all)
    before = (cs - e) / z[:, None]
    # The mass before an id grows down the list, so the ids with mass < p
    # before them are a prefix (at least the first): its smallest t is the
    # threshold (one reduction, not a count and then a gather).
    first = lax.broadcasted_iota(jnp.int32, (b, m), 1) == 0
    thr = jnp.min(jnp.where((before < pp[:, None]) | first, tk, jnp.inf), axis=1)
    keep &= ~on[:, None] | (tk >= thr[:, None])
    # The nucleus edge lies in the list if a listed id already has mass
    # >= p ranked before it (the mass before an id only grows down the list).
    edge_inside = jnp.any((tk > -jnp.inf) & (before >= pp[:, None]), axis=1)
    # The mass before an id is a sum whose rounding depends on the order
    # and the normalizer's path (chunks, shards); keep_mask sums otherwise.
    # Where it lies within rounding of p the two could disagree on the
    # edge: such rows take the exact path.
    near = jnp.any((tk > -jnp.inf) & (jnp.abs(before - pp[:, None])
                                      <= margin * pp[:, None]), axis=1)
    known &= ~on | (((k_on & in_k) | (~k_on & edge_inside) | complete) & ~near)
    inside |= on & (complete | (last < thr))
    active |= on
  if c.min_p is not None:
    mp = c.min_p
    on = ~(mp <= 0)
    ok = jnp.exp(cand_t - top) >= mp[:, None]
    keep &= ~on[:, None] | ok
    inside |= on & (complete | (jnp.exp(last - top[:, 0]) < mp))
    active |= on
  # A row left with no finite candidate (e.g. a traced min_p > 1) samples
  # among -inf in keep_mask: the exact path reproduces that.
  nonempty = jnp.any(keep & (cand_t > -jnp.inf), axis=1)
  certified = ~active | (known & (inside | complete) & nonempty)
  return keep, certified, active


def sample_with_controls(p: Problem, c: controls.Controls, *, chunk: int | None = None,
                         vocab_offset=0, axis: tuple[str, ...] | None = None,
                         global_batch: int | None = None):
  """Tokens ``[S, B]`` (and log-probabilities) with sampling controls.

  One streaming pass over the vocabulary keeps, per row: the best perturbed
  score of each sample (with its tempered logit), an online log-sum-exp of
  the tempered logits, and (with truncation) the top-M tempered logits.
  Truncated rows are then decided on the candidates, whose noise is
  recomputed from their ids. A row whose kept set the candidates cannot
  certify (a nucleus wider than M ids, say) falls back to an exact
  materialized path; ``lax.cond`` skips it when no row needs it.

  With ``axis`` (inside ``shard_map``, ``weight`` being the vocabulary shard
  whose first row has global id ``vocab_offset``), the per-shard states are
  all-gathered over ``axis`` (O(B * CANDIDATES) bytes) and merged, so every
  shard decides the same tokens; the rare fallback gathers the full logits.
  ``global_batch`` is the batch of the whole data-parallel group (scalar keys
  count rows across it); default ``p.batch``.

  Returns:
    ``(tokens int32 [S, B], SampleOutput or None, fallback bool [B])``:
    ``fallback`` marks the rows that took the materialized path.
  """
  samples = c.samples
  global_batch = global_batch or p.batch
  vc = min(chunk or chunk_size(p.batch * samples, p.weight_rows), p.weight_rows)
  m = candidate_count(p)
  offset = jnp.asarray(vocab_offset, jnp.int32)

  def block(hidden, w, start, width):
    gid = offset + start + lax.iota(jnp.int32, width)
    x = controls.transform(_core.logits(hidden, w, p.layout), gid, c, p.vocab_size)
    t = _tempered(p, x)
    sc = _perturbed(p, x, t, gid, samples, global_batch)           # [B, S, W]
    j = jnp.argmax(sc, axis=2)                                     # [B, S]
    best = (jnp.take_along_axis(sc, j[:, :, None], axis=2)[:, :, 0], gid[j],
            jnp.take_along_axis(t, j, axis=1))
    mx = jnp.max(t, axis=1)
    lse = (mx, jnp.sum(jnp.where(mx[:, None] == -jnp.inf, 0.0,
                                 jnp.exp(t - mx[:, None])), axis=1))
    state = {"best": best, "lse": lse}
    if c.truncates:
      vals, j = lax.top_k(t, min(m, width))
      if width < m:
        pad = ((0, 0), (0, m - width))
        vals = jnp.pad(vals, pad, constant_values=-jnp.inf)
        j = jnp.pad(j, pad, constant_values=width - 1)
      state["cand"] = (vals, gid[j], jnp.full((p.batch,), -jnp.inf))
    return state

  st = _stream(p, block, state_combine(c, m), vc)
  return finish_controls(p, c, st, axis=axis, global_batch=global_batch)


def candidate_count(p: Problem) -> int:
  """M: the candidates per row kept for truncation (at most the rows)."""
  # Lists are padded to M entries when a shard has fewer rows, so that
  # shards' lists merge with one shape.
  return min(CANDIDATES, p.weight_rows * p.vocab_shards)


def state_combine(c: controls.Controls, m: int):
  """The associative merge of two per-row controls states.

  A state is a dict: ``best`` ``(score f32 [B, S], id int32 [B, S], t f32
  [B, S])`` (each sample's best perturbed score, its id and tempered logit;
  batch first, like every other leaf, so slicing, concatenating and
  gathering states work on axis 0), ``lse`` ``(max, sum of exp(t - max))``
  ``[B]``, and with truncation ``cand`` ``(vals [B, M], ids [B, M], bound
  [B])`` (see :func:`_topm_merge`).
  """
  def combine(a, b):
    (s1, i1, t1), (s2, i2, t2) = a["best"], b["best"]
    take = _core.better(s2, i2, s1, i1)
    best = (jnp.where(take, s2, s1), jnp.where(take, i2, i1), jnp.where(take, t2, t1))
    out = {"best": best, "lse": _lse_merge(a["lse"], b["lse"])}
    if c.truncates:
      out["cand"] = _topm_merge(a["cand"], b["cand"], m)
    return out
  return combine


def finish_controls(p: Problem, c: controls.Controls, st, *,
                    axis: tuple[str, ...] | None = None,
                    global_batch: int | None = None):
  """Tokens and log-probabilities from a controls state (any backend's).

  ``st`` is the state of :func:`state_combine` over this shard's rows; with
  ``axis`` the shards' states are gathered and merged first. Then truncated
  rows are decided on the candidates, or, where those cannot certify the
  kept set, on the exact materialized path. Returns what
  :func:`sample_with_controls` returns.

  The exact path sits behind ``lax.cond``. On a GPU, XLA keeps such a
  conditional inside its CUDA graph (decided on the device) only if every
  op of both branches can live in a graph; else it copies the predicate to
  the host on every call, and nothing after it is launched until the copy
  lands (up to ~150 us per call at B=64, benchmarks/exp_cond.py). Hence
  :func:`controls.keep_mask` sorts with two keys (never a CUB sort). The
  sharded path's all-gather in the branch may still need the host. Inside
  the graph, the conditional node still costs ~16 us per call on an H100
  even with trivial branches (PERF_LOG c5), so there is one, not nested.
  """
  samples = c.samples
  global_batch = global_batch or p.batch
  m = candidate_count(p)
  total_rows = p.weight_rows * p.vocab_shards
  combine = state_combine(c, m)
  perturbed = lambda x, t, gid: _perturbed(p, x, t, gid, samples, global_batch)
  if axis:
    parts = jax.tree.map(lambda a: _core.all_gather_invariant(a, axis), st)
    n = jax.tree.leaves(parts)[0].shape[0]
    st = jax.tree.map(lambda a: a[0], parts)
    for i in range(1, n):       # shard order = id order: ties keep lower ids
      st = combine(st, jax.tree.map(lambda a, i=i: a[i], parts))
  tokens = st["best"][1].T                                   # [S, B]
  t_tok = st["best"][2].T
  lse_all = st["lse"][0] + jnp.log(st["lse"][1])
  lse_kept = jnp.broadcast_to(lse_all, tokens.shape)
  fallback = jnp.zeros((p.batch,), bool)
  if c.truncates:
    # Values at or below ``bound`` may have unlisted neighbours: only the
    # values above it are known to be complete and in order; the lists hold
    # -inf in their place (_topm_merge).
    cand_t, cand_i, bound = st["cand"]
    if _platform() == "cpu":
      # XLA's CPU compiler turns a top_k into a sort and back into its fast
      # TopK call only if the sort is read through [0:k] slices; reading
      # single entries (the top, the k-th, the last) folds them into the
      # sort, which then stays a full sort of the chunk (B=4, V=4096: 2.5
      # ms of a 2.6 ms call). The barrier keeps those reads off the sort.
      cand_t = lax.optimization_barrier(cand_t)
    last = jnp.maximum(bound, cand_t[:, -1])
    complete = (bound == -jnp.inf) & ((m >= total_rows) | (last == -jnp.inf))
    certify = functools.partial(_certify, p, cand_t=cand_t, lse=st["lse"],
                                complete=complete, last=last)
    keep, certified, active = certify(c)
    # Rows with NaN or infinite logits: keep_mask's sorts and exp(t - max)
    # treat them in ways the candidates do not track; the exact path does.
    finite = ~active | jnp.isfinite(st["lse"][0])
    certified &= finite
    sampled = p.temperature != 0
    if not c.return_logprobs:  # greedy rows ignore truncation (argmax of x)
      certified |= ~sampled
    use = active & sampled & (st["lse"][0] > -jnp.inf)

    def pick(keep):
      """Tokens, their t and the kept log-sum-exp with ``keep`` applied."""
      kept_t = jnp.where(keep, cand_t, -jnp.inf)
      sc = perturbed(kept_t, kept_t, cand_i)                       # [B, S, M]
      # The list is sorted by t, not id: ties of the perturbed score must
      # go to the lowest id (the combine rule), not the first list position.
      # One variadic row reduction (with the winner's t), not a max, then a
      # min of the ids that attain it, then a max of their t.
      _, tok, new_t = _core.argbest(sc, cand_i[:, None], axis=2,
                                    carry=cand_t[:, None])         # [B, S]
      return (jnp.where(use[None], tok.T, tokens),
              jnp.where(use[None], new_t.T, t_tok),
              jnp.where(active[None], jax.nn.logsumexp(kept_t, axis=1)[None], lse_kept))

    tokens, t_tok, lse_kept = pick(keep)
    fallback = ~certified
    if c.top_p is not None and not c.return_logprobs:
      # Rows whose nucleus edge lies within rounding of top_p can still be
      # decided here: the kept sets at p -/+ width are nested around the one
      # at p, so if both give the same token (the edge ids rarely win), so
      # does p. Not with logprobs: the kept log-sum-exp depends on the edge.
      # Computed on every call: a second, nested conditional around it cost
      # more than these few small fusions (PERF_LOG c5).
      width = 2 * _TOP_P_MARGIN * c.top_p
      (k_lo, ok_lo, _), (k_hi, ok_hi, _) = (
          certify(dataclasses.replace(c, top_p=c.top_p + d), margin=0.0)
          for d in (-width, width))
      (tok_lo, t_lo, _), (tok_hi, _, _) = pick(k_lo), pick(k_hi)
      same = fallback & ok_lo & ok_hi & finite & jnp.all(tok_lo == tok_hi, axis=0)
      tokens = jnp.where(same[None], tok_lo, tokens)
      t_tok = jnp.where(same[None], t_lo, t_tok)
      fallback = fallback & ~same

    def exact():
      # The key words are split from the key (a program parameter) inside
      # the branch: slices of it passed in were each copied into the
      # conditional on every call (PERF_LOG c5).
      k0, k1, _ = _validate.key_words(p.key, p.batch)
      pb = dataclasses.replace(p, k0=k0, k1=k1)
      return _materialized(
          pb, c, fallback, tokens, t_tok, lse_kept,
          lambda x, t, gid: _perturbed(pb, x, t, gid, samples, global_batch), axis)

    tokens, t_tok, lse_kept = lax.cond(
        jnp.any(fallback), exact, lambda: (tokens, t_tok, lse_kept))
  out = None
  if c.return_logprobs:
    out = controls.SampleOutput(tokens=tokens, logprob=t_tok - lse_all[None],
                                logprob_truncated=t_tok - lse_kept,
                                logsumexp=jnp.broadcast_to(lse_all, tokens.shape))
  return tokens, out, fallback


def _materialized(p: Problem, c: controls.Controls, rows, tokens, t_tok, lse_kept,
                 perturbed, axis):
  """The exact path for ``rows``: full logits, :func:`controls.keep_mask`."""
  l = _core.logits(p.hidden, p.weight, p.layout)                 # [B, local rows]
  if axis:   # every shard's logits, in global id order
    l = jnp.moveaxis(_core.all_gather_invariant(l, axis), 0, 1).reshape(p.batch, -1)
  gid = lax.iota(jnp.int32, l.shape[1])
  x = controls.transform(l, gid, c, p.vocab_size)[:, :p.vocab_size]
  gid = gid[:p.vocab_size]
  t = _tempered(p, x)
  kept = jnp.where(controls.keep_mask(t, c), t, -jnp.inf)
  j = jnp.argmax(perturbed(x, kept, gid), axis=2)                # [B, S]
  new_t = jnp.take_along_axis(t, j, axis=1)
  r = rows[None]
  return (jnp.where(r, j.T.astype(jnp.int32), tokens),
          jnp.where(r, new_t.T, t_tok),
          jnp.where(r, jax.nn.logsumexp(kept, axis=1)[None], lse_kept))
