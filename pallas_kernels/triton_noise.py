"""JAX's threefry Gumbel noise as Triton device functions.

``jax.random.gumbel(key, shape)`` (jax 0.11, ``jax_threefry_partitionable``
on, the default) gives the element with 64-bit linear counter ``c``::

    (y0, y1) = threefry2x32(key, (c >> 32, c & 0xffffffff))
    bits     = y0 ^ y1
    u        = max(tiny, bitcast_f32((bits >> 9) | 0x3F800000) - 1)
    g        = -log(-log(u))                     (mode "low", the default)

The functions below compute exactly that on uint32 tensors, with the counter
carried as two uint32 words (``hi``, ``lo``) so that nothing needs 64-bit
integers. To be bit-identical to what XLA computes on an NVIDIA GPU they use
the same arithmetic XLA emits there:

* ``log`` is libdevice's ``__nv_logf`` (XLA links it without FTZ), here its
  core alone: ``log`` is taken of ``u`` (normal, >= 2**-126) and of
  ``-log(u)`` in [1.19e-7, 87.4], so its branches for subnormal, zero,
  negative, infinite and NaN inputs never change a result. The fmas are
  explicit; FTZ, if Triton's backend flushes, changes a result only when an
  fma input or result is subnormal, and every intermediate of the polynomial
  is 0 or far above 1e-30. The exhaustive GPU test over all 2**23 values of
  ``u`` checks the claim.
* negation flips the sign bit, as XLA's ``neg`` does; Triton's unary minus is
  ``0 - x``, which turns ``-0`` into ``+0`` (``log(-log(u))`` is exactly 0
  when ``-log(u)`` rounds to 1).
* no fma contraction: launch with ``enable_fp_fusion=False`` (the callers in
  :mod:`pallas_kernels.triton_sampler` do), so every add is ``add.rn``.

Under Triton's CPU interpreter (``TRITON_INTERPRET=1``; used by the tests)
libdevice is unavailable, so ``log`` falls back to NumPy's: the integer part
(threefry, counters, bits, ``u``) stays exact, the floats are within an ulp.

Also here: two tiny probe kernels and their jax-triton launchers
(:func:`random_bits`, :func:`gumbel_from_bits`) that tests use to compare the
noise with ``jax.random`` element by element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

__all__ = [
    "INTERPRET",
    "TINY",
    "rotl",
    "threefry2x32",
    "add_u32",
    "uniform_from_bits",
    "gumbel_from_bits_f32",
    "gumbel",
    "log_f32",
    "neg_f32",
    "random_bits",
    "gumbel_from_bits",
]

# Decided when the module is imported: triton.jit makes interpreter functions
# then too, so a module imported under the interpreter stays one.
INTERPRET = tl.constexpr(bool(triton.knobs.runtime.interpret))
# float32 tiny = 2**-126, the lower bound of jax.random.uniform's minval=tiny.
TINY = tl.constexpr(float(np.finfo(np.float32).tiny))
_KS_PARITY = tl.constexpr(0x1BD11BDA)
_SIGN_BIT = tl.constexpr(0x80000000)


@triton.jit
def rotl(x, d: tl.constexpr):
  """Rotate uint32 ``x`` left by the constant ``d`` (one ``shf`` on the GPU)."""
  return (x << d) | (x >> (32 - d))


@triton.jit
def _mix4(x0, x1, r0: tl.constexpr, r1: tl.constexpr, r2: tl.constexpr,
          r3: tl.constexpr):
  """Four threefry rounds: add, rotate, xor."""
  x0 = x0 + x1
  x1 = rotl(x1, r0) ^ x0
  x0 = x0 + x1
  x1 = rotl(x1, r1) ^ x0
  x0 = x0 + x1
  x1 = rotl(x1, r2) ^ x0
  x0 = x0 + x1
  x1 = rotl(x1, r3) ^ x0
  return x0, x1


@triton.jit
def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32, 20 rounds, as JAX's ``threefry2x32_p``.

  ``k0, k1`` (key words) and ``x0, x1`` (counter: high, low word) are uint32
  tensors of broadcast-compatible shapes; pass the key words per row (e.g.
  ``[1, Bt]``) so that the key schedule below is computed once per row and
  every injection costs one add per element.
  """
  k2 = k0 ^ k1 ^ _KS_PARITY
  # Injection i adds (ks[(i+1) % 3], ks[(i+2) % 3] + i + 1); the constants go
  # into the per-row words, not into every element.
  x0 = x0 + k0
  x1 = x1 + k1
  x0, x1 = _mix4(x0, x1, 13, 15, 26, 6)
  x0 = x0 + k1
  x1 = x1 + (k2 + 1)
  x0, x1 = _mix4(x0, x1, 17, 29, 16, 24)
  x0 = x0 + k2
  x1 = x1 + (k0 + 2)
  x0, x1 = _mix4(x0, x1, 13, 15, 26, 6)
  x0 = x0 + k0
  x1 = x1 + (k1 + 3)
  x0, x1 = _mix4(x0, x1, 17, 29, 16, 24)
  x0 = x0 + k1
  x1 = x1 + (k2 + 4)
  x0, x1 = _mix4(x0, x1, 13, 15, 26, 6)
  x0 = x0 + k2
  x1 = x1 + (k0 + 5)
  return x0, x1


@triton.jit
def add_u32(hi, lo, x):
  """64-bit ``(hi, lo) + x`` for uint32 words and uint32 ``x`` (exact: the
  carry out of the low word goes into the high word)."""
  lo2 = lo + x
  hi2 = hi + (lo2 < lo).to(tl.uint32)
  return hi2, lo2


@triton.jit
def uniform_from_bits(bits):
  """``u`` in ``[tiny, 1)`` from uint32 bits, as ``jax.random.uniform(key,
  minval=tiny)``: JAX computes ``max(tiny, f * (1 - tiny) + tiny)``, and in
  float32 ``1 - tiny == 1`` and ``f + tiny == f`` for every ``f >= 2**-23``,
  so that is ``max(tiny, f)``."""
  mant = (bits >> 9) | 0x3F800000
  f = mant.to(tl.float32, bitcast=True) - 1.0
  return tl.maximum(f, TINY)


@triton.jit
def log_f32(x):
  """Natural log as XLA computes it on NVIDIA GPUs, for the normal, positive,
  finite ``x`` the noise takes: libdevice ``__nv_logf``'s core without its
  branches for subnormal, zero, negative, infinite and NaN inputs (the
  Mosaic kernels' ``threefry.log_normal``, here with explicit fmas). Triton's
  ``tl.log`` is the approximate ``lg2.approx`` times ln 2."""
  if INTERPRET:
    return tl.log(x)
  else:
    bits = x.to(tl.int32, bitcast=True)
    # The exponent that brings x into [2/3, 4/3): x = m * 2**(e >> 23).
    e = (bits - 0x3F2AAAAB) & -8388608
    f = (bits - e).to(tl.float32, bitcast=True) - 1.0
    r = tl.fma(f, -0.13018856942653656, 0.1408461034297943)
    r = tl.fma(r, f, -0.12148627638816833)
    r = tl.fma(r, f, 0.1398061066865921)
    r = tl.fma(r, f, -0.16684235632419586)
    r = tl.fma(r, f, 0.20012299716472626)
    r = tl.fma(r, f, -0.24999669194221497)
    r = tl.fma(r, f, 0.333331823348999)
    r = tl.fma(r, f, -0.5)
    r = r * f
    r = tl.fma(r, f, f)
    return tl.fma(e.to(tl.float32) * 1.1920928955078125e-07, 0.6931471824645996, r)


@triton.jit
def neg_f32(x):
  """IEEE negation (sign-bit flip), as XLA's ``neg``: ``-(+0) = -0``."""
  return (x.to(tl.uint32, bitcast=True) ^ _SIGN_BIT).to(tl.float32, bitcast=True)


@triton.jit
def gumbel_from_bits_f32(bits):
  """Mode-"low" Gumbel noise ``-log(-log(u))`` from uint32 bits."""
  u = uniform_from_bits(bits)
  return neg_f32(log_f32(neg_f32(log_f32(u))))


@triton.jit
def gumbel(k0, k1, ctr_hi, ctr_lo):
  """Gumbel noise of the elements with 64-bit counters ``(ctr_hi, ctr_lo)``
  under key ``(k0, k1)``: ``jax.random.gumbel``'s value for that element."""
  y0, y1 = threefry2x32(k0, k1, ctr_hi, ctr_lo)
  return gumbel_from_bits_f32(y0 ^ y1)


# ----------------------------------------------------------------------------
# Probe kernels (tests): the noise element by element.
# ----------------------------------------------------------------------------

_PROBE_BLOCK = 1024


@triton.jit
def _bits_probe_kernel(key_ptr, hi_ptr, lo_ptr, add_ptr, out_ptr,
                       N: tl.constexpr, BLOCK: tl.constexpr):
  """out[i] = bits of counter (hi[i], lo[i]) + add[i] under key (key[0], key[1])."""
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  mask = offs < N
  k0 = tl.load(key_ptr)
  k1 = tl.load(key_ptr + 1)
  hi = tl.load(hi_ptr + offs, mask=mask, other=0)
  lo = tl.load(lo_ptr + offs, mask=mask, other=0)
  add = tl.load(add_ptr + offs, mask=mask, other=0)
  hi, lo = add_u32(hi, lo, add)
  y0, y1 = threefry2x32(k0, k1, hi, lo)
  tl.store(out_ptr + offs, y0 ^ y1, mask=mask)


@triton.jit
def _gumbel_probe_kernel(bits_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
  """out[i] = -log(-log(u(bits[i])))."""
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  mask = offs < N
  bits = tl.load(bits_ptr + offs, mask=mask, other=0)
  tl.store(out_ptr + offs, gumbel_from_bits_f32(bits), mask=mask)


def jax_triton_module():
  """jax_triton, imported on first use: it raises ImportError at import on a
  machine without a CUDA jaxlib, and these modules must import anywhere."""
  try:
    import jax_triton  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(
        "the triton kernels launch through jax-triton (0.3.1 for triton 3.6), "
        f"which needs a CUDA build of jaxlib: {e}") from e
  return jax_triton


def random_bits(key_words, ctr_hi, ctr_lo, add):
  """uint32 bits of counters ``(ctr_hi, ctr_lo) + add`` under one key, on the GPU.

  Args:
    key_words: uint32 ``[2]`` (``jax.random.key_data(key)``).
    ctr_hi, ctr_lo, add: uint32 ``[N]``.

  Returns:
    uint32 ``[N]``, equal to ``jax.random.bits``' words for those counters.
  """
  n = ctr_lo.shape[0]
  return jax_triton_module().triton_call(
      key_words, ctr_hi, ctr_lo, add, kernel=_bits_probe_kernel,
      out_shape=jax.ShapeDtypeStruct((n,), jnp.uint32),
      grid=(triton.cdiv(n, _PROBE_BLOCK),), enable_fp_fusion=False,
      N=n, BLOCK=_PROBE_BLOCK)


def gumbel_from_bits(bits):
  """float32 ``-log(-log(u(bits)))`` for uint32 ``bits [N]``, on the GPU."""
  n = bits.shape[0]
  return jax_triton_module().triton_call(
      bits, kernel=_gumbel_probe_kernel,
      out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
      grid=(triton.cdiv(n, _PROBE_BLOCK),), enable_fp_fusion=False,
      N=n, BLOCK=_PROBE_BLOCK)
