"""Counter-based Gumbel noise, bit-identical to ``jax.random.gumbel``.

Everything here is written with plain ``lax`` integer and float ops on uint32
values, so the same functions run inside ``jit``-ed XLA code (the ``xla``
backend, stage 2) and inside the Mosaic GPU kernels, which lower every op
used (docs/design.md, "Mosaic GPU facts"). ``flashsample_jax.noise`` is the
public name of this module.

How JAX makes Gumbel noise (jax 0.11, ``jax_threefry_partitionable=True``, the
default; see ``jax/_src/random/threefry2x32.py`` and ``core.py``):

* element with linear index ``c`` (a 64-bit counter) of ``gumbel(key, shape)``
  gets ``(hi, lo) = threefry2x32(key, (c >> 32, c & 0xffffffff))`` and
  ``bits = hi ^ lo``;
* ``u = max(tiny, bitcast_f32((bits >> 9) | 0x3F800000) - 1)``;
* ``g = -log(-log(u))`` (mode "low").

Counters are carried as two uint32 words ``(hi, lo)`` so nothing here needs
``jax_enable_x64``.
"""

from __future__ import annotations

import numpy as np
from jax import lax
import jax.numpy as jnp

__all__ = [
    "threefry2x32",
    "random_bits",
    "uniform_from_bits",
    "gumbel_from_bits",
    "gumbel",
    "log_normal",
    "add_u32",
    "mul_u32_wide",
    "GUMBEL_MIN",
    "GUMBEL_MAX",
]

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KS_PARITY = 0x1BD11BDA

# Bounds of mode-"low" Gumbel noise in float32: u is in [tiny, 1 - 2**-23].
# g(tiny) = -log(-log(1.1754944e-38)) = -4.46977; g(1 - 2**-23) = 15.94238.
# Rounded outwards; they bound how far below a row's best logit an element
# can be and still win (docs/design.md, "Gumbel bounds and an exact shortcut").
GUMBEL_MIN = -4.47
GUMBEL_MAX = 15.95


def _u32(x):
  return jnp.asarray(x, dtype=jnp.uint32)


def _rotl(x, d: int):
  # ``d`` is a Python int: shifts by constants lower everywhere.
  return lax.shift_left(x, _u32(d)) | lax.shift_right_logical(x, _u32(32 - d))


def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32 with 20 rounds, JAX's ``threefry2x32_p`` written in ``lax``.

  Args:
    k0, k1: uint32 key words (any broadcast-compatible shapes).
    x0, x1: uint32 counter words (``x0`` the high word, ``x1`` the low word).

  Returns:
    ``(y0, y1)``, uint32 arrays of the broadcast shape.
  """
  k0, k1, x0, x1 = (_u32(a) for a in (k0, k1, x0, x1))
  ks = (k0, k1, k0 ^ k1 ^ _u32(_KS_PARITY))
  x0 = x0 + ks[0]
  x1 = x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r)
      x1 = x0 ^ x1
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + _u32(i + 1)
  return x0, x1


def random_bits(k0, k1, ctr_hi, ctr_lo):
  """32 random bits per element, as ``jax.random.bits`` makes them."""
  y0, y1 = threefry2x32(k0, k1, ctr_hi, ctr_lo)
  return y0 ^ y1


def uniform_from_bits(bits):
  """Uniform float32 in ``[tiny, 1)``, as ``jax.random.uniform(key, minval=tiny)``."""
  mant = lax.shift_right_logical(bits, _u32(9)) | _u32(0x3F800000)
  u = lax.bitcast_convert_type(mant, jnp.float32) - jnp.float32(1.0)
  # JAX computes ``max(tiny, u * (1 - tiny) + tiny)``; in float32 ``1 - tiny``
  # rounds to 1 and ``u + tiny`` rounds to ``u`` for every u > 0 (u >= 2**-23),
  # so that is exactly ``max(tiny, u)``.
  return jnp.maximum(u, jnp.float32(np.finfo(np.float32).tiny))


# libdevice's ``__nv_logf`` (CUDA 13 ``libdevice.10.bc``), its polynomial for
# log1p(f), f = m - 1 with m in [2/3, 4/3), highest degree first.
_LOG_POLY = tuple(float.fromhex(h) for h in (
    "-0x1.0aa04ep-3", "0x1.2073ecp-3", "-0x1.f19b98p-4", "0x1.1e52aap-3",
    "-0x1.55b172p-3", "0x1.99da16p-3", "-0x1.fffe44p-3", "0x1.5554f0p-2", "-0x1p-1"))
_LN2 = float.fromhex("0x1.62e430p-1")


def log_normal(x):
  """``log(x)`` for normal, positive, finite float32 ``x``: the core of
  libdevice's ``__nv_logf``, which XLA calls for ``log`` on NVIDIA GPUs,
  without its branches for subnormal, zero, negative, infinite and NaN
  inputs.

  Bit-identical to ``__nv_logf`` where each ``a * b + c`` below becomes one
  fma, as it does in the Mosaic GPU kernels (their multiplies and adds are
  contractible, and nothing else uses the products). Both logs of the
  Gumbel noise see only such inputs: ``u`` lies in ``[tiny, 1 - 2**-23]``
  and ``-log(u)`` in ``[1.19e-7, 87.34]``. The GPU test suite checks all
  2**23 values of ``u`` against XLA's ``log``.
  """
  bits = lax.bitcast_convert_type(x, jnp.int32)
  # The exponent that brings x into [2/3, 4/3): x = m * 2**(e >> 23).
  e = (bits - jnp.int32(0x3F2AAAAB)) & jnp.int32(-(1 << 23))
  m = lax.bitcast_convert_type(bits - e, jnp.float32)
  f = m - jnp.float32(1.0)
  r = jnp.float32(_LOG_POLY[0])
  for c in _LOG_POLY[1:]:
    r = r * f + jnp.float32(c)
  r = r * f
  r = r * f + f
  return e.astype(jnp.float32) * jnp.float32(2.0 ** -23) * jnp.float32(_LN2) + r


def gumbel_from_bits(bits, log=jnp.log):
  """Mode-"low" Gumbel noise from random bits: ``-log(-log(u))``.

  ``log``: the logarithm to use (a kernel passes :func:`log_normal`, which
  equals XLA's GPU ``log`` on every value this takes)."""
  u = uniform_from_bits(bits)
  return -log(-log(u))


def gumbel(k0, k1, ctr_hi, ctr_lo, log=jnp.log):
  """Gumbel noise of the element with 64-bit counter ``(ctr_hi, ctr_lo)``."""
  return gumbel_from_bits(random_bits(k0, k1, ctr_hi, ctr_lo), log)


def add_u32(hi, lo, x):
  """64-bit ``(hi, lo) + x`` for uint32 words and a uint32 ``x``."""
  lo2 = lo + _u32(x)
  carry = (lo2 < lo).astype(jnp.uint32)
  return hi + carry, lo2


def mul_u32_wide(a, b):
  """Full 64-bit product of uint32 ``a`` and ``b`` as ``(hi, lo)`` uint32 words.

  Uses 16-bit limbs so it needs neither x64 mode nor a mul-hi instruction.
  """
  a, b = _u32(a), _u32(b)
  m16 = _u32(0xFFFF)
  a_lo, a_hi = a & m16, lax.shift_right_logical(a, _u32(16))
  b_lo, b_hi = b & m16, lax.shift_right_logical(b, _u32(16))
  ll = a_lo * b_lo
  lh = a_lo * b_hi
  hl = a_hi * b_lo
  hh = a_hi * b_hi
  # mid = lh + hl may carry into bit 32.
  mid = lh + hl
  mid_carry = (mid < lh).astype(jnp.uint32)
  lo = ll + lax.shift_left(mid, _u32(16))
  lo_carry = (lo < ll).astype(jnp.uint32)
  hi = (hh + lax.shift_right_logical(mid, _u32(16))
        + lax.shift_left(mid_carry, _u32(16)) + lo_carry)
  return hi, lo
