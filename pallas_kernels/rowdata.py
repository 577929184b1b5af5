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

__all__ = ["RowLayout", "Penalties", "pack_rows", "reciprocal"]


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
  (element ``v`` of sample ``s`` draws its noise at counter ``ctr(s) + v``);
  with ``penalties``, then the bits of the row's repetition penalty ``r``,
  of ``1 / r`` as XLA computes it (as ``inv_temperature``), of its presence
  and of its frequency penalty (:attr:`penalty_rows`); with ``given``, then
  the row's given id (int32 bits; :attr:`given_row`, for scoring given
  tokens). Padded to a multiple of 8 rows with at least one row of zeros
  (:attr:`zero`), so a block of N rows is a multiple of 128 bytes
  (Lane-semantics copies need that).
  """

  samples: int = 1
  penalties: bool = False
  given: bool = False

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
  def penalty_rows(self) -> tuple[int, int, int, int]:
    """Rows of ``(r, 1 / r, presence, frequency)`` (``penalties`` only)."""
    assert self.penalties
    first = self.FIXED + 2 * self.samples
    return first, first + 1, first + 2, first + 3

  @property
  def given_row(self) -> int:
    """Row of the given id (``given`` only)."""
    assert self.given
    return self.FIXED + 2 * self.samples + 4 * self.penalties

  @property
  def rows(self) -> int:
    fields = self.FIXED + 2 * self.samples + 4 * self.penalties + int(self.given)
    return _round_up(fields + 1, 8)   # + 1: the zero row

  @property
  def zero(self) -> int:
    """A row that is always 0 (the padding's last), read where a kernel
    needs a zero the compiler cannot see."""
    return self.rows - 1


@dataclasses.dataclass(frozen=True)
class Penalties:
  """Which penalties a kernel applies, and the bit-planes (one bit per row
  and id) that carry each row's history to it: with ``repetition`` first
  the plane of ids in the prompt or the output, then ``count_bits`` planes,
  bit ``k`` of the id's count in the output (with ``frequency``; else of
  ``min(count, 1)``, all that ``presence`` needs)."""

  repetition: bool
  presence: bool
  frequency: bool
  count_bits: int

  @property
  def planes(self) -> int:
    return int(self.repetition) + self.count_bits


def _bits(x):
  return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def reciprocal(x):
  """``1 / x`` (1 where ``x`` is 0), computed by XLA: on a GPU XLA divides
  as ``div.full.f32``, and ``l * (1 / x)`` with this reciprocal equals XLA's
  own ``l / x`` bit for bit (every one of 33.5M quotients on an H200,
  docs/design.md, "Division"); on a CPU XLA divides in IEEE, and a kernel run
  there divides by ``x``."""
  x = jnp.asarray(x, jnp.float32)
  return 1.0 / jnp.where(x == 0, 1.0, x)


def pack_rows(*, k0, k1, temperature, ctr_hi, ctr_lo, softcap=None,
              penalties=None, given=None):
  """The per-row block ``uint32 [RowLayout(S).rows, B]``.

  ``1 / T`` (and ``1 / r``) are computed here, by XLA: a kernel that
  multiplies by them divides exactly as the reference does on the device
  (:func:`reciprocal`).

  Args:
    k0, k1: uint32 ``[B]`` key words.
    temperature: f32 ``[B]``.
    ctr_hi, ctr_lo: uint32 ``[S, B]`` (or ``[B]`` for one sample): each
      sample's base counter.
    softcap: f32 scalar or ``[B]``, or None (the row holds 0).
    penalties: None, or f32 ``(repetition, presence, frequency)``, each
      ``[B]`` (1, 0, 0 where off): the rows of ``RowLayout(S, True)``.
    given: None, or int32 ``[B]``: each row's given id (``RowLayout(S,
      given=True)``).
  """
  b = k0.shape[0]
  ctr_hi, ctr_lo = (jnp.asarray(x, jnp.uint32).reshape(-1, b) for x in (ctr_hi, ctr_lo))
  cap = (jnp.zeros((b,), jnp.uint32) if softcap is None
         else jnp.broadcast_to(_bits(softcap), (b,)))
  t = jnp.asarray(temperature, jnp.float32)
  counters = jnp.stack([ctr_hi, ctr_lo], axis=1).reshape(-1, b)   # hi0, lo0, hi1, ..
  parts = [jnp.stack([k0, k1, _bits(t), cap, _bits(reciprocal(t))]), counters]
  if penalties is not None:
    r, pres, freq = (jnp.broadcast_to(jnp.asarray(x, jnp.float32), (b,)) for x in penalties)
    parts.append(jnp.stack([_bits(r), _bits(reciprocal(r)), _bits(pres), _bits(freq)]))
  if given is not None:
    parts.append(lax.bitcast_convert_type(jnp.asarray(given, jnp.int32), jnp.uint32)[None])
  block = jnp.concatenate(parts)
  layout = RowLayout(samples=ctr_hi.shape[0], penalties=penalties is not None,
                     given=given is not None)
  return jnp.pad(block, [(0, layout.rows - block.shape[0]), (0, 0)])
