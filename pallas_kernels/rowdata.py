"""The per-row inputs of every kernel, in one block addressed by field name.

Each batch row's key words, temperature, soft-cap and per-sample noise
counters travel to a kernel as one uint32 array ``[rows, B]``
(:func:`pack_rows`): one small copy per launch instead of several arrays.
The Mosaic GPU and the Triton kernels read its rows through
:class:`RowLayout`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

__all__ = ["RowLayout", "pack_rows"]


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """The rows of the per-row data block (uint32 ``[rows, N]``), by name.

  ``k0``/``k1``: the row's threefry key words; ``temperature``: the bits of
  its f32 temperature (0: greedy); ``softcap``: the bits of the f32 soft-cap
  (controls kernels only); ``inv_temperature``: the bits of ``1 / T`` as
  the device's XLA computes it (1 for greedy rows), see :func:`pack_rows`;
  then the 64-bit base counter ``(hi, lo)`` of each of ``samples`` samples
  (element ``v`` of sample ``s`` draws its noise at counter ``ctr(s) + v``).
  Padded to a multiple of 8 rows, so a block of N rows is a multiple of 128
  bytes (Lane-semantics copies need that).
  """

  samples: int = 1

  K0 = 0
  K1 = 1
  TEMPERATURE = 2
  SOFTCAP = 3
  INV_TEMPERATURE = 4
  FIXED = 5  # rows before the counters

  def ctr(self, sample: int = 0) -> tuple[int, int]:
    """Rows of sample ``sample``'s counter words ``(hi, lo)``."""
    return self.FIXED + 2 * sample, self.FIXED + 1 + 2 * sample

  @property
  def rows(self) -> int:
    return _round_up(self.FIXED + 2 * self.samples, 8)

  @property
  def zero(self) -> int:
    """A row that is always 0 (padding: ``FIXED + 2 S`` is odd, so the
    block always ends in one), read where a kernel needs a zero the
    compiler cannot see."""
    return self.rows - 1


def pack_rows(*, k0, k1, temperature, ctr_hi, ctr_lo, softcap=None):
  """The per-row block ``uint32 [RowLayout(S).rows, B]``.

  ``1 / T`` is computed here, by XLA: on a GPU XLA divides as
  ``div.full.f32``, and ``l * (1 / T)`` with that reciprocal equals XLA's own
  ``l / T`` bit for bit (every one of 33.5M quotients on an H200, PERF_LOG
  "Division"), so a kernel that multiplies by this row tempers exactly as
  the reference does on the device. (On a CPU XLA divides in IEEE, and a
  kernel run there divides by ``temperature``.)

  Args:
    k0, k1: uint32 ``[B]`` key words.
    temperature: f32 ``[B]``.
    ctr_hi, ctr_lo: uint32 ``[S, B]`` (or ``[B]`` for one sample): each
      sample's base counter.
    softcap: f32 scalar or ``[B]``, or None (the row holds 0).
  """
  b = k0.shape[0]
  ctr_hi, ctr_lo = (jnp.asarray(x, jnp.uint32).reshape(-1, b) for x in (ctr_hi, ctr_lo))
  bits = lambda x: lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
  cap = (jnp.zeros((b,), jnp.uint32) if softcap is None
         else jnp.broadcast_to(bits(softcap), (b,)))
  t = jnp.asarray(temperature, jnp.float32)
  inv = 1.0 / jnp.where(t == 0, 1.0, t)
  counters = jnp.stack([ctr_hi, ctr_lo], axis=1).reshape(-1, b)   # hi0, lo0, hi1, ..
  block = jnp.concatenate([jnp.stack([k0, k1, bits(t), cap, bits(inv)]), counters])
  layout = RowLayout(samples=ctr_hi.shape[0])
  return jnp.pad(block, [(0, layout.rows - block.shape[0]), (0, 0)])
