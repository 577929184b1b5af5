"""The plain kernel's last step on the GPU: the last warpgroup to finish
reduces every warpgroup's candidate to each row's token, inside the launch.

Without it a plain call is three kernels: the per-row data's fusion, the
sampling kernel, and XLA's row reduction of the kernel's candidates (stage
2), each launch with its gap (docs/performance.md, "Small batches"). Here
each compute warpgroup, once its tiles are done, stores its best ``(score,
id)`` per row, and counts itself in with one atomic add on a word that the
per-row data's fusion wrote as 0; the warpgroup that arrives last (it sees
``arrivals - 1``) reads every candidate and writes each row's best by the
tie rule, then sets the word back to 0. No warpgroup waits for another, so
no launch can deadlock on CTAs that are not resident.

The order of memory (PTX's model, the pattern of CUTLASS's inter-CTA
barrier): warp 0 stores the warpgroup's column, the warpgroup's barrier
orders those stores before thread 0's ``atom.add.acq_rel.gpu``, whose
release publishes them; in the last warpgroup the same atomic's acquire and
the barrier after it order every thread's reads of the others' columns,
which are ``ld.relaxed.gpu`` (past the SM's L1). The reads are issued
together, then compared: a compare after each pair of loads waited for one
round trip per column group (docs/performance.md, "Small batches").

Inline Mosaic GPU code: Pallas' interpret mode cannot run it, so there the
kernel writes its candidates and XLA reduces them (:func:`rules.argbest`,
the same rule). The tie rule here is :func:`pallas_kernels.rules.better`'s,
written in MLIR: NaN beats every number, then the larger score, then the
lower id.
"""

from __future__ import annotations

import math

from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref

__all__ = ["finish_rows"]

_WARPS = 4          # per warpgroup
_LANES = 32


def _i32(v: int):
  return mgpu_utils.c(v, ir.IntegerType.get_signless(32))


def _asm(ty, args, text, constraints):
  return llvm.inline_asm(ty, list(args), text, constraints, has_side_effects=True)


def _better(s_new, i_new, s_old, i_old):
  """:func:`rules.better` on scalars: True where (s_new, i_new) wins."""
  f = arith.CmpFPredicate
  nan_new = arith.cmpf(f.UNO, s_new, s_new)
  nan_old = arith.cmpf(f.UNO, s_old, s_old)
  same = arith.ori(arith.cmpf(f.OEQ, s_new, s_old), arith.andi(nan_new, nan_old))
  lower = arith.cmpi(arith.CmpIPredicate.slt, i_new, i_old)
  true = mgpu_utils.c(1, ir.IntegerType.get_signless(1))
  wins = arith.ori(arith.cmpf(f.OGT, s_new, s_old),
                   arith.andi(nan_new, arith.xori(nan_old, true)))
  return arith.ori(wins, arith.andi(same, lower))


def _take(best, cand):
  take = _better(cand[0], cand[1], best[0], best[1])
  return (arith.select(take, cand[0], best[0]), arith.select(take, cand[1], best[1]))


def _shuffle(x, offset: int):
  i32 = ir.IntegerType.get_signless(32)
  bits = x if x.type == i32 else arith.bitcast(i32, x)
  out = _asm(i32, [bits, _i32(offset)],
             "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r")
  return out if x.type == i32 else arith.bitcast(x.type, out)


def _load(ptr, ty, index):
  """``ld.relaxed.gpu`` of element ``index`` (i32) of a global f32/i32 array."""
  i64 = ir.IntegerType.get_signless(64)
  addr = arith.addi(llvm.ptrtoint(i64, ptr),
                    arith.muli(arith.extui(i64, index), mgpu_utils.c(4, i64)))
  kind = "f32" if ty == ir.F32Type.get() else "b32"
  reg = "f" if kind == "f32" else "r"
  return _asm(ty, [addr], f"ld.relaxed.gpu.global.{kind} $0, [$1];", f"={reg},l")


def _row_loads(s_ptr, i_ptr, row: int, lane, n_out: int):
  """Row ``row``'s candidates that lane ``lane`` reads: columns ``lane,
  lane + 32, ...``; the last round's lanes past the end reread the last
  column (a repeat changes no tie-rule best)."""
  f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
  out = []
  for k in range(math.ceil(n_out / _LANES)):
    col = arith.addi(lane, _i32(k * _LANES))
    if (k + 1) * _LANES > n_out:
      col = arith.minui(col, _i32(n_out - 1))
    at = arith.addi(_i32(row * n_out), col)
    out.append((_load(s_ptr, f32, at), _load(i_ptr, i32, at)))
  return out


def _warp_best(cands):
  """The tie rule's best of ``cands`` over the lanes, in every lane."""
  best = cands[0]
  for cand in cands[1:]:
    best = _take(best, cand)
  for offset in (16, 8, 4, 2, 1):
    best = _take(best, (_shuffle(best[0], offset), _shuffle(best[1], offset)))
  return best


def finish_rows(best, *, cand_refs, column_refs, out_refs, counter_ref, flag_ref,
                arrivals: int):
  """One compute warpgroup's end of the plain kernel (GPU only).

  Args:
    best: ``(score f32 [C], id int32 [C])``, this warpgroup's best per batch
      row over its tiles (layout ``WGMMA.reduce(0)``: each warp holds every
      column).
    cand_refs: ``(score, id)`` GMEM ``[C, n_out]``: every warpgroup's
      candidates.
    column_refs: this warpgroup's column of them, ``[C, 1]`` each.
    out_refs: ``(score, id)`` GMEM ``[C]``: the rows' best, written by the
      last warpgroup only.
    counter_ref: a GMEM uint32 ``[1]`` that holds 0 when the launch starts.
    flag_ref: SMEM int32 ``[1]``: this warpgroup's own word, for the count.
    arrivals: the compute warpgroups of the launch (each arrives once).
  """
  rows, n_out = cand_refs[0].shape
  col_layout = plgpu.Layout.WGMMA.reduce(0)

  @plgpu.inline_mgpu(arg_types=(col_layout, col_layout) + (plgpu.RefType(),) * 8)
  def run(_, b_s, b_i, c_s, c_i, col_s, col_i, o_s, o_i, counter, flag):
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    tid = arith.remui(mgpu_utils.thread_idx(), _i32(_WARPS * _LANES))
    warp = arith.divui(tid, _i32(_LANES))
    lane = arith.remui(tid, _i32(_LANES))
    eq = lambda a, b: arith.cmpi(arith.CmpIPredicate.eq, a, b)
    zero = mgpu_utils.c(0, index)

    # Warp 0 stores the warpgroup's column (every warp holds all of it);
    # the barrier orders those stores before thread 0's release.
    with mgpu_utils.when(eq(warp, _i32(0))):
      for x, ref in ((b_s, col_s), (b_i, col_i)):
        x.foreach(lambda v, idx, ref=ref: memref.store(v, ref, [idx[0], zero]))
    mgpu_utils.warpgroup_barrier()
    with mgpu_utils.when(eq(tid, _i32(0))):
      old = _asm(i32, [mgpu_utils.memref_ptr(counter)],
                 "atom.add.acq_rel.gpu.global.u32 $0, [$1], 1;", "=r,l")
      memref.store(old, flag, [zero])
    mgpu_utils.warpgroup_barrier()
    arrived = memref.load(flag, [zero])

    with mgpu_utils.when(eq(arrived, _i32(arrivals - 1))):
      s_ptr, i_ptr = mgpu_utils.memref_ptr(c_s), mgpu_utils.memref_ptr(c_i)
      for w in range(_WARPS):
        # Warp w reduces rows w, w + 4, ...: every load first (in flight
        # together), then the compares.
        mine = list(range(w, rows, _WARPS))
        if not mine:
          continue
        with mgpu_utils.when(eq(warp, _i32(w))):
          loads = [_row_loads(s_ptr, i_ptr, r, lane, n_out) for r in mine]
          for r, cands in zip(mine, loads):
            s, i = _warp_best(cands)
            with mgpu_utils.when(eq(lane, _i32(0))):
              memref.store(s, o_s, [mgpu_utils.c(r, index)])
              memref.store(i, o_i, [mgpu_utils.c(r, index)])
      with mgpu_utils.when(eq(tid, _i32(0))):
        memref.store(_i32(0), counter, [zero])

  run(*best, *cand_refs, *column_refs, *out_refs, counter_ref, flag_ref)
