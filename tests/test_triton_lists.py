"""The Triton list kernels (pallas_kernels.triton_lists): a row's top-M
list, log-sum-exp and best from its materialized tempered logits.

* compile (CPU): both kernels lowered to cubin for sm80 and sm90 at the
  heads' widths, without spills.
* interpreter (CPU): the kernels under Triton's interpreter against
  :func:`expected`, a NumPy statement of their contract, on random, tied,
  crowded, masked, NaN and infinite rows (run in a child process by
  ``test_interpreter_suite``, as in tests/test_triton_kernels.py).
* the dense route with the kernels' contract (CPU): stage 2 fed
  :func:`expected`'s lists through ``list_select="kernel"`` (the launch
  patched) gives the reference's tokens, rows the kernels hand over taking
  the exact path; under ``jax.vmap`` the blocks' rows go through one launch.
* gpu (marked ``gpu``): the kernels through jax-triton against
  :func:`expected`, on the same rows and on a 151936-id head's.
"""

from __future__ import annotations

import os
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

triton = pytest.importorskip("triton")

import flashsample_jax as fs  # noqa: E402
from flashsample_jax import api, controls, dense_lists, problem, stage2  # noqa: E402
from flashsample_jax.backends import xla as xla_backend  # noqa: E402
from flashsample_jax.backends.xla import DenseBackend  # noqa: E402
from pallas_kernels import triton_lists as tls  # noqa: E402
from pallas_kernels import triton_noise as noise  # noqa: E402
from tests import inputs  # noqa: E402
from tests.test_triton_kernels import registers  # noqa: E402
from tests.triton_host import interpreted_triton_call, run_interpreter_tests  # noqa: E402

INT_MAX = np.iinfo(np.int32).max
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRET, reason="runs in test_interpreter_suite's child process")
compiled_only = pytest.mark.skipif(INTERPRET, reason="needs compiled kernels")


def _empty_lists(b: int, m: int) -> dict:
  """The kernels' outputs for ``b`` rows before any row is filled in: lists
  of ``m`` with nothing listed, bounds ``-inf``."""
  return dict(cand_vals=np.full((b, m), -np.inf, np.float32),
              cand_ids=np.full((b, m), INT_MAX, np.int32),
              cand_bound=np.full(b, -np.inf, np.float32), lse_max=np.zeros(b, np.float32),
              lse_sum=np.zeros(b, np.float32), best_t=np.zeros(b, np.float32),
              best_id=np.zeros(b, np.int32))


def expected(t, first_id, m: int, slot: int, entries: bool | None = None) -> dict:
  """What the kernels write for ``t [B, W]`` (ids ``first_id + column``),
  lists of ``m`` and slots of ``slot`` ids, in a launch that keeps the
  slots' entries or not (``entries``; None: as one over these rows does,
  ``tls.keeps_entries``) (the module's docstring):
  the top ``m`` by (value descending, id ascending), or, for a row holding a
  NaN or more than ``caps(m)`` slots / values at or above ``tau``, nothing
  listed and the bound +inf. ``lse_sum`` is NumPy's sum (compare it within
  a tolerance)."""
  t = np.asarray(t, np.float32)
  b, w = t.shape
  entries = tls.keeps_entries(b) if entries is None else entries
  s = -(-w // slot)
  slot_cap, cap = tls.caps(m)
  out = _empty_lists(b, m)
  for r in range(b):
    row = t[r]
    nan = np.isnan(row)
    clean = np.where(nan, -np.inf, row)
    top = clean.max()
    out["best_id"][r] = first_id + (np.argmax(nan) if nan.any() else np.argmax(clean == top))
    out["best_t"][r] = out["lse_max"][r] = np.nan if nan.any() else top
    with np.errstate(invalid="ignore", over="ignore"):
      out["lse_sum"][r] = (np.nan if nan.any() or top == np.inf else
                           0.0 if top == -np.inf else np.sum(np.exp(clean - top)))
    padded = np.full(s * slot, -np.inf, np.float32)
    padded[:w] = clean
    maxima = padded.reshape(s, slot).max(axis=1)
    tau = tau_key(order_key(maxima[~np.isnan(padded.reshape(s, slot)).any(axis=1)]), m,
                  entries)
    slots = (order_key(maxima) >= tau) & (maxima > -np.inf)
    values = padded.reshape(s, slot)[slots]
    n_values = int(np.sum((order_key(values) >= tau) & (values > -np.inf)))
    if nan.any() or slots.sum() > slot_cap or n_values > cap:
      out["cand_bound"][r] = np.inf
      continue
    finite = np.flatnonzero(clean > -np.inf)
    order = finite[np.lexsort((finite, -clean[finite]))][:m]
    out["cand_vals"][r, :len(order)] = clean[order]
    out["cand_ids"][r, :len(order)] = first_id + order
  return out


def order_key(x) -> np.ndarray:
  """uint32 keys whose order is the float order (the kernels' order_key)."""
  b = np.asarray(x, np.float32).view(np.uint32)
  return np.where(b >> 31 == 1, ~b, b | np.uint32(0x80000000)).astype(np.uint32)


def tau_key(keys: np.ndarray, m: int, entries: bool) -> int:
  """The kernels' tau over the slot maxima's ``keys``: the m-th largest,
  decided 2 bits a step from the top, stopped once at most ``m +
  tau_slack(m, entries)`` keys reach the bits decided (the rest 0)."""
  tau, shift, reach = 0, 30, len(keys)
  while shift >= 0 and reach > m + tls.tau_slack(m, entries):
    n = [int(np.sum(keys >= (tau | (d << shift)))) for d in range(4)]
    d = sum(c >= m for c in n) - 1
    tau, reach, shift = tau | (d << shift), n[d], shift - 2
  return tau


M, SLOT = 16, 16
W = 8 * M * SLOT + 37          # 131 slots, the last of 5 ids


def rows() -> np.ndarray:
  """One row per case the kernels tell apart."""
  r = np.random.default_rng(0)
  t = r.standard_normal((11, W)).astype(np.float32) * 3
  t[1] = np.round(t[1] * 2) / 2                        # ties, inside the lists and at the M-th
  t[2] = r.integers(-2, 3, W)                          # hundreds of 2s: handed over
  t[3, [100, 7]] = np.nan                              # NaN: handed over; best = first NaN
  t[4] = -np.inf                                       # nothing finite
  t[5] = -np.inf
  t[5, r.choice(W, 5, replace=False)] = r.standard_normal(5)  # fewer finite than M
  t[6] = -np.inf
  t[6, 300:348] = r.standard_normal(48)                # 48 values in 3 slots: > CAP, handed over
  t[7] = -np.inf
  t[7, 300:320] = r.standard_normal(20)                # 20 values in 2 slots: listed
  t[8, 50] = np.inf                                    # +inf: listed; lse NaN
  t[9, 32:40] = 20 + np.arange(8)                      # the top 8 in one slot
  t[10, W - 3:] = 30.0                                 # ties at the top in the last, short slot
  return t


def check(got: dict, want: dict):
  for name in ("cand_vals", "cand_ids", "cand_bound", "best_id", "best_t", "lse_max"):
    np.testing.assert_array_equal(np.asarray(got[name]), want[name], err_msg=name)
  np.testing.assert_allclose(np.asarray(got["lse_sum"]), want["lse_sum"], rtol=2e-5)


@pytest.mark.parametrize("entries", [True, False])
def test_rows_cover_every_case(entries):
  # The cases above do what their comments say (else the tests below could
  # pass without reaching the code they are about), in either kind of launch.
  want = expected(rows(), 5, M, SLOT, entries)
  np.testing.assert_array_equal(np.isinf(want["cand_bound"]) & (want["cand_bound"] > 0),
                                [0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0])
  assert np.isfinite(want["cand_vals"][5]).sum() == 5
  assert np.isfinite(want["cand_vals"][7]).sum() == M
  assert want["best_id"][3] == 5 + 7 and want["cand_vals"][8, 0] == np.inf
  assert np.isnan(want["lse_sum"][8]) and want["lse_sum"][4] == 0
  np.testing.assert_array_equal(want["cand_ids"][10, :3], 5 + np.arange(W - 3, W))
  # With the slots' entries, listed rows take each slot's values >= tau
  # from the slot pass's first two entries, or read the slot again where
  # its third reaches tau: both.
  depths = {int(d) for r in (0, 1, 7, 9, 10) for d in _slot_depths(rows()[r], M, SLOT)}
  assert {1, 2} <= depths and max(depths) >= 3


def _slot_depths(row: np.ndarray, m: int, slot: int) -> np.ndarray:
  """Per slot whose maximum reaches the kernels' tau (a NaN-free row, the
  slots' entries kept), how many of its values reach it."""
  pad = -(-row.size // slot) * slot - row.size
  slots = np.concatenate([row, np.full(pad, -np.inf, np.float32)]).reshape(-1, slot)
  maxima = slots.max(axis=1)
  tau = tau_key(order_key(maxima), m, True)
  reach = slots[(order_key(maxima) >= tau) & (maxima > -np.inf)]
  return np.sum(order_key(reach) >= tau, axis=1)


# ----------------------------------------------------------------------------
# Compile (no GPU)
# ----------------------------------------------------------------------------


@compiled_only
@pytest.mark.parametrize("capability, width, m, per_id, entries",
                         [((9, 0), 151936, 128, True, True), ((9, 0), 128256, 128, False, False),
                          ((8, 0), 201088, 128, True, False), ((8, 0), 151936, 28, False, True)],
                         ids=["sm90-S", "sm90-L", "sm80-gptoss", "sm80-S-m28"])
def test_kernels_compile_without_spills(capability, width, m, per_id, entries, tmp_path):
  # Each head's width and each kind of launch once, on sm90 or sm80 (the
  # registers differ little between them; CI time).
  for k in tls.lists_for_inspection(width, m, dense_lists.slot_size(width, m), per_id=per_id,
                                    entries=entries, capability=capability):
    reg, stack = registers(k.asm["cubin"], tmp_path)
    assert stack == 0, f"spills: {stack} bytes of stack, {reg} registers"


def test_launcher_checks_its_arguments():
  t = jnp.zeros((2, W), jnp.float32)
  with pytest.raises(TypeError, match="float32"):
    tls.row_lists(t.astype(jnp.bfloat16), 0, M, slot=SLOT)
  with pytest.raises(ValueError, match="m=129"):
    tls.row_lists(t, 0, 129, slot=SLOT)
  with pytest.raises(ValueError, match="slot=32"):
    tls.row_lists(t, 0, M, slot=32)
  with pytest.raises(TypeError, match="scale must be float32"):
    tls.row_lists(t, 0, M, slot=SLOT, scale=jnp.ones((W,), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"scale.shape=\(7,\)"):
    tls.row_lists(t, 0, M, slot=SLOT, scale=jnp.ones((7,), jnp.float32))
  with pytest.raises(TypeError, match="inv_temperature must be float32"):
    tls.row_lists(t, 0, M, slot=SLOT, inv_temperature=jnp.ones((2,), jnp.int32))
  with pytest.raises(ValueError, match=r"inv_temperature.shape=\(3,\)"):
    tls.row_lists(t, 0, M, slot=SLOT, inv_temperature=jnp.ones((3,), jnp.float32))


# ----------------------------------------------------------------------------
# Interpreter (CPU)
# ----------------------------------------------------------------------------


@compiled_only
def test_interpreter_suite():
  run_interpreter_tests(__file__)


def tempered_rows(t, scale=None, inv_t=None) -> np.ndarray:
  """The rows the kernels list: ``(t * scale) * inv_t`` in f32, two
  roundings (:func:`tls.load_tempered`)."""
  t = np.asarray(t, np.float32)
  scale = np.float32(1) if scale is None else np.asarray(scale, np.float32)
  inv_t = np.ones(t.shape[0], np.float32) if inv_t is None else np.asarray(inv_t, np.float32)
  return (t * scale).astype(np.float32) * inv_t[:, None]


def interpret(t: np.ndarray, first_id: int, m: int, slot: int, scale=None,
              inv_t=None, entries: bool = False) -> dict:
  """:func:`tls.launch` itself, jax-triton's call replaced by Triton's
  interpreter on host arrays; the slots' entries kept or not (``entries``,
  whatever the rows)."""
  b, w = t.shape
  scale = np.ones(1, np.float32) if scale is None else np.asarray(scale, np.float32).reshape(-1)
  inv_t = np.ones(b, np.float32) if inv_t is None else np.asarray(inv_t, np.float32)
  interpreted = types.SimpleNamespace(triton_call=interpreted_triton_call)
  with mock.patch.object(noise, "jax_triton_module", lambda: interpreted), \
       mock.patch.object(tls, "ENTRIES_MAX_ROWS", b if entries else 0):
    got = tls.launch(np.asarray(t, np.float32), scale, inv_t, np.int32(first_id), m, slot)
  return {name: np.asarray(x) for name, x in got.items()}


@interpreter_only
def test_interpreter_lists_match_their_contract():
  # Ids from 0, the slots' entries kept; the tests below list from other
  # first ids, with and without the entries (the interpreter suite is the
  # CPU suite's longest test: each case once).
  t = rows()
  check(interpret(t, 0, M, SLOT, entries=True), expected(t, 0, M, SLOT, True))


@interpreter_only
@pytest.mark.parametrize("per_id, entries", [(True, True), (False, False)])
def test_interpreter_lists_temper_as_xla(per_id, entries):
  # The kernels read a GEMM's raw output: (t * scale) * (1 / T) per row,
  # with scales of either sign (masked ids stay -inf) and a greedy row (1).
  t = rows()
  r = np.random.default_rng(5)
  scale = (r.uniform(0.5, 2.0, W) * np.where(np.arange(W) % 97 == 0, -1, 1)
           if per_id else np.float32(0.37)).astype(np.float32)
  inv_t = (1 / r.uniform(0.3, 1.5, len(t))).astype(np.float32)
  inv_t[4] = 1
  got = interpret(t, 1000, M, SLOT, scale=scale, inv_t=inv_t, entries=entries)
  check(got, expected(tempered_rows(t, scale, inv_t), 1000, M, SLOT, entries))


@interpreter_only
def test_interpreter_lists_of_a_short_list_and_wide_slots():
  # top_logprobs-sized lists (m = 9: a CAP of 32) from slots of 64 ids.
  t = rows()[:, :9 * 8 * 64]
  check(interpret(t, 3, 9, 64), expected(t, 3, 9, 64))


# ----------------------------------------------------------------------------
# The dense route with the kernels' contract (CPU)
# ----------------------------------------------------------------------------


LAUNCHED = []   # the rows of each patched launch the programs ran, in order


def _numpy_launch(t, scale, inv_t, offset, m, slot):
  """:func:`tls.launch`'s contract, computed on the host (:func:`expected`)."""
  b = t.shape[0]
  shapes = dict(cand_vals=((b, m), jnp.float32), cand_ids=((b, m), jnp.int32),
                cand_bound=((b,), jnp.float32), lse_max=((b,), jnp.float32),
                lse_sum=((b,), jnp.float32), best_t=((b,), jnp.float32),
                best_id=((b,), jnp.int32))
  def run(t, scale, inv_t, f):
    LAUNCHED.append(t.shape[0])
    return expected(tempered_rows(t, scale if scale.shape[0] > 1 else scale[0], inv_t),
                    int(f), m, slot)

  out = jax.pure_callback(run, {k: jax.ShapeDtypeStruct(*v) for k, v in shapes.items()},
                          t, scale, inv_t, offset)
  return dict(out)


B, D, V = 6, 32, 16500      # lists of 128 from slots of 16 ids


@pytest.fixture
def kernel_contract(monkeypatch):
  """``list_select="kernel"`` on the CPU, its kernels' launch replaced by
  :func:`expected`. The patches act when the API's jit traces: its cache is
  cleared before (a trace of the same call by another test must not answer
  for this one) and after (nor this one's for the next)."""
  monkeypatch.setattr(xla_backend, "_platform", lambda: "gpu")
  monkeypatch.setattr(xla_backend, "lists_kernel_usable", lambda: True)
  monkeypatch.setattr(tls, "launch", _numpy_launch)
  LAUNCHED.clear()
  api.run.clear_cache()
  yield
  api.run.clear_cache()


def _flagged(h, w, keys, backend, temperature, **kw):
  """Rows stage 2 hands to the exact path, the pass run as the API runs it
  (``Controls.for_pass``)."""
  p = problem.prepare(h, w, keys, temperature=temperature)
  c = controls.prepare_controls(batch=B, vocab_size=V, rows=V, **kw)
  st = stage2.per_sample(backend.controls_state(p, c.for_pass()), c.samples)
  return int(np.sum(np.asarray(stage2.finish(p, c, st)[2])))


@pytest.mark.parametrize("logits", ["exact", "ties", "random"])
def test_dense_route_with_the_kernels_contract_equals_reference(kernel_contract, logits):
  del kernel_contract
  h, w = inputs.list_inputs(logits, B, D, V)
  t = inputs.pow2_temperatures(B, greedy_every=4, seed=7)
  keys = inputs.row_keys(B, seed=8)
  kw = dict(temperature=t, top_k=40, top_p=0.9, return_logprobs=True, top_logprobs=5,
            return_kept=20)
  be = DenseBackend(list_select="kernel")
  assert be.lists_by() == "kernel"
  # "ties" (integers in [-8, 8]): more values reach tau than CAP holds, so
  # every row is handed to the exact path (greedy ones too: kept sets and
  # log-probabilities need each row's kept set).
  assert _flagged(h, w, keys, be, **kw) == (B if logits == "ties" else 0)
  got = fs.sample(h, w, keys, backend=be, **kw)
  want = fs.reference.sample(h, w, keys, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.kept_ids, want.kept_ids)
  np.testing.assert_array_equal(got.top_ids, want.top_ids)
  np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k,top_p", [
    (40, 0.9), (np.array([40, 0] * (B // 2), np.int32), np.array([0.9, 1.0] * (B // 2)))])
def test_score_tokens_takes_the_kernels_where_sample_does(kernel_contract, top_k, top_p):
  # score_tokens' pass draws no noise whatever the rules; sample's keeps it
  # unless every row truncates. Found by review: score_tokens took the
  # kernels' lists and log-sum-exp where sample took the slots' and XLA's,
  # so a drawn token's floats could score with other bits.
  del kernel_contract
  h, w = inputs.list_inputs("random", B, D, V)
  kw = dict(temperature=inputs.pow2_temperatures(B, greedy_every=4, seed=7), top_k=top_k,
            top_p=top_p)
  keys = inputs.row_keys(B, seed=8)
  be = DenseBackend(list_select="kernel")
  out = fs.sample(h, w, keys, backend=be, return_logprobs=True, return_entropy=True, **kw)
  drawn = list(LAUNCHED)
  sc = fs.score_tokens(h, w, out.tokens, backend=be, **kw)
  assert drawn == ([B] if np.ndim(top_k) == 0 else [])   # [40, 0, ...]: rows without a rule
  assert LAUNCHED == drawn * 2
  for name in ("logprob", "logprob_truncated", "entropy", "entropy_truncated"):
    np.testing.assert_array_equal(np.asarray(getattr(sc, name)).view(np.uint32),
                                  np.asarray(getattr(out, name)).view(np.uint32), err_msg=name)


def lists_under_vmap_match_their_contract():
  """Five blocks of two rows under ``jax.vmap``, with one offset and with
  one each: every block's lists are its own."""
  t = rows().reshape(11, 1, W)[:10].reshape(5, 2, W)
  f = lambda t, o: tls.row_lists(t, o, M, slot=SLOT)
  offsets = np.arange(5, dtype=np.int32) * 100
  one = jax.jit(jax.vmap(f, (0, None)))(jnp.asarray(t), jnp.int32(3))
  own = jax.jit(jax.vmap(f))(jnp.asarray(t), jnp.asarray(offsets))
  for i in range(5):
    # One launch over the ten rows (no entries), or one per block of two.
    check({k: v[i] for k, v in one.items()}, expected(t[i], 3, M, SLOT, False))
    check({k: v[i] for k, v in own.items()}, expected(t[i], offsets[i], M, SLOT))


SCALED = []     # the shape of the scale each patched launch received ((1,): one value)


@pytest.mark.parametrize("head", ["fp8_per_row", "int8_per_tensor", "bf16_biased"])
def test_kernels_temper_the_gemm_output_as_the_reference(kernel_contract, monkeypatch, head):
  # Without a transform the kernels read the GEMM's own product and scale
  # it and divide by T themselves (the tempered logits are not written);
  # with one (here a logit bias) they read x. Same tokens either way.
  del kernel_contract
  launched = tls.launch
  def recording(t, scale, inv_t, offset, m, slot):
    SCALED.append(tuple(scale.shape))
    return launched(t, scale, inv_t, offset, m, slot)
  monkeypatch.setattr(tls, "launch", recording)
  SCALED.clear()
  kw = dict(temperature=inputs.pow2_temperatures(B, greedy_every=4, seed=7), top_k=40,
            top_p=0.9)
  if head == "bf16_biased":
    h, w = inputs.list_inputs("exact", B, D, V)
    kw["logit_bias"] = jnp.asarray(np.random.default_rng(2).integers(-2, 3, V), jnp.float32)
  else:
    dtype = jnp.float8_e4m3fn if head.startswith("fp8") else jnp.int8
    h, w, kw["weight_scale"] = inputs.quantized_inputs(
        B, D, V, dtype=dtype, per_row=head.endswith("per_row"), seed=3)
  keys = inputs.row_keys(B, seed=9)
  got = fs.sample(h, w, keys, backend=DenseBackend(list_select="kernel"), **kw)
  np.testing.assert_array_equal(got, fs.reference.sample(h, w, keys, **kw))
  assert SCALED == [{"fp8_per_row": (V,), "int8_per_tensor": (1,), "bf16_biased": (1,)}[head]]


def test_lists_under_vmap_launch_once_over_the_blocks_rows(kernel_contract):
  # jax-triton's call has no batching rule: row_lists' own puts a batch of
  # blocks through one launch over their rows, and batched offsets through
  # one launch per block.
  del kernel_contract
  lists_under_vmap_match_their_contract()
  assert LAUNCHED == [10] + [2] * 5


def test_sample_under_vmap_takes_the_kernel_lists(kernel_contract):
  del kernel_contract
  h, w = inputs.list_inputs("exact", 3 * B, D, V)
  kw = dict(temperature=inputs.pow2_temperatures(B, greedy_every=4, seed=7), top_k=40,
            top_p=0.9)
  be = DenseBackend(list_select="kernel")
  keys = inputs.row_keys(B, seed=8)
  got = jax.jit(jax.vmap(lambda h: fs.sample(h, w, keys, backend=be, **kw)))(
      h.reshape(3, B, D))
  assert LAUNCHED == [3 * B]
  for i in range(3):
    want = fs.reference.sample(h[i * B:(i + 1) * B], w, keys, **kw)
    np.testing.assert_array_equal(got[i], want)


def vocabulary_shards_equal_reference(n: int):
  """An FP8 head's vocabulary over ``n`` devices (``vocab_axis``), top-k +
  top-p on the dense route with each shard's lists from the kernels (they
  read the shard's scaled logits with its first id traced): the
  reference's tokens on every device."""
  from jax.sharding import AxisType, PartitionSpec as P
  v = 8250 * n                          # shards of 8250 ids: slots of 8
  h, w, s = inputs.quantized_inputs(B, D, v, seed=21)
  kw = dict(temperature=inputs.pow2_temperatures(B, greedy_every=4, seed=22), top_k=40,
            top_p=0.9)
  keys = inputs.row_keys(B, seed=23)
  want = np.asarray(fs.reference.sample(h, w, keys, weight_scale=s, **kw))
  be = DenseBackend(list_select="kernel")
  mesh = jax.make_mesh((n,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
  f = jax.shard_map(
      lambda h, w, s: fs.sample(h, w, keys, backend=be, vocab_axis="tp", weight_scale=s,
                                **kw)[None],
      mesh=mesh, in_specs=(P(), P("tp", None), P("tp")), out_specs=P("tp"), check_vma=False)
  for row in np.asarray(jax.jit(f)(h, w, s)):
    np.testing.assert_array_equal(row, want)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs 8 CPU devices as jax.devices()")
def test_kernel_lists_of_vocabulary_shards_equal_reference(kernel_contract):
  del kernel_contract
  vocabulary_shards_equal_reference(2)
  assert LAUNCHED == [B, B]                 # one launch per shard, over the batch's rows


def test_kernel_lists_need_a_gpu_and_jax_triton(monkeypatch):
  h, w = inputs.exact_inputs(B, D, V, seed=1)
  monkeypatch.setattr(xla_backend, "_platform", lambda: "cpu")
  with pytest.raises(NotImplementedError, match="list_select='kernel'"):
    fs.sample(h, w, jax.random.key(0), backend=DenseBackend(list_select="kernel"), top_k=5)
  monkeypatch.setattr(xla_backend, "_platform", lambda: "gpu")
  monkeypatch.setattr(xla_backend, "lists_kernel_usable", lambda: False)
  assert DenseBackend().lists_by() == "slots"
  monkeypatch.setattr(xla_backend, "lists_kernel_usable", lambda: True)
  assert DenseBackend().lists_by() == "kernel"


@pytest.mark.parametrize("platform,capability,usable",
                         [("gpu", "9.0", True), ("gpu", "8.0", True), ("gpu", "gfx90a", False),
                          ("gpu", "", False), ("cpu", "", False)])
def test_kernel_lists_need_a_cuda_device(monkeypatch, platform, capability, usable):
  # A ROCm device is a "gpu" too, where jax-triton's CUDA launch cannot run
  # (found by review): the dense route then keeps its slot lists.
  import importlib.util
  device = type("Device", (), dict(platform=platform, compute_capability=capability))()
  monkeypatch.setattr(xla_backend.jax, "devices", lambda *a: [device])
  found = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: object() if name in ("triton", "jax_triton")
                      else found(name, *a))
  assert xla_backend.lists_kernel_usable() is usable


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("first_id, entries", [(0, True), (1000, False)])
def test_gpu_lists_match_their_contract(first_id, entries, monkeypatch):
  monkeypatch.setattr(tls, "ENTRIES_MAX_ROWS", 64 if entries else 0)
  t = rows()
  got = jax.jit(lambda t, f: tls.row_lists(t, f, M, slot=SLOT))(jnp.asarray(t),
                                                               jnp.int32(first_id))
  check(got, expected(t, first_id, M, SLOT, entries))


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16, 70])
def test_gpu_lists_of_a_vocabulary_wide_row(b):
  # The S head's width, lists of 128 from slots of 128: the logits of a
  # bf16 product (ties among them), every 7th row masked
  # down to every 100th id.
  v, m = 151936, 128
  r = np.random.default_rng(b)
  t = (r.standard_normal((b, v)) * 2).astype(jnp.bfloat16).astype(np.float32)
  t[::7] = np.where(np.arange(v) % 100 == 0, t[::7], -np.inf)
  slot = dense_lists.slot_size(v, m)
  got = jax.jit(lambda t: tls.row_lists(t, 0, m, slot=slot))(jnp.asarray(t))
  want = expected(t, 0, m, slot)
  check(got, want)
  assert np.all(want["cand_bound"] == -np.inf)       # every row listed, none handed over


@pytest.mark.gpu
@pytest.mark.parametrize("per_id", [True, False])
def test_gpu_lists_temper_as_xla(per_id, monkeypatch):
  # The interpreter test's rows and scales through the real launch (the
  # slots' entries kept with per-id scales).
  monkeypatch.setattr(tls, "ENTRIES_MAX_ROWS", 64 if per_id else 0)
  t = rows()
  r = np.random.default_rng(5)
  scale = (r.uniform(0.5, 2.0, W) * np.where(np.arange(W) % 97 == 0, -1, 1)
           if per_id else np.float32(0.37)).astype(np.float32)
  inv_t = (1 / np.float32([0.6, 0.7, 1.3, 0.35, 1, 0.9, 0.6, 0.7, 0.45, 1.1, 0.8])).astype(
      np.float32)
  got = jax.jit(lambda t, s, i: tls.row_lists(t, 1000, M, slot=SLOT, scale=s,
                                              inv_temperature=i))(
      jnp.asarray(t), jnp.asarray(scale), jnp.asarray(inv_t))
  check(got, expected(tempered_rows(t, scale, inv_t), 1000, M, SLOT, per_id))


@pytest.mark.gpu
def test_gpu_lists_of_vocabulary_shards():
  # The real launch on each of two GPUs (nvidia-h200-x2).
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 GPUs")
  vocabulary_shards_equal_reference(2)


@pytest.mark.gpu
def test_gpu_lists_under_vmap():
  # The batching rule with the real launch (jax-triton's call alone raises
  # under vmap).
  lists_under_vmap_match_their_contract()


# ----------------------------------------------------------------------------
# The entry kernel: lists from the plain kernel's slot entries
# ----------------------------------------------------------------------------


def slot_entries_of(t, slot: int, first_id: int = 0) -> dict:
  """What :mod:`pallas_kernels.sm90_slots` writes for rows ``t [B, W]``
  (every id valid, ids ``first_id + column``) in slots of ``slot`` ids:
  per slot its four largest values in the lists' order with their ids
  (``INT_MAX`` past the slot's ids), the fifth value and the sum of
  ``exp(t - max)``; a slot holding a NaN has the NaN first (its first
  NaN's id)."""
  t = np.asarray(t, np.float32)
  b, w = t.shape
  s = -(-w // slot)
  out = {k: np.zeros((b, s), np.int32 if k.startswith("i") else np.float32)
         for k in tls.ENTRY_FIELDS}
  for r in range(b):
    for j in range(s):
      cols = np.arange(j * slot, min(w, (j + 1) * slot))
      v = t[r, cols]
      nan = np.isnan(v)
      order = np.lexsort((cols, -np.where(nan, 0, v), ~nan))   # NaN first, then by value
      for e in range(5):
        val = v[order[e]] if e < cols.size else -np.inf
        if e == 4:
          out["v5"][r, j] = val
        else:
          out[f"v{e + 1}"][r, j] = val
          out[f"i{e + 1}"][r, j] = first_id + cols[order[e]] if e < cols.size else INT_MAX
      with np.errstate(invalid="ignore", over="ignore"):
        top = v.max()
        out["sum"][r, j] = 0.0 if top == -np.inf else np.sum(np.exp(v - top))
  return out


def expected_entry_lists(f: dict, m: int) -> dict:
  """:func:`tls.entry_lists`' contract on the entries ``f``: the values of
  the slots' entries at or above tau (the m-th largest slot maximum, as the
  kernel decides it), above the bound (the largest fifth value of a slot
  whose maximum and fifth value reach tau), sorted, the first m; a row
  holding a NaN, or with more than ``caps(m)[1]`` such entries, handed over
  (bound +inf, nothing listed). The best and the log-sum-exp from the
  slots' maxima and sums (``lse_sum`` NumPy's: compare it within a
  tolerance)."""
  f = {k: np.asarray(v) for k, v in f.items()}
  b, _ = f["v1"].shape
  cap = tls.caps(m)[1]
  out = _empty_lists(b, m)
  for r in range(b):
    mx, sm, arg = f["v1"][r], f["sum"][r], f["i1"][r]
    nan = np.isnan(mx)
    clean = np.where(nan, -np.inf, mx)
    top = clean.max()
    first = np.argmax(nan) if nan.any() else np.argmax(clean == top)
    out["best_id"][r] = arg[first]
    out["best_t"][r] = out["lse_max"][r] = np.nan if nan.any() else top
    with np.errstate(invalid="ignore", over="ignore"):
      out["lse_sum"][r] = (np.nan if nan.any() or top == np.inf else 0.0 if top == -np.inf
                           else np.sum(np.exp(clean - top) * np.where(clean > -np.inf, sm, 0)))
    if nan.any():
      out["cand_bound"][r] = np.inf
      continue
    tau = tau_key(order_key(mx), m, True)
    sel = (order_key(mx) >= tau) & (mx > -np.inf)
    vals = np.concatenate([f[f"v{e}"][r][sel] for e in range(1, 5)])
    ids = np.concatenate([f[f"i{e}"][r][sel] for e in range(1, 5)])
    take = (order_key(vals) >= tau) & (vals > -np.inf)
    if take.sum() > cap:
      out["cand_bound"][r] = np.inf
      continue
    v5 = f["v5"][r]
    full = sel & (order_key(v5) >= tau) & (v5 > -np.inf)
    bound = v5[full].max() if full.any() else -np.inf
    keep = take & (vals > bound)
    order = np.lexsort((ids[keep], -vals[keep]))[:m]
    out["cand_vals"][r, :order.size] = vals[keep][order]
    out["cand_ids"][r, :order.size] = ids[keep][order]
    out["cand_bound"][r] = bound
  return out


def test_entry_rows_cover_every_case():
  # rows() as slot entries: NaN rows and crowded rows handed over, a row
  # with a finite bound (the top 8 in one slot: its fifth value bounds the
  # list), others exact; the entries reach past the first two.
  f = slot_entries_of(rows(), SLOT, 5)
  want = expected_entry_lists(f, M)
  bound = want["cand_bound"]
  np.testing.assert_array_equal(np.isposinf(bound), [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0])
  assert np.isfinite(bound[9]) and np.isfinite(want["cand_vals"][9]).sum() == 4
  assert np.isfinite(bound[6]) and want["best_id"][3] == 5 + 7
  assert np.isfinite(want["cand_vals"][5]).sum() == 5 and want["lse_sum"][4] == 0
  depths = {int(d) for r in (0, 1, 7, 10) for d in _slot_depths(rows()[r], M, SLOT)}
  assert max(depths) >= 3


def interpret_entries(f: dict, m: int) -> dict:
  """:func:`tls.entry_launch` itself, jax-triton's call replaced by
  Triton's interpreter on host arrays."""
  interpreted = types.SimpleNamespace(triton_call=interpreted_triton_call)
  with mock.patch.object(noise, "jax_triton_module", lambda: interpreted):
    got = tls.entry_launch(tuple(np.asarray(f[k]) for k in tls.ENTRY_FIELDS), m,
                           f["v1"].shape[0])
  return {name: np.asarray(x) for name, x in got.items()}


@interpreter_only
def test_interpreter_entry_lists_match_their_contract():
  f = slot_entries_of(rows(), SLOT, 5)
  check(interpret_entries(f, M), expected_entry_lists(f, M))


@compiled_only
@pytest.mark.parametrize("slots, m", [(1187, 58), (1187, 128), (1002, 58)],
                         ids=["S-m58", "S-m128", "L-m58"])
def test_entry_kernel_compiles_without_spills(slots, m, tmp_path):
  reg, stack = registers(tls.entry_lists_for_inspection(slots, m).asm["cubin"], tmp_path)
  assert stack == 0, f"spills: {stack} bytes of stack, {reg} registers"


def test_entry_launcher_checks_its_arguments():
  f = {k: jnp.zeros((2, 40), jnp.int32 if k.startswith("i") else jnp.float32)
       for k in tls.ENTRY_FIELDS}
  with pytest.raises(ValueError, match="m=0"):
    tls.entry_lists(f, 0)
  with pytest.raises(ValueError, match="lacks the fields"):
    tls.entry_lists({k: v for k, v in f.items() if k != "v5"}, 8)
  with pytest.raises(ValueError, match=r"entries\['i2'\] must be int32"):
    tls.entry_lists(dict(f, i2=f["v1"]), 8)
  with pytest.raises(ValueError, match="rows=3"):
    tls.entry_lists(f, 8, rows=3)


@pytest.mark.gpu
def test_gpu_entry_lists_match_their_contract():
  # All rows, then the first 7 of them (the rest padding it does not read).
  f = slot_entries_of(rows(), SLOT, 5)
  dev = {k: jnp.asarray(v) for k, v in f.items()}
  check(jax.jit(lambda f: tls.entry_lists(f, M))(dev), expected_entry_lists(f, M))
  first = expected_entry_lists({k: v[:7] for k, v in f.items()}, M)
  check(jax.jit(lambda f: tls.entry_lists(f, M, 7))(dev), first)


@pytest.mark.gpu
def test_gpu_entry_lists_under_vmap():
  # The batching rule with the real launch: two blocks of rows in one.
  f = slot_entries_of(rows(), SLOT, 5)
  both = {k: jnp.stack([jnp.asarray(v), jnp.asarray(v)[::-1]]) for k, v in f.items()}
  got = jax.jit(jax.vmap(lambda f: tls.entry_lists(f, M)))(both)
  for i, block in enumerate((f, {k: v[::-1] for k, v in f.items()})):
    check({k: np.asarray(v)[i] for k, v in got.items()}, expected_entry_lists(block, M))
