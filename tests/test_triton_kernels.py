"""Tests of the Triton kernels (pallas_kernels.triton_*).

Three groups:

* compile (CPU, no GPU): the kernels lowered to PTX and cubin for sm80 and
  sm90 with Triton's bundled ptxas, as jax-triton compiles them. The PTX must
  temper by multiplying with XLA's reciprocal (``mul.rn.f32``, never fused
  into an fma), divide only as XLA does (``div.full.f32``, never IEEE
  ``div.rn.f32``), take logs through libdevice ``__nv_logf`` (no
  ``lg2.approx``), and the heuristic's configs must not spill.
* interpreter (CPU): the kernels run under Triton's interpreter on NumPy
  arrays and are compared with a NumPy mirror of the same math. Integer work
  (threefry, counters, masks, tie rules, tiling, both layouts) must match bit
  for bit; the interpreter's float ops are NumPy's (IEEE division, NumPy
  ``log``), so these tests pin the logic, not XLA's GPU rounding.
* gpu (marked ``gpu``): the kernels through jax-triton against XLA on the
  GPU, bit for bit: scores and ids of every (row, tile), the exhaustive noise
  over all 2**23 values of ``u``, ``jax.random.gumbel`` element by element.

Without triton the module skips; without a GPU the gpu group skips.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from jax.extend.random import threefry2x32_p  # noqa: E402

from pallas_kernels import triton_noise  # noqa: E402
from pallas_kernels import triton_sampler as ts  # noqa: E402
from pallas_kernels.rowdata import RowLayout  # noqa: E402
from tests.triton_host import HostTensor, run_interpreter_tests  # noqa: E402

INT_MAX = np.iinfo(np.int32).max
TINY = np.finfo(np.float32).tiny
C = ts.TritonConfig

# The interpreter must be on before triton is imported (triton.language's own
# helpers are jit functions too), so the interpreter tests run in a child
# process: test_interpreter_suite starts it with TRITON_INTERPRET=1 and runs
# this file's "interpreter" tests there; in the parent they skip.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRET, reason="runs in test_interpreter_suite's child process")
compiled_only = pytest.mark.skipif(INTERPRET, reason="needs compiled kernels")


# ----------------------------------------------------------------------------
# Inputs and a NumPy/JAX mirror of the kernel's math
# ----------------------------------------------------------------------------


def exact_problem(batch, dim, rows, *, layout="vd", dtype=jnp.bfloat16, seed=0,
                  logits=True):
  """Small-integer H and W: every logit and partial sum is exact in f32.

  Returns ``(h, w, logits f32 [B, rows] or None)``; generated as int8 so
  that a full LM head (622M weights) stays cheap on the host.
  """
  r = np.random.default_rng(seed)
  h = r.integers(-3, 4, (batch, dim), dtype=np.int8)
  w = r.integers(-3, 4, (rows, dim), dtype=np.int8)
  l = h.astype(np.float32) @ w.astype(np.float32).T if logits else None
  if layout == "dv":
    w = np.ascontiguousarray(w.T)
  return jnp.asarray(h).astype(dtype), jnp.asarray(w).astype(dtype), l


def fine_values(dtype, limit=8.0):
  """Every finite value of an 8-bit float ``dtype`` that is a multiple of
  2**-9 with magnitude <= ``limit`` (e4m3's subnormals included): with
  integer H in [-3, 3] and D <= 512, every partial sum is exact in f32."""
  v = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
  keep = np.isfinite(v) & (np.abs(v) <= limit) & (v * 512 == np.round(v * 512))
  return np.unique(v[keep])


def quantized_problem(batch, dim, rows, *, wdtype, layout="vd", dtype=jnp.bfloat16,
                      scale="row", seed=0, fine=True, logits=True):
  """Small-integer H in ``dtype`` and an 8-bit W with exact f32 logits,
  plus an f32 scale: ``"row"`` ``[rows]``, ``"tensor"`` ``()``, or None.

  W holds :func:`fine_values` (``fine``; small D only) or integers in
  [-3, 3]; int8 W spans its whole range. Scales are not powers of two: the
  logits ``f32(l * scale)`` are one rounding of an exact ``l``, the same
  wherever it is computed. Returns ``(h, w, scale, scaled logits f32 [B,
  rows] or None)``.
  """
  r = np.random.default_rng(seed)
  h = r.integers(-3, 4, (batch, dim), dtype=np.int8)
  wd = np.dtype(wdtype)
  if wd == np.int8:
    w = r.integers(-128, 128, (rows, dim), dtype=np.int8)
  elif fine:
    w = r.choice(fine_values(wd), (rows, dim)).astype(wd)
  else:  # converted on the device: a full head's 622M values stay cheap
    w = r.integers(-3, 4, (rows, dim), dtype=np.int8)
  if scale == "row":
    sc = r.uniform(2**-7, 0.5, rows).astype(np.float32)
  elif scale == "tensor":
    sc = np.float32(r.uniform(2**-7, 0.5))
  else:
    sc = None
  l = None
  if logits:
    l = h.astype(np.float32) @ w.astype(np.float32).T
    if sc is not None:
      l = (l * sc).astype(np.float32)
  if layout == "dv":
    w = np.ascontiguousarray(w.T)
  h = jnp.asarray(h).astype(dtype)
  return (h, jnp.asarray(w).astype(wd), None if sc is None else jnp.asarray(sc), l)


def make_rowdata(batch, *, seed=0, greedy_every=3, ctr_base=0, ctr_step=0,
                 temperatures=(0.25, 0.5, 1.0, 2.0)):
  """``(rowdata [8, B], parts)``: per-row keys, counters ``ctr_base + b *
  ctr_step`` (64-bit), power-of-two temperatures, every k-th row greedy
  (the rows of ``RowLayout(samples=1)``)."""
  keys = jax.random.split(jax.random.key(seed), batch)
  kd = np.asarray(jax.random.key_data(keys), np.uint32)
  r = np.random.default_rng(seed)
  t = r.choice(np.asarray(temperatures, np.float32), batch)
  if greedy_every:
    t[::greedy_every] = 0.0
  ctr = np.uint64(ctr_base) + np.arange(batch, dtype=np.uint64) * np.uint64(ctr_step)
  hi = (ctr >> np.uint64(32)).astype(np.uint32)
  lo = (ctr & np.uint64(0xFFFFFFFF)).astype(np.uint32)
  rowdata = _pack(kd[:, 0], kd[:, 1], t, hi, lo)
  return rowdata, dict(k0=kd[:, 0], k1=kd[:, 1], hi=hi, lo=lo, t=t)


def _pack(k0, k1, t, hi, lo, cap=None):
  """NumPy copy of the RowLayout packing: k0, k1, T, soft-cap, 1 / T (the
  Triton kernels divide themselves and never read it), then (hi, lo) per
  sample, padded to a multiple of 8 rows."""
  b = k0.shape[0]
  hi, lo = np.asarray(hi).reshape(-1, b), np.asarray(lo).reshape(-1, b)
  caps = np.zeros(b, np.float32) if cap is None else np.asarray(cap, np.float32)
  inv = (1 / np.where(t == 0, 1, t)).astype(np.float32)
  rows = np.concatenate([np.stack([k0, k1, t.view(np.uint32), caps.view(np.uint32),
                                   inv.view(np.uint32)]),
                         np.stack([hi, lo], axis=1).reshape(-1, b)]).astype(np.uint32)
  return np.pad(rows, [(0, -rows.shape[0] % 8), (0, 0)])


def threefry_bits(k0, k1, hi, lo, add):
  """uint32 bits of counters (hi, lo) + add (broadcast), through JAX's own
  threefry primitive."""
  lo2 = (lo + add).astype(np.uint32)
  hi2 = (hi + (lo2 < lo)).astype(np.uint32)
  shape = np.broadcast_shapes(np.shape(k0), np.shape(lo2))
  b = lambda x: jnp.asarray(np.broadcast_to(x, shape), jnp.uint32)
  y0, y1 = threefry2x32_p.bind(b(k0), b(k1), b(hi2), b(lo2))
  return np.asarray(y0 ^ y1)


def numpy_gumbel(bits):
  """The interpreter's noise: the kernel's ops in NumPy float32."""
  u = ((bits >> 9) | np.uint32(0x3F800000)).view(np.float32) - np.float32(1)
  u = np.maximum(u, np.float32(TINY))
  with np.errstate(divide="ignore"):
    return -np.log(-np.log(u))


def mirror_scores(logits, parts, *, offset, rows_valid, vocab_size):
  """``s [B, rows]`` as the kernel computes it, in NumPy (interpreter floats)."""
  b, rows = logits.shape
  gid = (offset + np.arange(rows)).astype(np.uint32)
  bits = threefry_bits(parts["k0"][:, None], parts["k1"][:, None],
                       parts["hi"][:, None], parts["lo"][:, None], gid[None, :])
  g = numpy_gumbel(bits)
  t = parts["t"][:, None]
  inv = (np.float32(1) / np.where(t == 0, np.float32(1), t)).astype(np.float32)
  s = np.where(t == 0, logits, (logits * inv).astype(np.float32) + g)
  valid = (np.arange(rows) < rows_valid) & (offset + np.arange(rows) < vocab_size)
  return np.where(valid[None, :], s, -np.inf).astype(np.float32), valid


def tile_best(s, valid, block_v, offset):
  """Per (row, tile) best (score, global id) with the combine rule."""
  b, rows = s.shape
  n_tiles = -(-rows // block_v)
  pad = n_tiles * block_v - rows
  s = np.pad(s, ((0, 0), (0, pad)), constant_values=-np.inf).reshape(b, n_tiles, block_v)
  v = np.pad(valid, (0, pad)).reshape(n_tiles, block_v)[None]
  gid = (offset + np.arange(n_tiles * block_v)).reshape(n_tiles, block_v)[None]
  nan = np.isnan(s)
  m = np.where(nan.any(-1), np.nan, np.max(np.where(nan, -np.inf, s), -1))
  hit = v & np.where(nan.any(-1, keepdims=True), nan, s == m[..., None])
  idx = np.min(np.where(hit, gid, INT_MAX), -1)
  return m.astype(np.float32), idx.astype(np.int32)


def _rowdata_and_categorical(b, v, t, lt, per_row_keys):
  """The packed rows of key 3 (``[B]`` split keys or one scalar key) and
  ``jax.random.categorical``'s tokens for the tempered logits ``lt``."""
  if per_row_keys:
    keys = jax.random.split(jax.random.key(3), b)
    kd = jax.random.key_data(keys)
    ctr = jnp.zeros((b,), jnp.uint32)
    return (ts.pack_rowdata(kd[:, 0], kd[:, 1], ctr, ctr, t),
            jax.vmap(jax.random.categorical)(keys, lt))
  key = jax.random.key(3)
  kd = jax.random.key_data(key)
  base = np.arange(b, dtype=np.uint64) * np.uint64(v)
  rowdata = ts.pack_rowdata(
      jnp.full((b,), kd[0]), jnp.full((b,), kd[1]),
      (base >> np.uint64(32)).astype(np.uint32), base.astype(np.uint32), t)
  return rowdata, jax.random.categorical(key, lt)


def assert_controls_outputs(got, want, ctl):
  """The controls kernel's outputs against the mirror's: the RL fields,
  each sample's best (and its t), the log-sum-exp, the lists."""
  assert_rl_fields(got, want, ctl, rtol=1e-6)
  eq = np.testing.assert_array_equal
  for s_ in range(ctl.samples):
    eq(got.best_index[:, s_], want["best_index"][s_])
    eq(got.best_score[:, s_], want["best_score"][s_])
    if ctl.t_best:
      eq(got.best_t[:, s_], want["best_t"][s_])
  if ctl.lse:
    eq(got.lse_max, want["lse_max"])
    np.testing.assert_allclose(got.lse_sum, want["lse_sum"], rtol=1e-6)
  else:
    assert got.lse_max is None
  if ctl.top_k:
    for j in range(ctl.top_k):
      eq(got.cand_ids[:, j], want["cand_ids"][j])
      eq(got.cand_vals[:, j], want["cand_vals"][j])
    eq(got.bound, want["bound"])


def reduce_tiles(score, index):
  """The combine rule over the tile axis (what stage 2 does)."""
  nan = np.isnan(score)
  m = np.where(nan.any(-1), np.nan, np.max(np.where(nan, -np.inf, score), -1))
  hit = np.where(nan.any(-1, keepdims=True), nan, score == m[:, None])
  return m, np.min(np.where(hit, index, INT_MAX), -1)


# ----------------------------------------------------------------------------
# Compile (no GPU)
# ----------------------------------------------------------------------------

_CUOBJDUMP = f"{triton.backends.nvidia.__path__[0]}/bin/cuobjdump"


def registers(cubin: bytes, tmp_path) -> tuple[int, int]:
  """``(registers per thread, stack bytes)`` of a cubin (stack > 0: spills)."""
  f = tmp_path / "k.cubin"
  f.write_bytes(cubin)
  out = subprocess.run([_CUOBJDUMP, "-res-usage", str(f)], capture_output=True,
                       text=True, check=True).stdout
  reg, stack = re.search(r"REG:(\d+) STACK:(\d+)", out).groups()
  return int(reg), int(stack)


def float_ops(ptx: str) -> set[str]:
  return set(re.findall(r"^\s+((?:div|lg2|ex2|rcp|sqrt)\.[\w.]+)", ptx, re.M))


_COMPILE_CASES = [
    # (capability, layout, dtype, batch, config)
    ((9, 0), "vd", jnp.bfloat16, 1, None),
    ((9, 0), "dv", jnp.bfloat16, 1, None),
    ((9, 0), "vd", jnp.float16, 64, None),
    ((9, 0), "dv", jnp.bfloat16, 128, None),
    ((8, 0), "vd", jnp.bfloat16, 16, None),
    ((8, 0), "dv", jnp.float16, 64, None),
    # The H200's own rows where they differ from the H100's (a CPU has no
    # device kind, so the heuristic above picks the H100's table).
    ((9, 0), "vd", jnp.bfloat16, 1, ts.CONFIGS["sm90-h200"][0][1]),
]


@compiled_only
@pytest.mark.parametrize("capability,layout,dtype,batch,config", _COMPILE_CASES)
def test_sampler_compiles_with_xla_arithmetic(capability, layout, dtype, batch,
                                              config, tmp_path):
  """PTX of the heuristic's config: XLA's quotient and log, no spills."""
  cfg = config or ts.pick_config(batch, 4096, 151936, capability)
  k = ts.sampler_for_inspection(cfg, layout=layout, dtype=dtype, batch=batch,
                                dim=4096, rows=151936, capability=capability)
  ptx = k.asm["ptx"]
  ops = float_ops(ptx)
  # l * (1 / T): XLA's reciprocal from the per-row data, rounded before the
  # noise is added (no fma), and no division of its own.
  assert "mul.rn.f32" in ptx
  assert not any(op.startswith("div") for op in ops), ops
  # libdevice __nv_logf is inlined as an fma polynomial; tl.log would be
  # the approximate lg2.approx.
  assert not any(op.startswith("lg2") for op in ops), ops
  assert "0f3F317218" in ptx  # ln 2 of __nv_logf's final fma
  assert ptx.count("shf.l.wrap.b32") > 0  # the threefry rotations
  reg, stack = registers(k.asm["cubin"], tmp_path)
  assert stack == 0, f"{cfg} spills: {stack} bytes of stack, {reg} registers"
  assert k.metadata.shared <= ts.SMEM_BYTES[ts.gpu_family(capability)]


@compiled_only
@pytest.mark.parametrize("capability,batch,tanh,samples,top_k,noise,rl", [
    ((9, 0), 1, 0, 2, 8, True, False), ((9, 0), 64, 1, 2, 8, True, True),
    ((8, 0), 32, 0, 2, 8, True, False),
    # The RL fields where they came near the registers: several samples at
    # 16 warps (sm90, B = 128); sm80's 8-warp configs with the noise and with
    # a noise-free list.
    ((9, 0), 128, 1, 4, 4, True, True), ((8, 0), 64, 1, 1, 0, True, True),
    ((8, 0), 32, 1, 1, 4, False, True)])
def test_controls_compile(capability, batch, tanh, samples, top_k, noise, rl, tmp_path):
  """Every control on (and the RL fields): XLA's division, no IEEE division
  or approximate log, and the controls heuristic's config does not spill."""
  from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
  ctl = tc.Controls(samples=samples, softcap=True, bias=True, mask=True, t_best=True,
                    lse=True, top_k=top_k, tanh=tanh, noise=noise, entropy=rl, raw=rl,
                    finite=rl, given=rl)
  cfg = tc.pick_controls_config(batch, 4096, 151936, capability, ctl)
  k = tc.controls_for_inspection(cfg, ctl, layout="vd", dtype=jnp.bfloat16,
                                 batch=batch, dim=4096, rows=151936,
                                 capability=capability)
  ops = float_ops(k.asm["ptx"])
  assert "div.full.f32" in ops
  assert not any(op.startswith(("div.rn", "lg2")) for op in ops), ops
  reg, stack = registers(k.asm["cubin"], tmp_path)
  assert stack == 0, f"{cfg} spills: {stack} bytes of stack, {reg} registers"


@compiled_only
@pytest.mark.parametrize("batch,samples,top_k,rl", [
    (512, 1, 0, False), (128, 1, 8, False), (512, 2, 8, True), (64, 1, 8, True)])
def test_batch_invariant_controls_compile(batch, samples, top_k, rl, tmp_path):
  """The batch-invariant configs (docs/design.md, "Determinism and RL") do
  not spill on sm90: 32 elements a thread with the log-probabilities and
  the lists, 16 with several samples or the RL fields."""
  from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
  ctl = tc.Controls(samples=samples, softcap=rl, bias=rl, mask=rl, t_best=True, lse=True,
                    top_k=top_k, tanh=int(rl), entropy=rl, raw=rl, finite=rl, given=rl)
  cfg = tc.pick_controls_config(batch, 4096, 151936, (9, 0), ctl, batch_invariant=True)
  assert cfg.vocab_on_m and cfg.block_v == tc.INVARIANT_BLOCK_V
  k = tc.controls_for_inspection(cfg, ctl, layout="vd", dtype=jnp.bfloat16, batch=batch,
                                 dim=4096, rows=151936, capability=(9, 0))
  reg, stack = registers(k.asm["cubin"], tmp_path)
  assert stack == 0, f"{cfg} spills: {stack} bytes of stack, {reg} registers"


E4M3, E5M2, I8 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8

_QUANT_COMPILE_CASES = [
    # (capability, layout, H dtype, W dtype, batch, scale mode); below sm90
    # the 8-bit floats come as bytes (triton_sampler's module docstring).
    ((9, 0), "vd", jnp.bfloat16, E4M3, 1, ts.SCALE_ROW),
    ((9, 0), "dv", jnp.bfloat16, E4M3, 1, ts.SCALE_TENSOR),
    ((9, 0), "vd", jnp.float16, E5M2, 16, ts.SCALE_ROW),
    ((9, 0), "dv", jnp.bfloat16, I8, 64, ts.SCALE_ROW),
    ((9, 0), "vd", jnp.bfloat16, E4M3, 128, ts.SCALE_TENSOR),
    ((8, 0), "vd", jnp.bfloat16, E4M3, 1, ts.SCALE_ROW),
    ((8, 0), "dv", jnp.bfloat16, E5M2, 16, ts.SCALE_TENSOR),
    ((8, 0), "vd", jnp.float16, I8, 64, ts.SCALE_ROW),
    ((8, 9), "dv", jnp.bfloat16, E5M2, 1, ts.SCALE_ROW),
    ((8, 9), "vd", jnp.float16, E4M3, 32, ts.SCALE_TENSOR),
]
# Cases also compiled without the scale, to count its multiplies.
_SCALE_COUNT_CASES = {0, 5, 8}


@compiled_only
@pytest.mark.parametrize("case", range(len(_QUANT_COMPILE_CASES)))
def test_quantized_sampler_compiles(case, tmp_path):
  """8-bit weights: the heuristic's 8-bit config compiles for each
  conversion (Triton's, e4m3 bits, e5m2 through f16) without spills, and
  the scale is one separate ``mul.rn.f32`` per accumulator element: the
  kernel without it has exactly that many fewer and the same fmas (no
  contraction), and XLA's quotient and log stay as in the float kernel."""
  capability, layout, dtype, wdtype, batch, scale = _QUANT_COMPILE_CASES[case]
  cfg = ts.pick_config(batch, 4096, 151936, capability, w_itemsize=1, layout=layout)
  compile_ = lambda scale: ts.sampler_for_inspection(
      cfg, layout=layout, dtype=dtype, batch=batch, dim=4096, rows=151936,
      capability=capability, weight_dtype=wdtype, scale=scale)
  k = compile_(scale)
  ptx = k.asm["ptx"]
  ops = float_ops(ptx)
  assert not any(op.startswith(("div", "lg2")) for op in ops), ops
  assert "0f3F317218" in ptx  # __nv_logf
  assert not re.search(r"\b(add|mul)\.f32", ptx)  # every f32 add/mul is .rn
  reg, stack = registers(k.asm["cubin"], tmp_path)
  assert stack == 0, f"{cfg} spills: {stack} bytes of stack, {reg} registers"
  assert k.metadata.shared <= ts.SMEM_BYTES[ts.gpu_family(capability)]
  assert cfg.smem_bytes(2, 1) <= ts.SMEM_BYTES[ts.gpu_family(capability)]
  if case in _SCALE_COUNT_CASES:
    plain = compile_(ts.SCALE_NONE).asm["ptx"]
    fma = lambda p: len(re.findall(r"fma\.rn(\.ftz)?\.f32", p))
    per_thread = cfg.block_v * cfg.block_b // (32 * cfg.num_warps)
    assert ptx.count("mul.rn.f32") - plain.count("mul.rn.f32") == per_thread
    assert fma(ptx) == fma(plain)


@compiled_only
@pytest.mark.parametrize("capability,layout,wdtype,batch", [
    ((9, 0), "vd", E4M3, 1), ((9, 0), "dv", E5M2, 16), ((8, 0), "dv", E4M3, 32)])
def test_quantized_controls_compile(capability, layout, wdtype, batch, tmp_path):
  """Every control on, an 8-bit weight with per-row scales: the controls
  heuristic's config does not spill, XLA's division stays."""
  from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
  ctl = tc.Controls(samples=2, softcap=True, bias=True, mask=True, t_best=True,
                    lse=True, top_k=8)
  cfg = tc.pick_controls_config(batch, 4096, 151936, capability, ctl, w_itemsize=1,
                                layout=layout)
  k = tc.controls_for_inspection(cfg, ctl, layout=layout, dtype=jnp.bfloat16,
                                 batch=batch, dim=4096, rows=151936,
                                 capability=capability, weight_dtype=wdtype,
                                 scale=ts.SCALE_ROW)
  ops = float_ops(k.asm["ptx"])
  assert "div.full.f32" in ops
  assert not any(op.startswith(("div.rn", "lg2")) for op in ops), ops
  reg, stack = registers(k.asm["cubin"], tmp_path)
  assert stack == 0, f"{cfg} spills: {stack} bytes of stack, {reg} registers"


@compiled_only
def test_softcap_clamp_keeps_nan_compile():
  """The rational tanh's clamp keeps a NaN (``min.NaN.f32`` /
  ``max.NaN.f32``): Triton's default min and max (``min.f32``, the kernel's
  only f32 min) return the other operand, and soft-capped a NaN logit to a
  number where the reference's ``c * tanh(x / c)`` is NaN (an H200: 8 of 24
  rows of 0 * inf logits sampled other ids than the reference)."""
  from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
  ctl = tc.Controls(samples=1, softcap=True, lse=True, top_k=4)
  cfg = tc.pick_controls_config(16, 4096, 151936, (9, 0), ctl, layout="vd")
  k = tc.controls_for_inspection(cfg, ctl, layout="vd", dtype=jnp.bfloat16, batch=16,
                                 dim=4096, rows=151936, capability=(9, 0))
  ops = set(re.findall(r"^\s+((?:min|max)\.[\w.]+)", k.asm["ptx"], re.M))
  assert "min.NaN.f32" in ops and "min.f32" not in ops, ops


@compiled_only
def test_inspection_compiles_after_jax_triton_import(monkeypatch):
  """jax_triton sets TRITON_CACHE_DIR to "" when imported (as on the GPU
  machines, where the PTX tests then failed with "Could not create or locate
  cache dir"): the inspection compile brings its own cache and leaves the
  variable as it found it."""
  monkeypatch.setenv("TRITON_CACHE_DIR", "")
  k = ts.compile_for_inspection(
      triton_noise._gumbel_probe_kernel,  # pylint: disable=protected-access
      {"bits_ptr": "*u32", "out_ptr": "*fp32"}, {"N": 4096, "BLOCK": 1024},
      capability=(9, 0), num_warps=4, num_stages=1)
  assert ".entry" in k.asm["ptx"]
  assert os.environ["TRITON_CACHE_DIR"] == ""


@compiled_only
def test_noise_probe_ptx():
  """The Gumbel probe: __nv_logf's core twice, no negation as 0 - x, no approx."""
  k = ts.compile_for_inspection(
      triton_noise._gumbel_probe_kernel,  # pylint: disable=protected-access
      {"bits_ptr": "*u32", "out_ptr": "*fp32"}, {"N": 4096, "BLOCK": 1024},
      capability=(9, 0), num_warps=4, num_stages=1)
  ptx = k.asm["ptx"]
  assert not float_ops(ptx), float_ops(ptx)  # no div / lg2 / ex2 / rcp
  # __nv_logf's core twice per element (the tiny clamp once): 10 fmas per
  # log, and none of its special-case tests (e.g. x < 2**-126).
  n_fma = len(re.findall(r"fma\.rn(\.ftz)?\.f32", ptx))
  assert n_fma == 20 * ptx.count("max.f32") > 0
  assert not re.search(r"setp\.[a-z]+\.f32\s+%p\d+, %r\d+, 0f00800000", ptx)
  assert "0f3F317218" in ptx  # ln 2 of its final fma
  # Negation is a sign flip (neg.f32, or folded into an fma's operands,
  # exact either way), never 0 - x.
  assert "sub.rn.f32" not in ptx and "sub.f32" not in ptx
  # Without fp fusion every add/mul carries .rn, which ptxas may not contract.
  assert not re.search(r"\b(add|mul)\.f32", ptx)


# ----------------------------------------------------------------------------
# Interpreter (CPU)
# ----------------------------------------------------------------------------


@compiled_only
def test_interpreter_suite():
  run_interpreter_tests(__file__)


@pytest.fixture(scope="module")
def interp():
  """The kernel modules, imported under the interpreter (child process)."""
  mods = {"triton_noise": triton_noise, "triton_sampler": ts}
  try:
    from pallas_kernels import triton_controls  # pylint: disable=import-outside-toplevel
    mods["triton_controls"] = triton_controls
  except ImportError:
    pass
  assert triton_noise.INTERPRET
  return mods


def weight_args(mod, w, scale, convert):
  """``(W, scale)`` host arrays and the weight constexprs, as the launcher
  passes them: the scale as ``[1]`` (per tensor) or ``[rows]``; for the
  bit conversions the weight's bytes as uint8."""
  w = np.asarray(w)
  if convert != mod.CONVERT_DIRECT:
    w = w.view(np.uint8)
  if scale is None:
    mode, s = mod.SCALE_NONE, np.zeros(1, np.float32)
  else:
    s = np.asarray(scale, np.float32)
    mode = mod.SCALE_TENSOR if s.ndim == 0 else mod.SCALE_ROW
    s = s.reshape(-1)
  return HostTensor(w), HostTensor(s), dict(scale=mode, convert=convert)


def run_sampler(mod, h, w, rowdata, *, offset, layout, vocab_size, rows_valid,
                cfg, scale=None, convert=0):
  """The sampler kernel under the interpreter; returns (score, index)."""
  b, d = h.shape
  rows = w.shape[0] if layout == "vd" else w.shape[1]
  w_arg, s_arg, wconsts = weight_args(mod, w, scale, convert)
  consts = mod.sampler_constexprs(cfg, batch=b, dim=d, rows=rows,
                                  rows_valid=rows_valid, vocab_size=vocab_size,
                                  layout=layout, **wconsts)
  n = consts["N_TILES"]
  args = [HostTensor(np.asarray([offset], np.int32)), HostTensor(rowdata),
          HostTensor(np.asarray(h)), w_arg, s_arg,
          HostTensor(np.zeros((b, n), np.float32)),
          HostTensor(np.zeros((b, n), np.int32))]
  grid = (triton.cdiv(b, cfg.block_b), n)
  mod._sampler_kernel[grid](*args, **consts)  # pylint: disable=protected-access
  return args[5].a, args[6].a


@interpreter_only
def test_interpreter_noise_matches_jax(interp):
  """Bits bit for bit (with 64-bit carries), the noise within NumPy's log."""
  m = interp["triton_noise"]
  key = jax.random.key(11)
  kw = np.asarray(jax.random.key_data(key), np.uint32)
  n = 3000
  shape = (3, 1000)
  c = np.arange(n, dtype=np.uint64)
  hi, lo = (c >> np.uint64(32)).astype(np.uint32), c.astype(np.uint32)
  args = [HostTensor(x) for x in (kw, hi, lo, np.zeros(n, np.uint32),
                                  np.zeros(n, np.uint32))]
  m._bits_probe_kernel[(3,)](*args, N=n, BLOCK=1024)  # pylint: disable=protected-access
  bits = args[4].a
  np.testing.assert_array_equal(
      bits, np.asarray(jax.random.bits(key, shape, jnp.uint32)).reshape(-1))
  g = [HostTensor(bits), HostTensor(np.zeros(n, np.float32))]
  m._gumbel_probe_kernel[(3,)](*g, N=n, BLOCK=1024)  # pylint: disable=protected-access
  np.testing.assert_array_equal(g[1].a, numpy_gumbel(bits))
  np.testing.assert_allclose(g[1].a, np.asarray(jax.random.gumbel(key, shape)).reshape(-1),
                             rtol=0, atol=1e-6)
  # Counters that carry into the high word: (7, 2**32 - 100) + [0, n).
  hi = np.full(n, 7, np.uint32)
  lo = np.full(n, 2**32 - 100, np.uint32)
  add = np.arange(n, dtype=np.uint32)
  args = [HostTensor(x) for x in (kw, hi, lo, add, np.zeros(n, np.uint32))]
  m._bits_probe_kernel[(3,)](*args, N=n, BLOCK=1024)  # pylint: disable=protected-access
  np.testing.assert_array_equal(args[4].a, threefry_bits(kw[0], kw[1], hi, lo, add))


# (layout, dtype, B, D, rows, rows_valid, vocab_size, offset, config)
_INTERP_CASES = [
    ("vd", jnp.bfloat16, 5, 64, 300, 300, 300, 0, C(64, 16, 32, 4, 2)),
    ("dv", jnp.bfloat16, 5, 64, 300, 290, 1000, 128, C(64, 16, 32, 4, 2)),
    ("vd", jnp.float16, 20, 80, 200, 190, 300, 100, C(32, 16, 32, 4, 2, False)),
    ("dv", jnp.float16, 17, 48, 130, 130, 200, 64, C(64, 32, 16, 4, 2, False)),
]


@interpreter_only
@pytest.mark.parametrize("layout,dtype,b,d,rows,rows_valid,vocab,offset,cfg",
                         _INTERP_CASES)
def test_interpreter_sampler(interp, layout, dtype, b, d, rows, rows_valid,
                             vocab, offset, cfg):
  """Every (row, tile) candidate equals the NumPy mirror bit for bit: B and
  V not multiples of the blocks, padding rows, ids past vocab_size, greedy
  rows, a vocabulary offset, D not a multiple of block_d, counters that
  carry into the high word."""
  h, w, logits = exact_problem(b, d, rows, layout=layout, dtype=dtype, seed=b)
  rowdata, parts = make_rowdata(b, seed=d, ctr_base=2**32 - 150, ctr_step=2**31 + 7)
  score, index = run_sampler(interp["triton_sampler"], h, w, rowdata,
                             offset=offset, layout=layout, vocab_size=vocab,
                             rows_valid=rows_valid, cfg=cfg)
  s, valid = mirror_scores(logits, parts, offset=offset, rows_valid=rows_valid,
                           vocab_size=vocab)
  want_s, want_i = tile_best(s, valid, cfg.block_v, offset)
  np.testing.assert_array_equal(index, want_i)
  np.testing.assert_array_equal(score, want_s)


@interpreter_only
def test_interpreter_tokens_equal_categorical(interp):
  """One key for the batch (row counters b * V): the reduced candidates are
  ``jax.random.categorical``'s tokens (greedy rows: ``argmax``)."""
  b, d, v = 6, 32, 250
  h, w, logits = exact_problem(b, d, v, seed=3)
  key = jax.random.key(5)
  kd = np.asarray(jax.random.key_data(key), np.uint32)
  t = np.asarray([0.5, 1.0, 0.0, 2.0, 0.25, 1.0], np.float32)
  ctr = np.arange(b, dtype=np.uint64) * np.uint64(v)
  rowdata = _pack(np.full(b, kd[0]), np.full(b, kd[1]), t,
                  (ctr >> np.uint64(32)).astype(np.uint32), ctr.astype(np.uint32))
  score, index = run_sampler(interp["triton_sampler"], h, w, rowdata, offset=0,
                             layout="vd", vocab_size=v, rows_valid=v,
                             cfg=C(64, 16, 32, 4, 2))
  _, tokens = reduce_tiles(score, index)
  lt = logits / np.where(t == 0, 1, t)[:, None]
  want = np.asarray(jax.random.categorical(key, jnp.asarray(lt)))
  sampled = t > 0
  np.testing.assert_array_equal(tokens[sampled], want[sampled])
  np.testing.assert_array_equal(tokens[~sampled], np.argmax(logits, -1)[~sampled])


@interpreter_only
def test_interpreter_nan_and_ties(interp):
  """A NaN logit wins its tile (lowest NaN id); equal scores take the lower
  id; a tile with no valid id gives (-inf, INT32_MAX)."""
  b, d, rows = 2, 16, 64
  h = np.zeros((b, d), np.float32)
  h[:, 0] = 1.0
  w = np.zeros((rows, d), np.float32)
  w[:, 0] = 1.0               # every logit 1: greedy ties everywhere
  w[[9, 40], 0] = np.inf      # row 0: inf * 1; row 1 has h = 0 there
  h[1, 0] = 0.0               # row 1: 0 * inf = NaN at ids 9 and 40
  rowdata, _ = make_rowdata(b, greedy_every=1)  # all greedy
  score, index = run_sampler(
      interp["triton_sampler"], jnp.asarray(h, jnp.bfloat16),
      jnp.asarray(w, jnp.bfloat16), rowdata, offset=0, layout="vd",
      vocab_size=48, rows_valid=rows, cfg=C(16, 16, 16, 4, 1))
  # Row 0: inf at 9 (tile 0) and 40 (tile 2); other tiles tie at 1 -> lowest id.
  np.testing.assert_array_equal(index[0], [9, 16, 40, INT_MAX])
  np.testing.assert_array_equal(score[0], [np.inf, 1.0, np.inf, -np.inf])
  # Row 1: NaN at 9 and 40; elsewhere 0 * 1 = 0, ties -> lowest id.
  np.testing.assert_array_equal(index[1], [9, 16, 40, INT_MAX])
  assert np.isnan(score[1, 0]) and np.isnan(score[1, 2])
  np.testing.assert_array_equal(score[1, [1, 3]], [0.0, -np.inf])


def make_control_rows(batch, samples, *, seed=0, cap=None, ctr_base=2**32 - 90,
                      ctr_step=3 * 2**31 + 5):
  """Packed control rows and their parts; sample s of row b has counter
  ``ctr_base + (s * B + b) * ctr_step`` (64-bit, carries)."""
  rowdata, parts = make_rowdata(batch, seed=seed)
  c = (np.uint64(ctr_base) + np.arange(samples * batch, dtype=np.uint64)
       * np.uint64(ctr_step)).reshape(samples, batch)
  hi = (c >> np.uint64(32)).astype(np.uint32)
  lo = c.astype(np.uint32)
  caps = np.full(batch, 0.0 if cap is None else cap, np.float32)
  rows = _pack(parts["k0"], parts["k1"], parts["t"], hi, lo, caps)
  parts.update(s_hi=hi, s_lo=lo, cap=caps)
  return rows, parts


def mirror_controls(logits, parts, ctl, *, offset, rows_valid, vocab_size, bias,
                    mask, block_v, given=None):
  """Per (row, tile) controls outputs, the kernel's math in NumPy float32
  (the interpreter's soft-cap tanh is exp-based, as in the kernel);
  ``given``: each row's given id (``ctl.given``)."""
  b, rows = logits.shape
  f32 = np.float32
  local = np.arange(rows)
  gid = offset + local
  valid = np.broadcast_to((local < rows_valid) & (gid < vocab_size), (b, rows))
  x = logits.astype(f32)
  if ctl.softcap:
    cap = parts["cap"][:, None]
    y = x / cap
    e = np.exp(f32(-2.0) * np.abs(y))
    r = (f32(1) - e) / (f32(1) + e)
    x = cap * np.where(y < 0, f32(0) - r, r)
  raw = np.where(valid, x, -np.inf).astype(f32)     # no bias, mask or temperature
  if ctl.bias:
    x = x + np.where(gid < vocab_size, bias[np.minimum(gid, vocab_size - 1)], 0)
  if ctl.mask:
    word = mask[:, np.minimum(gid, vocab_size - 1) // 32]
    valid = valid & (((word >> (gid % 32).astype(np.uint32)) & 1) == 1)
  x = np.where(valid, x, -np.inf).astype(f32)
  temp = parts["t"][:, None]
  inv = (f32(1) / np.where(temp == 0, f32(1), temp)).astype(f32)   # as packed
  t = (x * inv).astype(f32)
  n_tiles = -(-rows // block_v)
  pad = n_tiles * block_v - rows
  tiles = lambda a, fill: np.pad(a, ((0, 0), (0, pad)), constant_values=fill
                                 ).reshape(b, n_tiles, block_v)
  out = {"best_score": [], "best_index": [], "best_t": []}
  gid_t = (offset + np.arange(n_tiles * block_v)).reshape(n_tiles, block_v)[None]
  for s_ in range(ctl.samples):
    bits = threefry_bits(parts["k0"][:, None], parts["k1"][:, None],
                         parts["s_hi"][s_][:, None], parts["s_lo"][s_][:, None],
                         gid.astype(np.uint32)[None, :])
    sc = np.where(valid, np.where(temp == 0, x, t + numpy_gumbel(bits)), -np.inf)
    if not ctl.noise:  # every row's best is that of x
      sc = x
    sc = sc.astype(f32)
    m, idx = _tile_best_rows(sc, valid, block_v, offset)
    out["best_score"].append(m)
    out["best_index"].append(idx)
    out["best_t"].append(np.max(np.where(gid_t == idx[..., None],
                                         tiles(t, -np.inf), -np.inf), -1))
  tt = tiles(t, -np.inf)
  m = np.max(tt, -1)
  with np.errstate(invalid="ignore"):
    e = np.where(tt == -np.inf, 0, np.exp(tt - m[..., None]))
  out["lse_max"], out["lse_sum"] = m, e.sum(-1)
  # The RL fields (stage2.rl_state's definitions, per tile).
  with np.errstate(invalid="ignore"):
    d = tt - m[..., None]
    out["ent_sum"] = np.where(tt > -np.inf, e * d, 0).sum(-1)
    rt = tiles(raw, -np.inf)
    rm = np.max(rt, -1)
    out["raw_max"] = rm
    out["raw_sum"] = np.where(rt == -np.inf, 0, np.exp(rt - rm[..., None])).sum(-1)
  out["finite_count"] = np.sum(tt > -np.inf, -1)
  if given is not None:
    out["given_t"] = np.max(np.where(gid_t == given[:, None, None], tt, -np.inf), -1)
  work = np.where(np.isnan(tt), -np.inf, tt)
  vals, ids = [], []
  for _ in range(ctl.top_k):
    v = np.max(work, -1)
    hit = (work == v[..., None]) & (work > -np.inf)
    top = np.min(np.where(hit, gid_t, INT_MAX), -1)
    vals.append(v)
    ids.append(top)
    work = np.where(gid_t == top[..., None], -np.inf, work)
  out["bound"] = np.max(work, -1)
  out["cand_vals"], out["cand_ids"] = vals, ids
  return out


def _tile_best_rows(s, valid, block_v, offset):
  """:func:`tile_best` with a validity mask per row ([B, rows])."""
  ms, ids = [], []
  for r in range(s.shape[0]):
    m, i = tile_best(s[r:r + 1], valid[r], block_v, offset)
    ms.append(m[0])
    ids.append(i[0])
  return np.stack(ms), np.stack(ids)


def run_controls(mod, h, w, rows, ctl, *, offset, layout, vocab_size,
                 rows_valid, cfg, bias=None, mask=None, scale=None, convert=0,
                 given=None):
  b, d = h.shape
  w_rows = w.shape[0] if layout == "vd" else w.shape[1]
  n_words = -(-vocab_size // 32)
  w_arg, s_arg, wconsts = weight_args(mod.base, w, scale, convert)
  consts = mod.controls_constexprs(cfg, ctl, batch=b, dim=d, rows=w_rows,
                                   rows_valid=rows_valid, vocab_size=vocab_size,
                                   layout=layout, n_words=n_words, **wconsts)
  n = consts["N_TILES"]
  args = [HostTensor(np.asarray([offset], np.int32)), HostTensor(rows),
          HostTensor(np.asarray(h)), w_arg, s_arg,
          HostTensor(np.zeros(1, np.float32) if bias is None else bias),
          HostTensor(np.zeros(1, np.uint32) if mask is None else mask),
          HostTensor(np.zeros(1, np.int32) if given is None else given),
          HostTensor(np.zeros((b, ctl.f_rows, n), np.float32)),
          HostTensor(np.zeros((b, ctl.i_rows, n), np.int32))]
  mod._controls_kernel[(triton.cdiv(b, cfg.block_b), n)](*args, **consts)  # pylint: disable=protected-access
  return mod.split_outputs(args[8].a, args[9].a, ctl)


RL = dict(entropy=True, raw=True, finite=True, given=True)


def given_ids(batch, vocab, offset, seed):
  """Each row's given id: ids in and out of the weight's rows (below the
  offset, past them), the first row's in the first tile."""
  ids = np.random.default_rng(seed).integers(0, vocab, batch).astype(np.int32)
  ids[0] = offset
  return ids


def assert_rl_fields(got, want, ctl, rtol):
  """The RL fields of a controls launch against a mirror's: maxima,
  counts and given t exact, sums within ``rtol``."""
  eq = np.testing.assert_array_equal
  if ctl.entropy:
    np.testing.assert_allclose(got.ent_sum, want["ent_sum"], rtol=rtol, atol=1e-6)
  if ctl.raw:
    eq(got.raw_max, want["raw_max"])
    np.testing.assert_allclose(got.raw_sum, want["raw_sum"], rtol=rtol)
  if ctl.finite:
    eq(got.finite_count, want["finite_count"])
  if ctl.given:
    eq(got.given_t, want["given_t"])
  for name, flag in (("ent_sum", ctl.entropy), ("raw_max", ctl.raw),
                     ("finite_count", ctl.finite), ("given_t", ctl.given)):
    assert (getattr(got, name) is None) != flag, name


_CONTROL_CASES = [
    # (layout, B, D, rows, rows_valid, vocab, offset, cfg, controls)
    ("vd", 5, 32, 200, 200, 200, 0, C(64, 16, 32, 4, 2),
     dict(samples=2, softcap=True, bias=True, mask=True, t_best=True, lse=True,
          top_k=3, **RL)),
    # The raw log-sum-exp alone (the tile's statistics after the noise).
    ("dv", 18, 48, 160, 150, 300, 64, C(32, 16, 16, 4, 2, False),
     dict(samples=1, bias=True, lse=True, top_k=5, t_best=True, raw=True)),
    ("vd", 7, 16, 96, 96, 90, 0, C(32, 16, 16, 4, 1),
     dict(samples=3, softcap=True, mask=True)),
    # No noise (every row truncates): the best is x's, the lists as before.
    ("dv", 18, 48, 160, 150, 300, 64, C(32, 16, 16, 4, 2, False),
     dict(samples=1, mask=True, lse=True, top_k=4, t_best=True, noise=False,
          entropy=True, finite=True, given=True)),
]


@interpreter_only
@pytest.mark.parametrize("layout,b,d,rows,rows_valid,vocab,offset,cfg,kw",
                         _CONTROL_CASES)
def test_interpreter_controls(interp, layout, b, d, rows, rows_valid, vocab,
                              offset, cfg, kw):
  """Every controls output of every (row, tile) against the NumPy mirror:
  soft-cap, bias by global id, the allowed bitmask, several samples with
  64-bit counters, the best's t, log-sum-exp pieces, the top-K list and its
  bound, the RL fields; greedy rows, padding, ids past vocab_size, a
  vocabulary offset."""
  tc = interp["triton_controls"]
  ctl = tc.Controls(**kw)
  h, w, logits = exact_problem(b, d, rows, layout=layout, seed=rows)
  rows_arr, parts = make_control_rows(b, ctl.samples, seed=b, cap=8.0)
  r = np.random.default_rng(b)
  bias = r.integers(-4, 5, vocab).astype(np.float32) if ctl.bias else None
  mask = (r.integers(0, 2**32, (b, -(-vocab // 32)), dtype=np.uint64)
          .astype(np.uint32) if ctl.mask else None)
  given = given_ids(b, vocab, offset, seed=b) if ctl.given else None
  got = run_controls(tc, h, w, rows_arr, ctl, offset=offset, layout=layout,
                     vocab_size=vocab, rows_valid=rows_valid, cfg=cfg,
                     bias=bias, mask=mask, given=given)
  want = mirror_controls(logits, parts, ctl, offset=offset, rows_valid=rows_valid,
                         vocab_size=vocab, bias=bias, mask=mask,
                         block_v=cfg.block_v, given=given)
  assert_controls_outputs(got, want, ctl)


@triton.jit
def _convert_probe_kernel(w_ptr, out_ptr, W_CONVERT: tl.constexpr,
                          OUT_F16: tl.constexpr):
  """The kernels' W conversion (``weight_operand``) of 256 values to f16
  (``OUT_F16``) or bf16 (under the interpreter: f32, see weight_operand)."""
  i = tl.arange(0, 256)
  w = tl.load(w_ptr + i)
  if OUT_F16:
    x = ts.weight_operand(w, tl.float16, W_CONVERT)
  else:
    x = ts.weight_operand(w, tl.bfloat16, W_CONVERT)
  tl.store(out_ptr + i, x)


# (weight dtype, conversion) of ts.weight_conversion: Triton's for e4m3 from
# sm90 and int8, and the byte conversions. (Triton's own e5m2 -> bf16, which
# the kernels never use, makes infinities and NaN finite on an H200.)
_CONVERSIONS = [(E4M3, ts.CONVERT_DIRECT), (E4M3, ts.CONVERT_E4M3_BITS),
                (E5M2, ts.CONVERT_E5M2_BITS), (I8, ts.CONVERT_DIRECT)]


def all_bytes(wdtype):
  """The 256 values of an 8-bit dtype, in byte order."""
  return np.arange(256, dtype=np.uint8).view(np.dtype(wdtype))


def assert_converted(got, wdtype, out_dtype):
  """``got`` equals ml_dtypes' exact conversion of every byte, bit for bit
  (NaN: anywhere the byte is a NaN)."""
  want = all_bytes(wdtype).astype(np.dtype(out_dtype))
  got = np.asarray(got)
  nan = np.isnan(want.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
  bits = np.uint32 if want.itemsize == 4 else np.uint16
  np.testing.assert_array_equal(got[~nan].view(bits), want[~nan].view(bits))


@interpreter_only
def test_interpreter_weight_conversion(interp):
  """Every byte of each 8-bit dtype, each conversion (weight_operand's
  interpreter path: exact f32 values)."""
  m = interp["triton_sampler"]
  for wdtype, convert in _CONVERSIONS:
    for out_f16 in (False, True):
      w = all_bytes(wdtype)
      if convert != m.CONVERT_DIRECT:
        w = w.view(np.uint8)
      args = [HostTensor(w), HostTensor(np.zeros(256, np.float32))]
      _convert_probe_kernel[(1,)](*args, W_CONVERT=convert, OUT_F16=out_f16)
      assert_converted(args[1].a, wdtype, np.float32)


# (layout, H dtype, W dtype, scale, conversion, B, D, rows, rows_valid,
# vocab_size, offset, config)
_QUANT_INTERP_CASES = [
    ("vd", jnp.bfloat16, E4M3, "row", 0, 5, 64, 300, 300, 300, 0, C(64, 16, 32, 4, 2)),
    ("dv", jnp.bfloat16, E4M3, "tensor", 1, 5, 64, 300, 290, 1000, 128,
     C(64, 16, 32, 4, 2)),
    ("vd", jnp.float16, E4M3, "row", 1, 20, 80, 200, 190, 300, 100,
     C(32, 16, 32, 4, 2, False)),
    ("dv", jnp.bfloat16, E5M2, "row", 2, 17, 48, 130, 130, 200, 64,
     C(64, 32, 16, 4, 2, False)),
    ("vd", jnp.float16, E5M2, "tensor", 2, 9, 40, 150, 150, 150, 0, C(64, 16, 16, 4, 2)),
    ("dv", jnp.bfloat16, I8, "row", 0, 6, 32, 100, 100, 100, 0, C(32, 16, 32, 4, 1)),
    ("vd", jnp.float16, I8, None, 0, 4, 32, 64, 64, 64, 0, C(32, 16, 32, 4, 1)),
]


@interpreter_only
@pytest.mark.parametrize("layout,dtype,wdtype,scale,convert,b,d,rows,rows_valid,vocab,"
                         "offset,cfg", _QUANT_INTERP_CASES)
def test_interpreter_quantized_sampler(interp, layout, dtype, wdtype, scale, convert,
                                       b, d, rows, rows_valid, vocab, offset, cfg):
  """8-bit weights (e4m3 subnormals, e5m2, int8's whole range) with per-row
  or per-tensor scales: every (row, tile) candidate equals the NumPy
  mirror of ``f32(l * scale)`` bit for bit, for Triton's conversion and the
  byte conversions, masked D steps and both layouts."""
  h, w, sc, logits = quantized_problem(b, d, rows, wdtype=wdtype, layout=layout,
                                       dtype=dtype, scale=scale, seed=b)
  rowdata, parts = make_rowdata(b, seed=d, ctr_base=2**32 - 150, ctr_step=2**31 + 7)
  score, index = run_sampler(interp["triton_sampler"], h, w, rowdata,
                             offset=offset, layout=layout, vocab_size=vocab,
                             rows_valid=rows_valid, cfg=cfg, scale=sc,
                             convert=convert)
  s, valid = mirror_scores(logits, parts, offset=offset, rows_valid=rows_valid,
                           vocab_size=vocab)
  want_s, want_i = tile_best(s, valid, cfg.block_v, offset)
  np.testing.assert_array_equal(index, want_i)
  np.testing.assert_array_equal(score, want_s)


@interpreter_only
@pytest.mark.parametrize("layout,dtype,wdtype,scale,convert,cfg,kw", [
    ("vd", jnp.bfloat16, E4M3, "row", 1, C(64, 16, 32, 4, 2),
     dict(samples=2, softcap=True, bias=True, mask=True, t_best=True, lse=True,
          top_k=3, **RL)),
    ("dv", jnp.float16, I8, "tensor", 0, C(32, 16, 16, 4, 2, False),
     dict(samples=1, bias=True, lse=True, top_k=5, t_best=True)),
])
def test_interpreter_quantized_controls(interp, layout, dtype, wdtype, scale, convert,
                                        cfg, kw):
  """The controls act on the scaled logits: every output against the
  NumPy mirror of ``f32(l * scale)``."""
  tc = interp["triton_controls"]
  ctl = tc.Controls(**kw)
  b, d, rows, rows_valid, vocab, offset = 7, 48, 200, 190, 250, 64
  h, w, sc, logits = quantized_problem(b, d, rows, wdtype=wdtype, layout=layout,
                                       dtype=dtype, scale=scale, seed=rows)
  rows_arr, parts = make_control_rows(b, ctl.samples, seed=b, cap=8.0)
  r = np.random.default_rng(b)
  bias = r.integers(-4, 5, vocab).astype(np.float32) if ctl.bias else None
  mask = (r.integers(0, 2**32, (b, -(-vocab // 32)), dtype=np.uint64)
          .astype(np.uint32) if ctl.mask else None)
  given = given_ids(b, vocab, offset, seed=b) if ctl.given else None
  got = run_controls(tc, h, w, rows_arr, ctl, offset=offset, layout=layout,
                     vocab_size=vocab, rows_valid=rows_valid, cfg=cfg,
                     bias=bias, mask=mask, scale=sc, convert=convert, given=given)
  want = mirror_controls(logits, parts, ctl, offset=offset, rows_valid=rows_valid,
                         vocab_size=vocab, bias=bias, mask=mask,
                         block_v=cfg.block_v, given=given)
  # The raw logits are the scaled ones.
  assert_controls_outputs(got, want, ctl)


# ----------------------------------------------------------------------------
# Config, heuristic, argument checking (no GPU)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(block_v=48), ValueError, r"block_v=48 must be a power of two >= 16"),
    (dict(block_b=8), ValueError, r"block_b=8 must be a power of two >= 16"),
    (dict(block_d=96), ValueError, r"block_d=96"),
    (dict(num_warps=3), ValueError, r"num_warps=3"),
    (dict(num_stages=0), ValueError, r"num_stages=0"),
    (dict(block_v=256, block_b=256, num_warps=4), ValueError, r"accumulator registers"),
    (dict(block_v=128.0), TypeError, r"block_v=128.0 must be an int"),
    (dict(vocab_on_m=1), TypeError, r"vocab_on_m=1 must be a bool"),
])
def test_config_validation(kwargs, err, match):
  with pytest.raises(err, match=match):
    C(**kwargs)


@pytest.mark.parametrize("capability,kind", [
    ((8, 0), ""), ((8, 6), ""), ((8, 9), ""), ((9, 0), "NVIDIA H100 80GB HBM3"),
    ((9, 0), "NVIDIA H200"), ((10, 0), ""), ((12, 0), "")])
@pytest.mark.parametrize("batch", [1, 16, 17, 64, 100, 128, 256, 1024])
def test_pick_config_fits(capability, kind, batch):
  cfg = ts.pick_config(batch, 2880, 201088, capability, kind)
  assert 2880 % cfg.block_d == 0
  assert cfg.smem_bytes() <= ts.SMEM_BYTES[ts.gpu_family(capability)]
  if batch <= 32:  # one batch block: W streamed once
    assert cfg.block_b >= batch and cfg.vocab_on_m
  for layout in ("vd", "dv"):
    q = ts.pick_config(batch, 2880, 201088, capability, kind, w_itemsize=1,
                       layout=layout)
    assert 2880 % q.block_d == 0
    assert q.smem_bytes(2, 1) <= ts.SMEM_BYTES[ts.gpu_family(capability)]
    if batch <= 32:
      assert q.block_b >= batch


def test_pick_config_8bit_rows():
  # sm90's measured 8-bit rows by layout up to B = 16 (H100 and H200 alike),
  # the float table beyond; other families keep their float tables.
  for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
    pick = lambda b, layout: ts.pick_config(b, 4096, 151936, (9, 0), kind,
                                            w_itemsize=1, layout=layout)
    assert pick(1, "vd") == C(64, 16, 128, 4, 4) == pick(16, "vd")
    assert pick(1, "dv") == C(128, 16, 64, 4, 4, False) == pick(16, "dv")
    for b in (17, 64, 300):
      assert pick(b, "dv") == ts.pick_config(b, 4096, 151936, (9, 0), kind)
  for cap in ((8, 0), (10, 0)):
    assert (ts.pick_config(1, 4096, 151936, cap, "", w_itemsize=1, layout="dv")
            == ts.pick_config(1, 4096, 151936, cap, ""))


def test_config_table_by_device_kind():
  # A measured device's own table; others of its family, and a kind that
  # only contains the name (GH200), keep the family's.
  assert ts.config_table((9, 0), "NVIDIA H200") == "sm90-h200"
  assert ts.config_table((9, 0), "NVIDIA H200 NVL") == "sm90-h200"
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", "NVIDIA H20", ""):
    assert ts.config_table((9, 0), kind) == "sm90", kind
  assert ts.config_table((8, 0), "NVIDIA H200") == "sm80"
  assert ts.config_table((10, 0), "NVIDIA B200") == "sm100"
  # The two sm90 tables differ where they were measured to.
  h100 = ts.pick_config(1, 4096, 151936, (9, 0), "NVIDIA H100 80GB HBM3")
  h200 = ts.pick_config(1, 4096, 151936, (9, 0), "NVIDIA H200")
  assert (h100.block_v, h100.num_stages) == (64, 4)
  assert (h200.block_v, h200.num_stages) == (128, 6)


def test_pick_config_tiny_vocab_and_old_gpus():
  assert ts.pick_config(1, 64, 40, (9, 0)).block_v == 64
  assert ts.pick_config(1, 64, 10, (9, 0)).block_v == 16
  with pytest.raises(NotImplementedError, match="sm80"):
    ts.pick_config(1, 64, 1000, (7, 5))


def test_candidates_argument_errors():
  h = jnp.zeros((4, 64), jnp.bfloat16)
  w = jnp.zeros((100, 64), jnp.bfloat16)
  rd = jnp.zeros((8, 4), jnp.uint32)
  call = lambda **kw: ts.candidates(**{**dict(
      hidden=h, weight=w, rowdata=rd, layout="vd", vocab_size=100,
      capability=(9, 0)), **kw})
  with pytest.raises(ValueError, match="layout='xy'"):
    call(layout="xy")
  with pytest.raises(TypeError, match="hidden.dtype=float32 must equal"):
    call(hidden=h.astype(jnp.float32))
  with pytest.raises(TypeError, match="weight.dtype=float32"):
    call(hidden=h.astype(jnp.float32), weight=w.astype(jnp.float32))
  with pytest.raises(ValueError, match="D differs"):
    call(layout="dv")
  with pytest.raises(ValueError, match=r"rowdata must be uint32 \[8, 4\]"):
    call(rowdata=rd[:4])
  with pytest.raises(ValueError, match="rows_valid=101"):
    call(rows_valid=101)
  with pytest.raises(ValueError, match="vocab_size=0"):
    call(vocab_size=0)
  with pytest.raises(ValueError, match="shared memory"):
    call(config=C(128, 128, 128, 8, 8, False))
  # Quantized weights: H in bf16/f16, an f32 scale of shape () or [V].
  w8 = w.astype(jnp.float8_e4m3fn)
  with pytest.raises(TypeError, match="hidden.dtype=float32 must be bfloat16 or float16"):
    call(hidden=h.astype(jnp.float32), weight=w8)
  with pytest.raises(TypeError, match="weight.dtype=uint8"):
    call(weight=w.astype(jnp.uint8))
  with pytest.raises(TypeError, match="weight_scale.dtype=bfloat16 must be float32"):
    call(weight=w8, weight_scale=jnp.ones((100,), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"weight_scale.shape=\(1,\) must be \(\)"):
    call(weight=w8, weight_scale=jnp.ones((1,), jnp.float32))
  with pytest.raises(ValueError, match=r"weight_scale.shape=\(99,\)"):
    call(weight=w8.T, layout="dv", weight_scale=jnp.ones((99,), jnp.float32))
  with pytest.raises(TypeError, match="weight_scale must be a float32 array"):
    call(weight=w8, weight_scale=2.0)


def test_weight_operands():
  """A per-tensor scale stays one element ([1], a reshape); a per-row scale
  is passed as it is; e5m2, and e4m3 below sm90, travel as bytes."""
  w = jnp.zeros((10, 16), jnp.float8_e4m3fn)
  bf = jnp.bfloat16
  for cap, wd, conv in [((9, 0), E4M3, ts.CONVERT_DIRECT),
                        ((9, 0), E5M2, ts.CONVERT_E5M2_BITS),
                        ((8, 9), E4M3, ts.CONVERT_E4M3_BITS),
                        ((8, 0), E5M2, ts.CONVERT_E5M2_BITS),
                        ((8, 0), I8, ts.CONVERT_DIRECT)]:
    got_w, s, consts = ts.weight_operands(w.astype(wd), jnp.float32(0.5),
                                          hidden_dtype=bf, rows=10, capability=cap)
    assert consts == dict(SCALE=ts.SCALE_TENSOR, W_CONVERT=conv)
    assert s.shape == (1,) and float(s[0]) == 0.5
    assert got_w.dtype == (jnp.uint8 if conv else wd)
  row = jnp.arange(10, dtype=jnp.float32)
  _, s, consts = ts.weight_operands(w, row, hidden_dtype=bf, rows=10, capability=(9, 0))
  assert consts["SCALE"] == ts.SCALE_ROW and s is row
  _, s, consts = ts.weight_operands(w, None, hidden_dtype=bf, rows=10, capability=(9, 0))
  assert consts["SCALE"] == ts.SCALE_NONE and s.shape == (1,)


def test_pack_rows():
  from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
  b = 3
  k0, k1 = jnp.arange(b, dtype=jnp.uint32), jnp.arange(b, dtype=jnp.uint32) + 10
  hi = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.uint32)
  lo = hi + 100
  t = jnp.asarray([0.0, 0.5, 2.0], jnp.float32)
  rows = np.asarray(tc.pack_control_rows(k0, k1, hi, lo, t, softcap=30.0))
  assert rows.shape == (16, b) and rows.dtype == np.uint32
  np.testing.assert_array_equal(rows[5:9], [[1, 2, 3], [101, 102, 103],
                                            [4, 5, 6], [104, 105, 106]])
  np.testing.assert_array_equal(rows[2].view(np.float32), t)
  np.testing.assert_array_equal(rows[3].view(np.float32), [30.0] * 3)
  rd = np.asarray(ts.pack_rowdata(k0, k1, hi[0], lo[0], t))
  assert rd.shape == (8, b)
  np.testing.assert_array_equal(rd[[0, 1, 5, 6]], [k0, k1, hi[0], lo[0]])
  np.testing.assert_array_equal(rd[2].view(np.float32), t)


def test_control_candidates_argument_errors():
  from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
  h = jnp.zeros((4, 64), jnp.bfloat16)
  w = jnp.zeros((100, 64), jnp.bfloat16)
  rows = jnp.zeros((8, 4), jnp.uint32)
  call = lambda **kw: tc.control_candidates(**{**dict(
      hidden=h, weight=w, rows=rows, layout="vd", vocab_size=100,
      controls=tc.Controls(), capability=(9, 0)), **kw})
  with pytest.raises(ValueError, match=r"rowdata must be uint32 \[16, 4\]"):
    call(controls=tc.Controls(samples=3))
  with pytest.raises(ValueError, match="controls.bias=True but bias is None"):
    call(controls=tc.Controls(bias=True))
  with pytest.raises(ValueError, match="controls.mask=False but allowed_mask is given"):
    call(allowed_mask=jnp.zeros((4, 4), jnp.uint32))
  with pytest.raises(ValueError, match=r"bias must be f32 \[100\]"):
    call(controls=tc.Controls(bias=True), bias=jnp.zeros((99,), jnp.float32))
  with pytest.raises(ValueError, match=r"allowed_mask must be uint32 \[4, 4\]"):
    call(controls=tc.Controls(mask=True), allowed_mask=jnp.zeros((4, 3), jnp.uint32))
  with pytest.raises(ValueError, match="top_k=-1"):
    call(controls=tc.Controls(top_k=-1))
  with pytest.raises(TypeError, match="controls="):
    call(controls=dict(samples=1))
  with pytest.raises(ValueError, match="entropy=True needs lse=True"):
    call(controls=tc.Controls(entropy=True))
  with pytest.raises(TypeError, match="given=1 must be a bool"):
    call(controls=tc.Controls(given=1))
  with pytest.raises(ValueError, match="controls.given=True but given_ids is None"):
    call(controls=tc.Controls(given=True))
  with pytest.raises(ValueError, match=r"given_ids must be int32 \[4\]"):
    call(controls=tc.Controls(given=True), given_ids=jnp.zeros((4,), jnp.uint32))


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_controls_config_same_for_sample_and_score(capability):
  # fs.score_tokens reproduces fs.sample's log-probabilities and entropies
  # bit for bit only if both launches sum each tile in one order, i.e. run
  # one config: a sample with log-probabilities or the RL outputs (noise or
  # not, lists or not) and a score (no noise, the given t) of the same batch.
  from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
  score = dict(t_best=True, lse=True, noise=False, entropy=True, raw=True, given=True)
  samples = [dict(t_best=True, lse=True), dict(t_best=True, lse=True, top_k=4),
             dict(t_best=True, lse=True, entropy=True, raw=True),
             dict(t_best=True, lse=True, entropy=True, raw=True, finite=True, top_k=4),
             dict(lse=True, entropy=True, noise=False, top_k=4)]
  for batch in (1, 16, 33, 64, 100, 256):
    for top_k in (0, 4):
      want = tc.pick_controls_config(batch, 4096, 151936, capability,
                                     tc.Controls(top_k=top_k, **score))
      for kw in samples:
        got = tc.pick_controls_config(batch, 4096, 151936, capability, tc.Controls(**kw))
        assert got == want, (batch, top_k, kw)


# ----------------------------------------------------------------------------
# GPU: through jax-triton, against XLA on the same GPU, bit for bit
# ----------------------------------------------------------------------------


def xla_gumbel(k0, k1, c_hi, c_lo, gid):
  """``[B, V]`` noise as ``jax.random.gumbel`` computes it (XLA's threefry,
  log, neg), for row counters ``(c_hi, c_lo) [B, 1]`` plus global ids."""
  lo = c_lo + gid.astype(jnp.uint32)[None, :]
  hi = c_hi + (lo < c_lo).astype(jnp.uint32)
  full = lambda x: jnp.broadcast_to(x, lo.shape)
  y0, y1 = threefry2x32_p.bind(full(k0), full(k1), hi, lo)
  u = jax.lax.bitcast_convert_type(((y0 ^ y1) >> 9) | jnp.uint32(0x3F800000),
                                   jnp.float32) - 1.0
  return -jnp.log(-jnp.log(jnp.maximum(jnp.float32(TINY), u)))


def xla_tiles(a, block_v, fill):
  """``[B, V]`` -> ``[B, n_tiles, block_v]``, padded with ``fill``."""
  b, rows = a.shape
  n = -(-rows // block_v)
  return jnp.pad(a, ((0, 0), (0, n * block_v - rows)),
                 constant_values=fill).reshape(b, n, block_v)


def xla_best(s, valid, ids):
  """Per (row, tile) best (score, id) of ``s``/``valid`` ``[B, T, Vt]``."""
  m = jnp.max(s, -1)  # NaN if the tile holds one
  hit = valid & ((s == m[..., None]) | jnp.isnan(s))
  return m, jnp.min(jnp.where(hit, ids, INT_MAX), -1)


def xla_logits(h, w, layout, scale=None):
  """f32 logits as the package defines them: an 8-bit W converted to H's
  dtype, the f32 product times ``scale`` (``()`` or ``[rows]``)."""
  w = (w.T if layout == "vd" else w).astype(h.dtype)
  l = jnp.dot(h, w, preferred_element_type=jnp.float32)
  return l if scale is None else l * scale


def xla_tile_reference(h, w, rowdata, offset, *, layout, vocab_size, rows_valid,
                       block_v, scale=None):
  """Per (row, tile) best (score, id) computed by XLA: logits from
  ``jnp.dot`` (times the weight scale), noise as ``jax.random.gumbel``
  computes it, ``l / T`` as XLA divides."""
  l = xla_logits(h, w, layout, scale)
  b, rows = l.shape
  k0, k1, tb, _, inv_b, c_hi, c_lo = (rowdata[i][:, None] for i in range(7))
  t = jax.lax.bitcast_convert_type(tb, jnp.float32)
  local = jnp.arange(rows, dtype=jnp.int32)
  gid = offset + local
  g = xla_gumbel(k0, k1, c_hi, c_lo, gid)
  # The kernel multiplies by the row's reciprocal (XLA's in real use; here
  # packed by the test): so does the reference.
  inv = jax.lax.bitcast_convert_type(inv_b, jnp.float32)
  # The barrier keeps XLA:CPU from contracting the product and the add into
  # one fma (the kernel rounds the product first, as XLA on the GPU does).
  s = jnp.where(t == 0, l, jax.lax.optimization_barrier(l * inv) + g)
  valid = jnp.broadcast_to((local < rows_valid) & (gid < vocab_size), (b, rows))
  s = jnp.where(valid, s, -jnp.inf)
  ids = xla_tiles(jnp.broadcast_to(offset + local, (b, rows)), block_v, INT_MAX)
  return xla_best(xla_tiles(s, block_v, -jnp.inf), xla_tiles(valid, block_v, False),
                  ids)


def xla_controls_reference(h, w, rows_arr, offset, ctl, *, layout, vocab_size,
                           rows_valid, block_v, bias, mask, scale=None, given=None):
  """The controls kernel's outputs computed by XLA (jnp.tanh for the cap);
  ``given``: int32 ``[B]``, each row's given id (``ctl.given``)."""
  l = xla_logits(h, w, layout, scale)
  b, rows = l.shape
  f32 = lambda r: jax.lax.bitcast_convert_type(rows_arr[r][:, None], jnp.float32)
  k0, k1 = rows_arr[RowLayout.K0][:, None], rows_arr[RowLayout.K1][:, None]
  temp, cap = f32(RowLayout.TEMPERATURE), f32(RowLayout.SOFTCAP)
  local = jnp.arange(rows, dtype=jnp.int32)
  gid = offset + local
  valid = jnp.broadcast_to((local < rows_valid) & (gid < vocab_size), (b, rows))
  x = l
  if ctl.softcap:
    x = cap * jnp.tanh(x / cap)
  raw = xla_tiles(jnp.where(valid, x, -jnp.inf), block_v, -jnp.inf)
  if ctl.bias:
    x = x + jnp.where(gid < vocab_size, jnp.take(bias, gid, mode="clip"), 0.0)
  if ctl.mask:
    word = jnp.take(mask, gid // 32, axis=1, mode="clip")
    valid = valid & (((word >> (gid % 32).astype(jnp.uint32)) & 1) == 1)
  x = jnp.where(valid, x, -jnp.inf)
  t = jax.lax.optimization_barrier(x * f32(RowLayout.INV_TEMPERATURE))
  ids = xla_tiles(jnp.broadcast_to(gid, (b, rows)), block_v, INT_MAX)
  vt = xla_tiles(valid, block_v, False)
  tt = xla_tiles(t, block_v, -jnp.inf)
  out = {"best_score": [], "best_index": [], "best_t": []}
  for s_ in range(ctl.samples):
    c_hi, c_lo = RowLayout(ctl.samples).ctr(s_)
    g = xla_gumbel(k0, k1, rows_arr[c_hi][:, None], rows_arr[c_lo][:, None], gid)
    sc = jnp.where(valid, jnp.where(temp == 0, x, t + g), -jnp.inf)
    if not ctl.noise:  # every row's best is that of x
      sc = x
    m, idx = xla_best(xla_tiles(sc, block_v, -jnp.inf), vt, ids)
    out["best_score"].append(m)
    out["best_index"].append(idx)
    out["best_t"].append(jnp.max(jnp.where(ids == idx[..., None], tt, -jnp.inf), -1))
  m = jnp.max(tt, -1)
  out["lse_max"] = m
  out["lse_sum"] = jnp.sum(jnp.where(tt == -jnp.inf, 0.0, jnp.exp(tt - m[..., None])), -1)
  # The RL fields (stage2.rl_state's definitions, per tile).
  d = tt - m[..., None]
  out["ent_sum"] = jnp.sum(jnp.where(tt > -jnp.inf, jnp.exp(d) * d, 0.0), -1)
  rm = jnp.max(raw, -1)
  out["raw_max"] = rm
  out["raw_sum"] = jnp.sum(jnp.where(raw == -jnp.inf, 0.0, jnp.exp(raw - rm[..., None])), -1)
  out["finite_count"] = jnp.sum(tt > -jnp.inf, -1, dtype=jnp.int32)
  if given is not None:
    out["given_t"] = jnp.max(jnp.where(ids == given[:, None, None], tt, -jnp.inf), -1)
  work = jnp.where(jnp.isnan(tt), -jnp.inf, tt)
  out["cand_vals"], out["cand_ids"] = [], []
  for _ in range(ctl.top_k):
    v = jnp.max(work, -1)
    hit = (work == v[..., None]) & (work > -jnp.inf)
    top = jnp.min(jnp.where(hit, ids, INT_MAX), -1)
    out["cand_vals"].append(v)
    out["cand_ids"].append(top)
    work = jnp.where(ids == top[..., None], -jnp.inf, work)
  out["bound"] = jnp.max(work, -1)
  return out


def test_xla_references_match_mirror():
  """The GPU tests' XLA references, run by XLA on the CPU, against the NumPy
  mirror the interpreter tests use (ids exact; floats: CPU log vs NumPy's),
  so that a GPU failure points at the kernel, not at the reference."""
  b, d, rows, vocab, offset, block_v = 7, 32, 300, 280, 64, 64
  h, w, logits = exact_problem(b, d, rows, layout="dv", seed=4)
  rowdata, parts = make_rowdata(b, seed=2, ctr_base=2**32 - 77, ctr_step=2**31 + 3)
  ms, mi = xla_tile_reference(h, w, jnp.asarray(rowdata), offset, layout="dv",
                              vocab_size=vocab, rows_valid=290, block_v=block_v)
  s_, valid = mirror_scores(logits, parts, offset=offset, rows_valid=290,
                            vocab_size=vocab)
  ws, wi = tile_best(s_, valid, block_v, offset)
  np.testing.assert_array_equal(np.asarray(mi), wi)
  np.testing.assert_allclose(np.asarray(ms), ws, rtol=1e-6)

  from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
  ctl = tc.Controls(samples=2, bias=True, mask=True, t_best=True, lse=True,
                    top_k=4, **RL)
  rows_arr, parts = make_control_rows(b, ctl.samples, seed=9)
  r = np.random.default_rng(0)
  bias = r.integers(-4, 5, vocab).astype(np.float32)
  mask = r.integers(0, 2**32, (b, -(-vocab // 32)), dtype=np.uint64).astype(np.uint32)
  given = given_ids(b, vocab, offset, seed=1)
  got = xla_controls_reference(h, w, jnp.asarray(rows_arr), offset, ctl,
                               layout="dv", vocab_size=vocab, rows_valid=290,
                               block_v=block_v, bias=jnp.asarray(bias),
                               mask=jnp.asarray(mask), given=jnp.asarray(given))
  want = mirror_controls(logits, parts, ctl, offset=offset, rows_valid=290,
                         vocab_size=vocab, bias=bias, mask=mask, block_v=block_v,
                         given=given)
  for k in ("best_index", "cand_ids", "finite_count"):
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
  for k in ("best_score", "best_t", "lse_max", "lse_sum", "cand_vals", "bound",
            "raw_max", "raw_sum", "given_t"):
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6)
  np.testing.assert_allclose(got["ent_sum"], want["ent_sum"], rtol=1e-6, atol=1e-6)


# (layout, dtype, B, D, rows, rows_valid, vocab_size, offset, config or None)
GPU_CASES = [
    ("vd", jnp.bfloat16, 1, 4096, 151936, 151936, 151936, 0, None),
    ("vd", jnp.bfloat16, 13, 2048, 3000, 3000, 3000, 0, None),
    ("dv", jnp.bfloat16, 13, 2048, 3008, 2990, 5000, 64, None),
    ("vd", jnp.float16, 40, 2880, 1999, 1999, 1900, 0, None),
    ("dv", jnp.float16, 64, 512, 4096, 4096, 4096, 4096, None),
    ("vd", jnp.bfloat16, 100, 1024, 2500, 2400, 2400, 0, None),
    ("dv", jnp.bfloat16, 130, 1024, 2560, 2560, 10**6, 7, None),
    ("vd", jnp.bfloat16, 300, 256, 1000, 1000, 1000, 0, None),
    ("vd", jnp.bfloat16, 9, 96, 333, 333, 333, 0, C(64, 16, 64, 4, 3)),
    ("dv", jnp.float16, 33, 96, 320, 320, 320, 0, C(32, 64, 32, 4, 2, False)),
]


# (layout, H dtype, W dtype, scale, B, D, rows, rows_valid, vocab_size, offset,
# capability whose table and conversions to use or None, fine W values)
QUANT_GPU_CASES = [
    ("vd", jnp.bfloat16, E4M3, "row", 1, 4096, 151936, 151936, 151936, 0, None, False),
    ("dv", jnp.bfloat16, E4M3, "tensor", 13, 512, 3008, 2990, 5000, 64, None, True),
    ("vd", jnp.float16, E5M2, "row", 40, 512, 1999, 1999, 1900, 0, None, True),
    ("dv", jnp.bfloat16, I8, "row", 64, 1024, 4096, 4096, 4096, 4096, None, False),
    ("vd", jnp.bfloat16, E4M3, "row", 100, 512, 2500, 2400, 2400, 0, None, True),
    ("vd", jnp.float16, I8, "tensor", 300, 256, 1000, 1000, 1000, 0, None, False),
    ("vd", jnp.bfloat16, E4M3, "tensor", 16, 512, 3000, 3000, 3000, 0, (8, 0), True),
    ("dv", jnp.bfloat16, E5M2, "row", 9, 512, 333, 333, 333, 0, (8, 0), True),
]


@pytest.mark.gpu
class TestGPU:
  """The kernels on a real GPU through jax-triton vs XLA on the same GPU."""

  @pytest.fixture(autouse=True)
  def _needs_jax_triton(self):
    pytest.importorskip("jax_triton")

  @pytest.mark.parametrize("layout,dtype,b,d,rows,rows_valid,vocab,offset,cfg",
                           GPU_CASES)
  def test_candidates_bit_identical(self, layout, dtype, b, d, rows, rows_valid,
                                    vocab, offset, cfg):
    h, w, _ = exact_problem(b, d, rows, layout=layout, dtype=dtype, seed=b,
                            logits=False)
    # Non-power-of-two temperatures too (the reciprocal comes in the rows).
    rowdata, _ = make_rowdata(b, seed=rows, ctr_base=2**32 - 1000,
                              ctr_step=2**33 + 12345,
                              temperatures=(0.25, 0.6, 0.7, 1.0, 1.3, 2.0))
    rowdata = jnp.asarray(rowdata)
    cap = ts.device_capability()
    cfg = cfg or ts.pick_config(b, d, rows, cap)
    f = jax.jit(lambda h, w, rd, off: ts.candidates(
        h, w, rd, off, layout=layout, vocab_size=vocab, rows_valid=rows_valid,
        config=cfg))
    score, index = f(h, w, rowdata, jnp.int32(offset))
    want_s, want_i = jax.jit(lambda h, w, rd: xla_tile_reference(
        h, w, rd, offset, layout=layout, vocab_size=vocab, rows_valid=rows_valid,
        block_v=cfg.block_v))(h, w, rowdata)
    np.testing.assert_array_equal(np.asarray(index), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(score).view(np.uint32),
                                  np.asarray(want_s).view(np.uint32))

  @pytest.mark.parametrize("per_row_keys", [False, True])
  def test_tokens_equal_categorical(self, per_row_keys):
    """Reduced candidates are ``jax.random.categorical``'s tokens, with one
    key for the batch (counters ``b * V`` above 2**32) or a key per row."""
    b, d, v = 48, 1024, 100_000
    h, w, logits = exact_problem(b, d, v, seed=1)
    t = jnp.asarray(np.random.default_rng(0).choice([0.5, 0.7, 1.0], b), jnp.float32)
    lt = jnp.asarray(logits) / t[:, None]
    rowdata, want = _rowdata_and_categorical(b, v, t, lt, per_row_keys)
    score, index = jax.jit(lambda h, w, rd: ts.candidates(
        h, w, rd, layout="vd", vocab_size=v))(h, w, rowdata)
    _, tokens = reduce_tiles(np.asarray(score), np.asarray(index))
    np.testing.assert_array_equal(tokens, np.asarray(want))

  def test_noise_exhaustive_over_u(self):
    """All 2**23 mantissas of u (and u = tiny): the kernel's -log(-log(u))
    equals XLA's bit for bit."""
    m = jnp.arange(2**23, dtype=jnp.uint32)
    bits = m << 9  # bits >> 9 == m
    got = triton_noise.gumbel_from_bits(bits)

    @jax.jit
    def xla(bits):
      u = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000),
                                       jnp.float32) - 1.0
      u = jnp.maximum(jnp.float32(TINY), u)
      return -jnp.log(-jnp.log(u))

    want = xla(bits)
    diff = np.flatnonzero(np.asarray(got).view(np.uint32)
                          != np.asarray(want).view(np.uint32))
    assert diff.size == 0, (f"{diff.size} of 2**23 differ, first mantissas "
                            f"{diff[:8]}")

  def test_noise_equals_jax_random(self):
    """Bits and Gumbel noise of jax.random for a [64, 151936] draw (counters
    past 2**23), element by element."""
    key = jax.random.key(123)
    shape = (64, 151936)
    n = shape[0] * shape[1]
    c = np.arange(n, dtype=np.uint64)
    hi = jnp.asarray((c >> np.uint64(32)).astype(np.uint32))
    lo = jnp.asarray(c.astype(np.uint32))
    bits = triton_noise.random_bits(jax.random.key_data(key), hi, lo,
                                    jnp.zeros((n,), jnp.uint32))
    np.testing.assert_array_equal(
        np.asarray(bits), np.asarray(jax.random.bits(key, shape, jnp.uint32)).reshape(-1))
    g = triton_noise.gumbel_from_bits(bits)
    np.testing.assert_array_equal(
        np.asarray(g).view(np.uint32),
        np.asarray(jax.random.gumbel(key, shape)).reshape(-1).view(np.uint32))

  @pytest.mark.parametrize("layout,b,d,rows,rows_valid,vocab,offset,kw", [
      ("vd", 3, 2048, 5000, 5000, 5000, 0,
       dict(samples=2, bias=True, mask=True, t_best=True, lse=True, top_k=8, **RL)),
      ("dv", 70, 1024, 3072, 3000, 4000, 128,
       dict(samples=1, bias=True, lse=True, top_k=4, t_best=True, noise=False, **RL)),
      ("vd", 33, 512, 2000, 2000, 2000, 0, dict(samples=4, mask=True)),
      ("vd", 20, 512, 2000, 2000, 2000, 0,
       dict(samples=1, softcap=True, lse=True, top_k=4)),
      ("vd", 20, 512, 2000, 2000, 2000, 0,
       dict(samples=1, softcap=True, lse=True, top_k=4, tanh=1)),
  ])
  def test_controls_match_xla(self, layout, b, d, rows, rows_valid, vocab,
                              offset, kw):
    """Bit for bit without a soft-cap (the log-sum-exp sum: ex2.approx,
    1e-5); with one, the tanh is reported, not assumed (module docstring)."""
    from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
    ctl = tc.Controls(**kw)
    h, w, _ = exact_problem(b, d, rows, layout=layout, seed=b, logits=False)
    rows_np, _ = make_control_rows(b, ctl.samples, seed=rows, cap=30.0)
    # Non-power-of-two temperatures: XLA's division must be matched.
    t = np.random.default_rng(b).choice(np.float32([0, 0.6, 0.7, 1.3]), b)
    rows_np[RowLayout.TEMPERATURE] = t.view(np.uint32)
    rows_np[RowLayout.INV_TEMPERATURE] = (
        np.float32(1) / np.where(t == 0, np.float32(1), t)).astype(np.float32).view(np.uint32)
    rows_arr = jnp.asarray(rows_np)
    r = np.random.default_rng(rows)
    bias = (jnp.asarray(r.standard_normal(vocab), jnp.float32) if ctl.bias
            else None)
    mask = (jnp.asarray(r.integers(0, 2**32, (b, -(-vocab // 32)), dtype=np.uint64)
                        .astype(np.uint32)) if ctl.mask else None)
    given = (jnp.asarray(given_ids(b, vocab, offset, seed=b)) if ctl.given
             else None)
    cap = ts.device_capability()
    cfg = tc.pick_controls_config(b, d, rows, cap, ctl)
    got = jax.jit(lambda h, w, ra, bias, mask, given: tc.control_candidates(
        h, w, ra, offset, layout=layout, vocab_size=vocab, controls=ctl,
        bias=bias, allowed_mask=mask, given_ids=given, rows_valid=rows_valid))(
            h, w, rows_arr, bias, mask, given)
    want = jax.jit(lambda h, w, ra, bias, mask, given: xla_controls_reference(
        h, w, ra, offset, ctl, layout=layout, vocab_size=vocab,
        rows_valid=rows_valid, block_v=cfg.block_v, bias=bias, mask=mask,
        given=given))(h, w, rows_arr, bias, mask, given)
    bits = lambda x: np.asarray(x).view(np.uint32)
    if ctl.softcap:
      # The kernel's tanh is a copy of XLA's rational one (equal on 9.4M
      # inputs), yet on an H200 one (row, tile) candidate in 160 differed
      # from XLA's fused soft-cap here: not bit for bit (docs/design.md,
      # "Division"). Scores within 1e-6, candidates on >= 99%.
      idx = np.asarray(got.best_index[:, 0])
      agree = np.mean(idx == np.asarray(want["best_index"][0]))
      np.testing.assert_allclose(np.asarray(got.best_score[:, 0]),
                                 np.asarray(want["best_score"][0]), rtol=1e-6)
      assert agree >= 0.99, agree
      return
    for s_ in range(ctl.samples):
      np.testing.assert_array_equal(np.asarray(got.best_index[:, s_]),
                                    np.asarray(want["best_index"][s_]))
      np.testing.assert_array_equal(bits(got.best_score[:, s_]),
                                    bits(want["best_score"][s_]))
      if ctl.t_best:
        np.testing.assert_array_equal(bits(got.best_t[:, s_]),
                                      bits(want["best_t"][s_]))
    if ctl.lse:
      np.testing.assert_array_equal(bits(got.lse_max), bits(want["lse_max"]))
      np.testing.assert_allclose(np.asarray(got.lse_sum),
                                 np.asarray(want["lse_sum"]), rtol=1e-5)
    for j in range(ctl.top_k):
      np.testing.assert_array_equal(np.asarray(got.cand_ids[:, j]),
                                    np.asarray(want["cand_ids"][j]))
      np.testing.assert_array_equal(bits(got.cand_vals[:, j]),
                                    bits(want["cand_vals"][j]))
    if ctl.top_k:
      np.testing.assert_array_equal(bits(got.bound), bits(want["bound"]))
    # The RL fields: maxima, counts and given t bit for bit, sums of the
    # kernel's exp (ex2.approx) within 1e-5.
    assert_rl_fields(jax.tree.map(np.asarray, got),
                     {k: np.asarray(v) for k, v in want.items() if not isinstance(v, list)},
                     ctl, rtol=1e-5)

  @pytest.mark.parametrize("wdtype,convert", _CONVERSIONS)
  def test_weight_conversion_exhaustive(self, wdtype, convert):
    """Every byte of each 8-bit dtype through weight_operand on the GPU,
    to bf16 and f16, bit for bit against ml_dtypes: Triton's conversions
    (from sm90) and the byte conversions the kernels use below sm90."""
    jt = triton_noise.jax_triton_module()
    w = all_bytes(wdtype)
    if convert != ts.CONVERT_DIRECT:
      w = w.view(np.uint8)
    for out in (jnp.bfloat16, jnp.float16):
      got = jt.triton_call(jnp.asarray(w), kernel=_convert_probe_kernel,
                           out_shape=jax.ShapeDtypeStruct((256,), out), grid=(1,),
                           W_CONVERT=convert, OUT_F16=out == jnp.float16)
      assert_converted(got, wdtype, out)

  @pytest.mark.parametrize("layout,dtype,wdtype,scale,b,d,rows,rows_valid,vocab,"
                           "offset,capability,fine", QUANT_GPU_CASES)
  def test_quantized_candidates_bit_identical(self, layout, dtype, wdtype, scale, b,
                                              d, rows, rows_valid, vocab, offset,
                                              capability, fine):
    """8-bit heads: every (row, tile) candidate equals XLA's on the same GPU
    bit for bit, XLA computing ``f32(dot(H, W.astype(H.dtype))) * scale``
    (scales and temperatures not powers of two). ``capability`` (8, 0) runs
    the sm80 table's config and the byte conversions on this GPU."""
    h, w, sc, _ = quantized_problem(b, d, rows, wdtype=wdtype, layout=layout,
                                    dtype=dtype, scale=scale, seed=b, fine=fine,
                                    logits=False)
    rowdata, _ = make_rowdata(b, seed=rows, ctr_base=2**32 - 1000,
                              ctr_step=2**33 + 12345,
                              temperatures=(0.25, 0.6, 0.7, 1.0, 1.3, 2.0))
    rowdata = jnp.asarray(rowdata)
    cap = capability or ts.device_capability()
    cfg = (ts.pick_config(b, d, rows, capability, w_itemsize=1, layout=layout)
           if capability else None)
    f = jax.jit(lambda h, w, sc, rd, off: ts.candidates(
        h, w, rd, off, layout=layout, vocab_size=vocab, rows_valid=rows_valid,
        weight_scale=sc, config=cfg, capability=cap))
    score, index = f(h, w, sc, rowdata, jnp.int32(offset))
    block_v = (cfg or ts.pick_config(b, d, rows, cap, w_itemsize=1,
                                     layout=layout)).block_v
    want_s, want_i = jax.jit(lambda h, w, sc, rd: xla_tile_reference(
        h, w, rd, offset, layout=layout, vocab_size=vocab, rows_valid=rows_valid,
        block_v=block_v, scale=sc))(h, w, sc, rowdata)
    np.testing.assert_array_equal(np.asarray(index), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(score).view(np.uint32),
                                  np.asarray(want_s).view(np.uint32))

  @pytest.mark.parametrize("wdtype,layout,per_row_keys", [
      (E4M3, "vd", False), (I8, "dv", True), (E5M2, "dv", False)])
  def test_quantized_tokens_equal_categorical(self, wdtype, layout, per_row_keys):
    """Exact 8-bit heads (integers, power-of-two scales per row or per
    tensor): the reduced candidates are ``jax.random.categorical``'s tokens
    on ``f32(H @ W.T) * scale / T``."""
    b, d, v = 48, 1024, 100_000
    h, w, _ = exact_problem(b, d, v, layout=layout, logits=False, seed=2)
    w = w.astype(wdtype)
    r = np.random.default_rng(1)
    sc = (2.0 ** r.integers(-3, 2, v) if per_row_keys
          else 2.0 ** r.integers(-3, 2)).astype(np.float32)
    logits = xla_logits(h, w, layout, jnp.asarray(sc))
    t = jnp.asarray(r.choice([0.5, 1.0, 2.0], b), jnp.float32)
    lt = logits / t[:, None]
    rowdata, want = _rowdata_and_categorical(b, v, t, lt, per_row_keys)
    score, index = jax.jit(lambda h, w, sc, rd: ts.candidates(
        h, w, rd, layout=layout, vocab_size=v, weight_scale=sc))(
            h, w, jnp.asarray(sc), rowdata)
    _, tokens = reduce_tiles(np.asarray(score), np.asarray(index))
    np.testing.assert_array_equal(tokens, np.asarray(want))

  @pytest.mark.parametrize("layout,wdtype,scale,b,kw", [
      ("vd", E4M3, "row", 3,
       dict(samples=2, bias=True, mask=True, t_best=True, lse=True, top_k=8)),
      ("dv", I8, "tensor", 70, dict(samples=1, bias=True, lse=True, top_k=4,
                                     t_best=True)),
      ("dv", E5M2, "row", 5, dict(samples=1, mask=True, lse=True, top_k=4)),
  ])
  def test_quantized_controls_match_xla(self, layout, wdtype, scale, b, kw):
    """The controls kernel on 8-bit heads against XLA on the scaled logits,
    bit for bit (the log-sum-exp sum within 1e-5)."""
    from pallas_kernels import triton_controls as tc  # pylint: disable=import-outside-toplevel
    ctl = tc.Controls(**kw)
    d, rows, rows_valid, vocab, offset = 512, 3072, 3000, 4000, 128
    h, w, sc, _ = quantized_problem(b, d, rows, wdtype=wdtype, layout=layout,
                                    scale=scale, seed=b, logits=False)
    rows_np, _ = make_control_rows(b, ctl.samples, seed=rows)
    t = np.random.default_rng(b).choice(np.float32([0, 0.6, 0.7, 1.3]), b)
    rows_np[RowLayout.TEMPERATURE] = t.view(np.uint32)
    rows_np[RowLayout.INV_TEMPERATURE] = (
        np.float32(1) / np.where(t == 0, np.float32(1), t)).astype(np.float32).view(np.uint32)
    rows_arr = jnp.asarray(rows_np)
    r = np.random.default_rng(rows)
    bias = jnp.asarray(r.standard_normal(vocab), jnp.float32) if ctl.bias else None
    mask = (jnp.asarray(r.integers(0, 2**32, (b, -(-vocab // 32)), dtype=np.uint64)
                        .astype(np.uint32)) if ctl.mask else None)
    cfg = tc.pick_controls_config(b, d, rows, ts.device_capability(), ctl,
                                  w_itemsize=1, layout=layout)
    got = jax.jit(lambda h, w, sc, ra, bias, mask: tc.control_candidates(
        h, w, ra, offset, layout=layout, vocab_size=vocab, controls=ctl,
        bias=bias, allowed_mask=mask, rows_valid=rows_valid, weight_scale=sc))(
            h, w, sc, rows_arr, bias, mask)
    want = jax.jit(lambda h, w, sc, ra, bias, mask: xla_controls_reference(
        h, w, ra, offset, ctl, layout=layout, vocab_size=vocab,
        rows_valid=rows_valid, block_v=cfg.block_v, bias=bias, mask=mask,
        scale=sc))(h, w, sc, rows_arr, bias, mask)
    bits = lambda x: np.asarray(x).view(np.uint32)
    for s_ in range(ctl.samples):
      np.testing.assert_array_equal(np.asarray(got.best_index[:, s_]),
                                    np.asarray(want["best_index"][s_]))
      np.testing.assert_array_equal(bits(got.best_score[:, s_]),
                                    bits(want["best_score"][s_]))
      if ctl.t_best:
        np.testing.assert_array_equal(bits(got.best_t[:, s_]),
                                      bits(want["best_t"][s_]))
    np.testing.assert_array_equal(bits(got.lse_max), bits(want["lse_max"]))
    np.testing.assert_allclose(np.asarray(got.lse_sum), np.asarray(want["lse_sum"]),
                               rtol=1e-5)
    for j in range(ctl.top_k):
      np.testing.assert_array_equal(np.asarray(got.cand_ids[:, j]),
                                    np.asarray(want["cand_ids"][j]))
      np.testing.assert_array_equal(bits(got.cand_vals[:, j]),
                                    bits(want["cand_vals"][j]))
    np.testing.assert_array_equal(bits(got.bound), bits(want["bound"]))

  def test_counter_carry(self):
    hi = jnp.full((4096,), 5, jnp.uint32)
    lo = jnp.full((4096,), 2**32 - 2000, jnp.uint32)
    add = jnp.arange(4096, dtype=jnp.uint32)
    kw = jax.random.key_data(jax.random.key(9))
    got = triton_noise.random_bits(kw, hi, lo, add)
    want = threefry_bits(np.asarray(kw)[0], np.asarray(kw)[1], np.asarray(hi),
                         np.asarray(lo), np.asarray(add))
    np.testing.assert_array_equal(np.asarray(got), want)
