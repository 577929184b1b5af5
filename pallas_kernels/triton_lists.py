"""A row's candidate list, log-sum-exp and best from its materialized
logits, in two Triton kernels (launched through jax-triton).

The dense route (XLA's GEMM writes its f32 product ``[B, W]``) needs, per
row, the top-M tempered logits ``t`` for stage 2's truncation, the online
log-sum-exp ``(max, sum exp(t - max))`` and the best ``(t, id)`` (greedy
rows' token). As XLA fusions that is some thirty kernels
(docs/performance.md, "Candidate lists of the dense route"); here it is
two, which temper what they read as XLA would (``t = (product * scale) *
(1 / T)``, :func:`load_tempered`), so that ``t`` is never written:

1. :func:`_slot_stats_kernel`, grid ``(B, slot blocks)``: per slot of
   ``SLOT`` consecutive ids, its maximum (NaN if it holds a NaN), the sum of
   ``exp(t - max)`` and the first id of its maximum (of its first NaN), and,
   in a launch of few rows (:func:`keeps_entries`), its next two entries in
   the lists' order (the second's value and id, the third's value). One read
   of ``t``.
2. :func:`_row_lists_kernel`, grid ``(B,)``: the row's best and log-sum-exp
   from its slots; ``tau``, the M-th largest slot maximum (a radix select
   over the slots' order keys), which is at most the row's M-th largest
   value, so every value of the row's top M is ``>= tau`` and lies in a slot
   whose maximum is ``>= tau``; the values ``>= tau`` of those slots
   (usually a few more than M: read again from ``t``, or, with the slots'
   entries, their first and second entries and every value of the rare slot
   whose third entry reaches tau, read again), sorted by (value descending,
   id ascending) and the first M written.

The lists are exact (``bound = -inf``): the top M by that order, as
``lax.top_k`` lists them. A row is handed to stage 2's exact path instead
(``bound = +inf``, nothing listed) when it holds a NaN, or when more than
``SLOT_CAP`` slots or ``CAP`` values reach ``tau`` (many equal values, or a
row whose finite values crowd fewer than M slots); the best and the
log-sum-exp are right in every row (the sum's order and ``exp`` differ from
XLA's: the log-sum-exp feeds only what rounding may move, docs/design.md,
"Backends").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from pallas_kernels import triton_noise as noise
from pallas_kernels.triton_sampler import best_along, compile_for_inspection, tempered

__all__ = ["LISTS_MAX", "ENTRIES_MAX_ROWS", "row_lists", "launch", "caps", "tau_slack",
           "slot_block", "keeps_entries", "constexprs", "lists_for_inspection",
           "ENTRY_FIELDS", "entry_lists", "entry_launch", "entry_constexprs",
           "entry_lists_for_inspection"]

_INT_MAX = tl.constexpr(np.iinfo(np.int32).max)
# The order key of -inf (keys of finite values are larger).
_KEY_NEG_INF = tl.constexpr(0x007FFFFF)
# Elements per program of the slot pass and per step of the gather.
_SLOT_ELEMENTS = 4096
_GATHER_ELEMENTS = 8192
# Bits of tau's key decided per step of the radix select.
_RADIX = 2
# Warps of the two kernels, and the loops' stages.
_STATS_WARPS = 4
_LISTS_WARPS = 8
_STAGES = 2
# The longest list the kernels build (stage2.CANDIDATES).
LISTS_MAX = 128
# The most rows for which the slot pass also keeps each slot's next two
# entries (ENTRIES): they halve the row program, which bounds a launch of few
# rows, but the pass's extra reductions make it compute-bound, so from about
# 16 rows on they cost more than they save (docs/performance.md, "The list
# kernels").
ENTRIES_MAX_ROWS = 8


def caps(m: int) -> tuple[int, int]:
  """``(SLOT_CAP, CAP)`` for lists of ``m``: the slots at or above ``tau``
  and the values gathered from them that a row may have before it is handed
  to the exact path: twice ``m``, and twice ``m`` rounded up to a power of
  two (the sort's width). A row of distinct values has ``m``
  such slots and, with ``W / SLOT >= 8 m`` slots, about ``m + m^2 / (2 S)``
  such values (each of the top values in a slot of its own but for a few)."""
  return 2 * m, 2 * triton.next_power_of_2(m)


def tau_slack(m: int, entries: bool) -> int:
  """How many slot maxima beyond ``m`` may reach ``tau`` when the radix
  select stops early: ``m / 8`` with the slots' entries (their values come
  from the slot pass, so a few more cost little), none without (there every
  selected slot is read again, and each further ``8192 / SLOT`` slots costs a
  gather step; the select then stops early only where exactly ``m`` slot
  maxima reach the bits decided, docs/performance.md, "The list kernels")."""
  return max(1, m // 8) if entries else 0


def keeps_entries(rows: int) -> bool:
  """Whether a launch over ``rows`` rows keeps the slots' next two entries."""
  return rows <= ENTRIES_MAX_ROWS


def slot_block(slot: int) -> int:
  """Slots per program of the slot pass."""
  return max(1, _SLOT_ELEMENTS // slot)


@triton.jit
def order_key(x):
  """f32 -> uint32 whose unsigned order is the float order (-0 < +0)."""
  b = x.to(tl.uint32, bitcast=True)
  return tl.where((b >> 31) == 1, b ^ 0xFFFFFFFF, b | 0x80000000)


@triton.jit
def load_tempered(t_ptr, scale_ptr, inv_t, r, col, ok, W: tl.constexpr, PER_ID: tl.constexpr):
  """Row ``r``'s tempered logits at ``col`` (``-inf`` where not ``ok``):
  ``(t * scale) * inv_t``, XLA's ``f32(dot) * weight_scale`` and its
  ``x / T`` in the same program (docs/design.md, "Division"); two roundings,
  no fma (the kernels compile without contraction). ``scale`` per id
  (``PER_ID``) or one value."""
  x = tl.load(t_ptr + r.to(tl.int64) * W + col, mask=ok, other=0.0)
  if PER_ID:
    sc = tl.load(scale_ptr + col, mask=ok, other=1.0)
  else:
    sc = tl.load(scale_ptr)
  return tl.where(ok, tempered(x * sc, inv_t), float("-inf"))


@triton.jit
def _slot_stats_kernel(t_ptr, scale_ptr, inv_t_ptr, max_ptr, sum_ptr, arg_ptr, second_ptr,
                       second_arg_ptr, third_ptr, W: tl.constexpr, S: tl.constexpr,
                       SLOT: tl.constexpr, SPP: tl.constexpr, PER_ID: tl.constexpr,
                       ENTRIES: tl.constexpr):
  r = tl.program_id(0)
  slots = tl.program_id(1) * SPP + tl.arange(0, SPP)
  col = slots[:, None] * SLOT + tl.arange(0, SLOT)[None, :]          # [SPP, SLOT]
  ok = col < W
  t = load_tempered(t_ptr, scale_ptr, tl.load(inv_t_ptr + r), r, col, ok, W, PER_ID)
  # The combine rule's best of each slot: NaN if it holds one (then its
  # first NaN), else its maximum and the first id of it.
  mx, arg = best_along(t, col, ok, 1)
  # A slot of -inf sums 0 (exp(-inf - -inf) would be NaN); a NaN slot's
  # sum is NaN, never read (its row's log-sum-exp is NaN).
  e = tl.where(mx[:, None] == float("-inf"), 0.0, tl.exp(t - mx[:, None]))
  out = r * S + slots
  keep = slots < S
  tl.store(max_ptr + out, mx, mask=keep)
  tl.store(sum_ptr + out, tl.sum(e, axis=1), mask=keep)
  tl.store(arg_ptr + out, arg, mask=keep)
  if ENTRIES:
    # The next two entries in the lists' order (value descending, id
    # ascending): the row program reads a slot's values again only where its
    # third reaches tau (a NaN slot's are never read: its row is handed over).
    ok2 = ok & (col != arg[:, None])
    second, arg2 = best_along(tl.where(ok2, t, float("-inf")), col, ok2, 1)
    ok3 = ok2 & (col != arg2[:, None])
    third = tl.max(tl.where(ok3, t, float("-inf")), axis=1)
    tl.store(second_ptr + out, second, mask=keep)
    tl.store(second_arg_ptr + out, arg2, mask=keep)
    tl.store(third_ptr + out, third, mask=keep)


@triton.jit
def _best_and_lse(mx, sm, arg, nan, valid, s, r, off, best_t_ptr, best_id_ptr, lse_max_ptr,
                  lse_sum_ptr):
  """Stores row ``r``'s best and log-sum-exp from its slots' maxima ``mx``,
  sums ``sm`` and first ids ``arg`` (ids ``off + arg``); returns whether
  the row holds a NaN."""
  row_nan = tl.max(nan.to(tl.int32), axis=0) > 0
  top = tl.max(tl.where(nan, float("-inf"), mx), axis=0)

  # The best: the first slot holding a NaN, else the first attaining the
  # maximum; that slot's first id of it.
  hit = valid & tl.where(row_nan, nan, mx == top)
  best_slot = tl.min(tl.where(hit, s, _INT_MAX), axis=0)
  best_col = tl.min(tl.where(s == best_slot, arg, _INT_MAX), axis=0)
  tl.store(best_t_ptr + r, tl.where(row_nan, float("nan"), top))
  tl.store(best_id_ptr + r, off + best_col)

  # The log-sum-exp (max, sum): a row of -inf sums 0; a NaN or +inf row
  # gives NaN, as XLA's reductions do.
  finite = (top > float("-inf")) & (top < float("inf"))
  safe = tl.where(finite, top, 0.0)
  total = tl.sum(tl.where(valid & (mx > float("-inf")), tl.exp(mx - safe) * sm, 0.0), axis=0)
  tl.store(lse_max_ptr + r, tl.where(row_nan, float("nan"), top))
  total = tl.where(finite, total, tl.where(top == float("-inf"), 0.0, float("nan")))
  tl.store(lse_sum_ptr + r, tl.where(row_nan, float("nan"), total))
  return row_nan


@triton.jit
def _tau_key(key, counted, M: tl.constexpr, SLACK: tl.constexpr, RADIX: tl.constexpr):
  """tau's key: the M-th largest of the slot maxima's keys ``key`` where
  ``counted``, RADIX bits a step from the top (the count of keys >= each
  of the 2**RADIX probes of the step in one reduction; counts fall as the
  probe rises, so the step's digit is the number of probes above 0 that
  still count M), stopped once at most M + SLACK slot maxima reach the bits
  decided so far (the rest 0). Any key at most the M-th largest keeps the
  lists exact; a lower one lists a few more values, and saves the steps
  that would not."""
  tau = tl.full([], 0, tl.uint32)
  digit = tl.arange(0, 1 << RADIX).to(tl.uint32)
  shift = 32 - RADIX
  reach = tl.sum(counted.to(tl.int32), axis=0)
  while (shift >= 0) & (reach > M + SLACK):
    probe = tau | (digit << shift.to(tl.uint32))                          # [2**RADIX]
    n = tl.sum((counted[None, :] & (key[None, :] >= probe[:, None])).to(tl.int32), axis=1)
    d = tl.sum((n >= M).to(tl.int32), axis=0) - 1
    tau = tau | (d.to(tl.uint32) << shift.to(tl.uint32))
    reach = tl.sum(tl.where(digit == d.to(tl.uint32), n, 0), axis=0)
    shift -= RADIX
  return tau


@triton.jit
def _sorted_lists(cand_v_ptr, cand_i_ptr, r, count, flag, bound, vals_ptr, ids_ptr, bound_ptr,
                  CAP: tl.constexpr, M: tl.constexpr):
  """Row ``r``'s ``count`` gathered candidates sorted by (value
  descending, id ascending) as one uint64 key, the first M above ``bound``
  written (nothing where ``flag``: the bound is then +inf)."""
  k = tl.arange(0, CAP)
  km = k < count
  cv = tl.load(cand_v_ptr + r * CAP + k, mask=km, other=float("-inf"))
  ci = tl.load(cand_i_ptr + r * CAP + k, mask=km, other=_INT_MAX)
  packed = ((order_key(cv) ^ 0xFFFFFFFF).to(tl.uint64) << 32) | ci.to(tl.uint32).to(tl.uint64)
  packed = tl.sort(packed, 0)
  ok_key = (packed >> 32).to(tl.uint32) ^ 0xFFFFFFFF
  bits = tl.where((ok_key >> 31) == 1, ok_key & 0x7FFFFFFF, ok_key ^ 0xFFFFFFFF)
  out_v = bits.to(tl.float32, bitcast=True)
  out_i = (packed & 0xFFFFFFFF).to(tl.uint32).to(tl.int32)
  out_v = tl.where(flag | (out_v <= bound), float("-inf"), out_v)
  out_i = tl.where(flag | (out_v == float("-inf")), _INT_MAX, out_i)
  tl.store(vals_ptr + r * M + k, out_v, mask=k < M)
  tl.store(ids_ptr + r * M + k, out_i, mask=k < M)
  tl.store(bound_ptr + r, tl.where(flag, float("inf"), bound))


@triton.jit
def _row_lists_kernel(max_ptr, sum_ptr, arg_ptr, second_ptr, second_arg_ptr, third_ptr,
                      t_ptr, scale_ptr, inv_t_ptr, off_ptr,
                      vals_ptr, ids_ptr, bound_ptr, lse_max_ptr, lse_sum_ptr,
                      best_t_ptr, best_id_ptr, slot_buf_ptr, cand_v_ptr, cand_i_ptr,
                      W: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
                      SLOT: tl.constexpr, M: tl.constexpr, SLOT_CAP: tl.constexpr,
                      CAP: tl.constexpr, GROUP: tl.constexpr, RADIX: tl.constexpr,
                      SLACK: tl.constexpr, PER_ID: tl.constexpr, ENTRIES: tl.constexpr):
  r = tl.program_id(0)
  off = tl.load(off_ptr)
  s = tl.arange(0, S_PAD)
  valid = s < S
  mx = tl.load(max_ptr + r * S + s, mask=valid, other=float("-inf"))
  sm = tl.load(sum_ptr + r * S + s, mask=valid, other=0.0)
  arg = tl.load(arg_ptr + r * S + s, mask=valid, other=_INT_MAX)
  nan = mx != mx
  row_nan = _best_and_lse(mx, sm, arg, nan, valid, s, r, off, best_t_ptr, best_id_ptr,
                          lse_max_ptr, lse_sum_ptr)
  key = order_key(mx)
  counted = valid & ~nan
  tau = _tau_key(key, counted, M, SLACK, RADIX)

  # The slots that may hold a value >= tau. With the slots' entries
  # (ENTRIES), their values >= tau are the slot's first and second entries
  # where its third is below tau (listed from the slot pass); where the
  # third reaches tau (rare: three of the row's top values in one slot), all
  # of them, read again below. Without, every such slot is read again.
  sel = counted & (key >= tau) & (key > _KEY_NEG_INF)
  if ENTRIES:
    k3 = order_key(tl.load(third_ptr + r * S + s, mask=valid, other=float("-inf")))
    full = sel & (k3 >= tau) & (k3 > _KEY_NEG_INF)
  else:
    full = sel
  one = sel & ~full
  v2 = tl.load(second_ptr + r * S + s, mask=one, other=float("-inf"))
  k2 = order_key(v2)
  two = one & (k2 >= tau) & (k2 > _KEY_NEG_INF)
  # One scan for the three places, 16 bits a count (fewer than 2**16 slots).
  packed_counts = (one.to(tl.int64) | (two.to(tl.int64) << 16) | (full.to(tl.int64) << 32))
  at_all = tl.cumsum(packed_counts, axis=0)
  n_all = tl.sum(packed_counts, axis=0)
  p1 = (at_all & 0xFFFF).to(tl.int32) - 1
  n1 = (n_all & 0xFFFF).to(tl.int32)
  p2 = n1 + ((at_all >> 16) & 0xFFFF).to(tl.int32) - 1
  n2 = ((n_all >> 16) & 0xFFFF).to(tl.int32)
  pf = ((at_all >> 32) & 0xFFFF).to(tl.int32) - 1
  n_full = ((n_all >> 32) & 0xFFFF).to(tl.int32)
  n_sel = n1 + n_full
  tl.store(cand_v_ptr + r * CAP + p1, mx, mask=one & (p1 < CAP))
  tl.store(cand_i_ptr + r * CAP + p1, off + arg, mask=one & (p1 < CAP))
  i2 = tl.load(second_arg_ptr + r * S + s, mask=two, other=0)
  tl.store(cand_v_ptr + r * CAP + p2, v2, mask=two & (p2 < CAP))
  tl.store(cand_i_ptr + r * CAP + p2, off + i2, mask=two & (p2 < CAP))
  tl.store(slot_buf_ptr + r * SLOT_CAP + pf, s, mask=full & (pf < SLOT_CAP))
  tl.debug_barrier()
  over = n_sel > SLOT_CAP
  n_gather = tl.minimum(n_full, SLOT_CAP)

  # The values >= tau of the slots read again, GROUP slots per step.
  g = tl.arange(0, GROUP)
  c = tl.arange(0, SLOT)
  inv_t = tl.load(inv_t_ptr + r)
  count = n1 + n2
  start = 0
  while start < n_gather:
    j = start + g
    jm = j < n_gather
    sl = tl.load(slot_buf_ptr + r * SLOT_CAP + j, mask=jm, other=0)
    col = sl[:, None] * SLOT + c[None, :]                                 # [GROUP, SLOT]
    ok = jm[:, None] & (col < W)
    v = load_tempered(t_ptr, scale_ptr, inv_t, r, col, ok, W, PER_ID)
    vk = order_key(v)
    take = ok & (v == v) & (vk >= tau) & (vk > _KEY_NEG_INF)
    ti = take.to(tl.int32)
    before = tl.cumsum(tl.sum(ti, axis=1), axis=0) - tl.sum(ti, axis=1)  # [GROUP]
    at = count + before[:, None] + tl.cumsum(ti, axis=1) - 1
    put = take & (at < CAP)
    tl.store(cand_v_ptr + r * CAP + at, v, mask=put)
    tl.store(cand_i_ptr + r * CAP + at, off + col, mask=put)
    count += tl.sum(ti)
    start += GROUP
  tl.debug_barrier()
  over = over | (count > CAP)

  _sorted_lists(cand_v_ptr, cand_i_ptr, r, count, over | row_nan, float("-inf"), vals_ptr,
                ids_ptr, bound_ptr, CAP, M)


@triton.jit
def _entry_lists_kernel(v1_ptr, v2_ptr, v3_ptr, v4_ptr, i1_ptr, i2_ptr, i3_ptr, i4_ptr,
                        v5_ptr, sum_ptr, vals_ptr, ids_ptr, bound_ptr, lse_max_ptr,
                        lse_sum_ptr, best_t_ptr, best_id_ptr, cand_v_ptr, cand_i_ptr,
                        S: tl.constexpr, S_PAD: tl.constexpr, M: tl.constexpr,
                        CAP: tl.constexpr, RADIX: tl.constexpr, SLACK: tl.constexpr):
  """:func:`entry_lists`' row program: the row's best, log-sum-exp and
  list from its slots' four entries (ids global), the fifth value and the
  sum; never a read of ``t``."""
  r = tl.program_id(0)
  s = tl.arange(0, S_PAD)
  valid = s < S
  at = r * S + s
  mx = tl.load(v1_ptr + at, mask=valid, other=float("-inf"))
  sm = tl.load(sum_ptr + at, mask=valid, other=0.0)
  arg = tl.load(i1_ptr + at, mask=valid, other=_INT_MAX)
  nan = mx != mx
  row_nan = _best_and_lse(mx, sm, arg, nan, valid, s, r, 0, best_t_ptr, best_id_ptr,
                          lse_max_ptr, lse_sum_ptr)
  key = order_key(mx)
  counted = valid & ~nan
  tau = _tau_key(key, counted, M, SLACK, RADIX)
  sel = counted & (key >= tau) & (key > _KEY_NEG_INF)

  # Each selected slot's entries at or above tau: one scan of the slots'
  # counts places them (the sort below orders them). A selected slot's first
  # entry, its maximum, reaches tau by the selection.
  t1 = sel.to(tl.int32)
  v2, t2 = _entry_takes(v2_ptr, at, sel, tau)
  v3, t3 = _entry_takes(v3_ptr, at, sel, tau)
  v4, t4 = _entry_takes(v4_ptr, at, sel, tau)
  n = t1 + t2 + t3 + t4
  base = r * CAP + tl.cumsum(n, axis=0) - n
  count = tl.sum(n, axis=0)
  end = r * CAP + CAP
  _put_at(mx, arg, t1, base, end, cand_v_ptr, cand_i_ptr)
  _put_at(v2, _ids_where(i2_ptr, at, t2), t2, base + t1, end, cand_v_ptr, cand_i_ptr)
  _put_at(v3, _ids_where(i3_ptr, at, t3), t3, base + t1 + t2, end, cand_v_ptr, cand_i_ptr)
  _put_at(v4, _ids_where(i4_ptr, at, t4), t4, base + t1 + t2 + t3, end, cand_v_ptr,
          cand_i_ptr)
  # A slot whose fifth value reaches tau may hold unlisted values up to it:
  # only the values above the largest such bound are the row's, in order.
  v5 = tl.load(v5_ptr + at, mask=sel, other=float("-inf"))
  k5 = order_key(v5)
  full = sel & (k5 >= tau) & (k5 > _KEY_NEG_INF)
  bound = tl.max(tl.where(full, v5, float("-inf")), axis=0)
  tl.debug_barrier()
  _sorted_lists(cand_v_ptr, cand_i_ptr, r, count, (count > CAP) | row_nan, bound, vals_ptr,
                ids_ptr, bound_ptr, CAP, M)


@triton.jit
def _takes(v, sel, tau):
  """1 where slot ``sel``'s entry ``v`` reaches ``tau`` (int32)."""
  k = order_key(v)
  return (sel & (k >= tau) & (k > _KEY_NEG_INF)).to(tl.int32)


@triton.jit
def _entry_takes(v_ptr, at, sel, tau):
  """The selected slots' entries ``v`` (``-inf`` elsewhere) and where each
  reaches ``tau``."""
  v = tl.load(v_ptr + at, mask=sel, other=float("-inf"))
  return v, _takes(v, sel, tau)


@triton.jit
def _ids_where(i_ptr, at, take):
  """The ids of the entries ``take`` (0 elsewhere)."""
  return tl.load(i_ptr + at, mask=take != 0, other=0)


@triton.jit
def _put_at(v, i, take, p, end, cand_v_ptr, cand_i_ptr):
  """Stores the entries ``(v, i)`` where ``take`` at the candidates' flat
  places ``p`` (those before ``end``, the row's last place + 1)."""
  put = (take != 0) & (p < end)
  tl.store(cand_v_ptr + p, v, mask=put)
  tl.store(cand_i_ptr + p, i, mask=put)


def row_lists(t, offset, m: int, *, slot: int, scale=None, inv_temperature=None):
  """The top-``m`` list, log-sum-exp and best of each row of the tempered
  logits ``(t * scale) * inv_temperature`` (``t [B, W]`` f32; ``scale``
  f32, one per column ``[W]`` or one value, default 1; ``inv_temperature``
  f32 ``[B]``, XLA's ``1 / T`` per row, default 1: the kernels then temper
  as XLA does, and ``t`` may be a GEMM's raw output), ids ``offset +
  column`` (``offset`` an int32 scalar, traced or not), with slots of
  ``slot`` ids (at least ``8 m`` slots: ``dense_lists.slot_size``).

  Returns a dict of ControlsState fields: ``cand_vals [B, m]`` (descending),
  ``cand_ids [B, m]``, ``cand_bound [B]`` (``-inf``: exact; ``+inf``: the
  row takes the exact path), ``lse_max``, ``lse_sum``, ``best_t``,
  ``best_id`` ``[B]``. Under ``jax.vmap`` the blocks' rows go through one
  launch.
  """
  _, w = t.shape
  if t.dtype != jnp.float32:
    raise TypeError(f"t must be float32, got {t.dtype}")
  if not 1 <= m <= LISTS_MAX:
    raise ValueError(f"m={m} must be in [1, {LISTS_MAX}]")
  s = -(-w // slot)
  if s < 8 * m or s >= 1 << 16 or slot & (slot - 1):
    raise ValueError(f"slot={slot} must be a power of two leaving >= {8 * m} and < 65536 "
                     f"slots of {w} ids")
  scale = _checked_scale(scale, w)
  inv_temperature = _checked_inverse_temperatures(inv_temperature, t.shape[0])
  return _batchable(m, slot)(t, scale, inv_temperature, jnp.asarray(offset, jnp.int32))


def _checked_scale(scale, w: int):
  """``scale`` as f32 ``[W]`` or ``[1]`` (None: ``[1.0]``)."""
  if scale is None:
    return jnp.ones((1,), jnp.float32)
  if scale.dtype != jnp.float32:
    raise TypeError(f"scale must be float32, got {scale.dtype}")
  if scale.shape not in ((), (1,), (w,)):
    raise ValueError(f"scale.shape={scale.shape} must be () or ({w},)")
  return scale.reshape(-1)


def _checked_inverse_temperatures(inv_temperature, b: int):
  """``inv_temperature`` as f32 ``[B]`` (None: ones)."""
  if inv_temperature is None:
    return jnp.ones((b,), jnp.float32)
  if inv_temperature.dtype != jnp.float32:
    raise TypeError(f"inv_temperature must be float32, got {inv_temperature.dtype}")
  if inv_temperature.shape != (b,):
    raise ValueError(f"inv_temperature.shape={inv_temperature.shape} must be ({b},)")
  return inv_temperature


def _batchable(m: int, slot: int):
  """:func:`launch` for lists of ``m`` and slots of ``slot`` ids, with a
  batching rule (jax-triton's call has none, so ``jax.vmap`` of a program
  that reads lists would fail): the kernels work row by row, so a batch of
  ``[B, W]`` blocks (with their rows' temperatures) is one launch over
  their rows, and batched scales or offsets one launch per block
  (``lax.map``)."""

  @jax.custom_batching.custom_vmap
  def lists(t, scale, inv_t, offset):
    return launch(t, scale, inv_t, offset, m, slot)

  @lists.def_vmap
  def _rule(axis_size, in_batched, *args):
    if not any(in_batched):
      out = lists(*args)
      return out, jax.tree.map(lambda _: False, out)
    batched = [a if on else jnp.broadcast_to(a, (axis_size, *a.shape))
               for a, on in zip(args, in_batched)]
    if in_batched[1] or in_batched[3]:
      out = jax.lax.map(lambda a: lists(*a), tuple(batched))
    else:
      t, scale, inv_t, offset = batched
      n, b, w = t.shape
      out = jax.tree.map(lambda x: x.reshape(n, b, *x.shape[1:]),
                         lists(t.reshape(n * b, w), scale[0], inv_t.reshape(n * b), offset[0]))
    return out, jax.tree.map(lambda _: True, out)

  return lists


def launch(t, scale, inv_t, offset, m: int, slot: int) -> dict:
  """Both kernels through jax-triton on ``t [B, W]``, ``scale [W]`` or
  ``[1]``, ``inv_t [B]`` (checked by :func:`row_lists`; ``offset`` int32
  ``()``)."""
  b, w = t.shape
  jt = noise.jax_triton_module()
  first, second = constexprs(w, m, slot, per_id=scale.shape[0] == w, entries=keeps_entries(b))
  s = first["S"]
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  mx, sm, arg, second_val, second_arg, third = jt.triton_call(
      t, scale, inv_t, kernel=_slot_stats_kernel,
      out_shape=(f32(b, s), f32(b, s), i32(b, s), f32(b, s), i32(b, s), f32(b, s)),
      grid=(b, triton.cdiv(s, first["SPP"])), num_warps=_STATS_WARPS, num_stages=_STAGES,
      name="flashsample_slot_stats", **first)
  vals, ids, bound, lse_max, lse_sum, best_t, best_id, _, _, _ = jt.triton_call(
      mx, sm, arg, second_val, second_arg, third, t, scale, inv_t, offset.reshape((1,)),
      kernel=_row_lists_kernel,
      out_shape=(f32(b, m), i32(b, m), f32(b), f32(b), f32(b), f32(b), i32(b),
                 i32(b, second["SLOT_CAP"]), f32(b, second["CAP"]), i32(b, second["CAP"])),
      grid=(b,), num_warps=_LISTS_WARPS, num_stages=_STAGES, name="flashsample_row_lists",
      **second)
  return dict(cand_vals=vals, cand_ids=ids, cand_bound=bound, lse_max=lse_max,
              lse_sum=lse_sum, best_t=best_t, best_id=best_id)


def constexprs(width: int, m: int, slot: int, *, per_id: bool = False,
               entries: bool = False) -> tuple[dict, dict]:
  """The two kernels' constexprs for rows of ``width`` ids, lists of ``m``,
  slots of ``slot`` ids, a scale per id (``per_id``) or one, and the slots'
  next two entries kept (``entries``, :func:`keeps_entries`) or not."""
  s = -(-width // slot)
  slot_cap, cap = caps(m)
  return (dict(W=width, S=s, SLOT=slot, SPP=slot_block(slot), PER_ID=per_id, ENTRIES=entries),
          dict(W=width, S=s, S_PAD=triton.next_power_of_2(s), SLOT=slot, M=m,
               SLOT_CAP=slot_cap, CAP=cap, GROUP=max(1, _GATHER_ELEMENTS // slot),
               RADIX=_RADIX, SLACK=tau_slack(m, entries), PER_ID=per_id, ENTRIES=entries))


def lists_for_inspection(width: int, m: int, slot: int, *, per_id: bool = False,
                         entries: bool = False, capability: tuple[int, int] = (9, 0)):
  """Both kernels compiled for ``capability`` without a GPU
  (:func:`~pallas_kernels.triton_sampler.compile_for_inspection`):
  ``(slot pass, row lists)``."""
  first, second = constexprs(width, m, slot, per_id=per_id, entries=entries)
  inputs = {"t_ptr": "*fp32", "scale_ptr": "*fp32", "inv_t_ptr": "*fp32"}
  stats = compile_for_inspection(
      _slot_stats_kernel, {**inputs, "max_ptr": "*fp32", "sum_ptr": "*fp32",
                           "arg_ptr": "*i32", "second_ptr": "*fp32",
                           "second_arg_ptr": "*i32", "third_ptr": "*fp32"}, first,
      capability=capability, num_warps=_STATS_WARPS, num_stages=_STAGES)
  pointers = {"max_ptr": "*fp32", "sum_ptr": "*fp32", "arg_ptr": "*i32",
              "second_ptr": "*fp32", "second_arg_ptr": "*i32", "third_ptr": "*fp32",
              **inputs, "off_ptr": "*i32", "vals_ptr": "*fp32", "ids_ptr": "*i32",
              "bound_ptr": "*fp32", "lse_max_ptr": "*fp32", "lse_sum_ptr": "*fp32",
              "best_t_ptr": "*fp32", "best_id_ptr": "*i32", "slot_buf_ptr": "*i32",
              "cand_v_ptr": "*fp32", "cand_i_ptr": "*i32"}
  lists = compile_for_inspection(_row_lists_kernel, pointers, second,
                                 capability=capability, num_warps=_LISTS_WARPS,
                                 num_stages=_STAGES)
  return stats, lists


# The fields of :func:`entry_lists`' input (pallas_kernels.sm90_slots.FIELDS).
ENTRY_FIELDS = ("v1", "v2", "v3", "v4", "i1", "i2", "i3", "i4", "v5", "sum")


def entry_lists(entries: dict, m: int, rows: int | None = None) -> dict:
  """The top-``m`` list, log-sum-exp and best of each of the first ``rows``
  rows (default: all) from its slots' entries (:mod:`pallas_kernels.sm90_slots`:
  per row and slot the four largest ``t`` with their global ids, the fifth
  value and the sum of ``exp(t - max)``, each ``[N, S]``, ``N >= rows``):
  what :func:`row_lists` returns (``[rows, ...]``), but
  ``cand_bound`` is the largest fifth value of a slot that reaches ``tau``
  (``-inf`` where none does; the list holds the values above it), or
  ``+inf`` for a row handed to the exact path (a NaN, or more than ``CAP``
  values at or above ``tau``). Under ``jax.vmap`` one launch over the rows
  of every block."""
  if not 1 <= m <= LISTS_MAX:
    raise ValueError(f"m={m} must be in [1, {LISTS_MAX}]")
  missing = set(ENTRY_FIELDS) - set(entries)
  if missing:
    raise ValueError(f"entries lacks the fields {sorted(missing)}")
  shape = entries["v1"].shape
  for name in ENTRY_FIELDS:
    want = jnp.int32 if name.startswith("i") else jnp.float32
    if entries[name].shape != shape or entries[name].dtype != want:
      raise ValueError(f"entries[{name!r}] must be {jnp.dtype(want).name} {shape}, got "
                       f"{entries[name].dtype} {entries[name].shape}")
  if len(shape) != 2 or shape[1] >= 1 << 16:
    raise ValueError(f"entries must be [N, S] with S < 65536, got {shape}")
  rows = shape[0] if rows is None else rows
  if not 1 <= rows <= shape[0]:
    raise ValueError(f"rows={rows} must be in [1, {shape[0]}]")
  return _entry_batchable(m, rows)(*(entries[name] for name in ENTRY_FIELDS))


def _entry_batchable(m: int, rows: int):
  """:func:`entry_launch` for lists of ``m`` of the first ``rows`` rows,
  with a batching rule: a batch of blocks is one launch over their rows."""

  @jax.custom_batching.custom_vmap
  def lists(*fields):
    return entry_launch(fields, m, rows)

  @lists.def_vmap
  def _rule(axis_size, in_batched, *fields):
    if not any(in_batched):
      out = lists(*fields)
      return out, jax.tree.map(lambda _: False, out)
    fields = [(f if on else jnp.broadcast_to(f, (axis_size, *f.shape)))[:, :rows]
              for f, on in zip(fields, in_batched)]
    n, b, s = fields[0].shape
    out = entry_launch(tuple(f.reshape(n * b, s) for f in fields), m, n * b)
    out = jax.tree.map(lambda x: x.reshape(n, b, *x.shape[1:]), out)
    return out, jax.tree.map(lambda _: True, out)

  return lists


def entry_constexprs(slots: int, m: int, radix: int = _RADIX) -> dict:
  """The entry kernel's constexprs for ``slots`` slots and lists of ``m``
  (``radix``: bits a step of tau's select)."""
  return dict(S=slots, S_PAD=triton.next_power_of_2(slots), M=m, CAP=caps(m)[1],
              RADIX=radix, SLACK=tau_slack(m, True))


def entry_launch(fields, m: int, rows: int, *, radix: int = _RADIX,
                 num_warps: int = _LISTS_WARPS) -> dict:
  """The entry kernel through jax-triton on the first ``rows`` rows of
  :data:`ENTRY_FIELDS`' arrays (checked by :func:`entry_lists`).
  ``radix`` and ``num_warps``: the measured alternatives (4 bits a step,
  16 warps: both slower, docs/performance.md, "Lists from the plain
  kernel")."""
  _, s = fields[0].shape
  b = rows
  jt = noise.jax_triton_module()
  const = entry_constexprs(s, m, radix)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  vals, ids, bound, lse_max, lse_sum, best_t, best_id, _, _ = jt.triton_call(
      *fields, kernel=_entry_lists_kernel,
      out_shape=(f32(b, m), i32(b, m), f32(b), f32(b), f32(b), f32(b), i32(b),
                 f32(b, const["CAP"]), i32(b, const["CAP"])),
      grid=(b,), num_warps=num_warps, num_stages=_STAGES, name="flashsample_entry_lists",
      **const)
  return dict(cand_vals=vals, cand_ids=ids, cand_bound=bound, lse_max=lse_max,
              lse_sum=lse_sum, best_t=best_t, best_id=best_id)


def entry_lists_for_inspection(slots: int, m: int, *, capability: tuple[int, int] = (9, 0)):
  """The entry kernel compiled for ``capability`` without a GPU."""
  pointers = {f"{name}_ptr": ("*i32" if name.startswith("i") else "*fp32")
              for name in ENTRY_FIELDS}
  pointers.update({"vals_ptr": "*fp32", "ids_ptr": "*i32", "bound_ptr": "*fp32",
                   "lse_max_ptr": "*fp32", "lse_sum_ptr": "*fp32", "best_t_ptr": "*fp32",
                   "best_id_ptr": "*i32", "cand_v_ptr": "*fp32", "cand_i_ptr": "*i32"})
  return compile_for_inspection(_entry_lists_kernel, pointers, entry_constexprs(slots, m),
                                capability=capability, num_warps=_LISTS_WARPS,
                                num_stages=_STAGES)
