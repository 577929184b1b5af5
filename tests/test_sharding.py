"""Vocabulary-parallel sampling (flashsample_jax.sharding) on 8 CPU devices.

Exact inputs throughout (tests/inputs.py), so every mesh shape must give the
same tokens as one device and as the reference on 100% of rows.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flashsample_jax as fs
from flashsample_jax import problem, stage2
from tests import inputs
from tests.conftest import has_gpu

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The meshes take the first 8 devices: the 8 host CPU devices of conftest.py.
# On a GPU machine jax.devices() is the GPUs (one, here); the sharded path on
# GPUs is exercised by benchmarks/bench_sharded.py on multi-GPU machines.
pytestmark = pytest.mark.skipif(
    has_gpu(), reason="needs 8 CPU devices as jax.devices() (a CPU-only host)")


def make_mesh(dp, tp, axis_type=AxisType.Auto):
  return jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(axis_type,) * 2,
                       devices=jax.devices()[:dp * tp])


def w_spec(layout, axis="tp"):
  return P(axis, None) if layout == "vd" else P(None, axis)


def in_shard_map(h, w, key, t, mesh, *, layout="vd", vocab_axis="tp",
                 batch_axis=None, vocab_size=None, check_vma=False):
  """Samples inside a user-written shard_map; returns each vocab shard's tokens.

  The result is ``[n_vocab_shards, B]``: row ``i`` is what shard ``i``
  returned, so tests can check that every shard returns the same tokens.
  """
  per_row = key.ndim == 1

  def f(h, w, k, t):
    tok = fs.sample(h, w, k, temperature=t, weight_layout=layout,
                    vocab_size=vocab_size, vocab_axis=vocab_axis,
                    batch_axis=batch_axis)
    return tok[None]

  sm = jax.shard_map(
      f, mesh=mesh,
      in_specs=(P(batch_axis, None), w_spec(layout, vocab_axis),
                P(batch_axis) if per_row else P(), P(batch_axis)),
      out_specs=P(vocab_axis, batch_axis), check_vma=check_vma)
  return np.asarray(jax.jit(sm)(h, w, key, t))


def check_all_shards_agree(per_shard, want):
  for i, row in enumerate(per_shard):
    mismatch = np.nonzero(row != want)[0]
    assert mismatch.size == 0, (
        f"shard {i}: {mismatch.size}/{want.size} rows differ, e.g. row "
        f"{mismatch[0]}: got {row[mismatch[0]]}, want {want[mismatch[0]]}")


def keys_for(kind, b, seed):
  return inputs.row_keys(b, seed=seed) if kind == "row" else jax.random.key(seed)


# -- 1, 2, 4, 8 vocabulary shards: identical tokens ---------------------------


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("key_kind", ["scalar", "row"])
def test_same_tokens_on_1_2_4_8_shards(layout, key_kind):
  b, d, v = 13, 64, 1024   # V = 8 shards x 128 rows
  h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=1)
  t = inputs.pow2_temperatures(b, greedy_every=4, seed=1)
  key = keys_for(key_kind, b, seed=2)
  want = np.asarray(fs.reference.sample(h, w, key, temperature=t,
                                        weight_layout=layout))
  single = np.asarray(fs.sample(h, w, key, temperature=t, weight_layout=layout))
  np.testing.assert_array_equal(single, want)
  for n in (1, 2, 4, 8):
    got = in_shard_map(h, w, key, t, make_mesh(1, n), layout=layout)
    assert got.shape == (n, b)
    check_all_shards_agree(got, want)


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_sample_sharded_convenience_path(layout):
  b, d, v = 9, 64, 512
  h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=3)
  t = inputs.pow2_temperatures(b, greedy_every=3, seed=3)
  for key in (jax.random.key(4), inputs.row_keys(b, seed=4)):
    want = np.asarray(fs.reference.sample(h, w, key, temperature=t,
                                          weight_layout=layout))
    for n in (2, 8):
      mesh = make_mesh(1, n)
      ws = jax.device_put(w, NamedSharding(mesh, w_spec(layout)))
      got = fs.sample_sharded(h, ws, key, mesh=mesh, vocab_axis="tp",
                              temperature=t, weight_layout=layout)
      np.testing.assert_array_equal(got, want)
      # Under the user's jit, with traced arguments.
      f = jax.jit(lambda h, w, k, t, mesh=mesh: fs.sample_sharded(
          h, w, k, mesh=mesh, vocab_axis="tp", temperature=t,
          weight_layout=layout))
      np.testing.assert_array_equal(f(h, ws, key, t), want)


def test_unsharded_weight_is_resharded_and_explicit_axes_work():
  # A replicated weight (or an Explicit-axis mesh) is laid out for the user.
  b, d, v = 8, 64, 512
  h, w = inputs.exact_inputs(b, d, v, seed=5)
  t = inputs.pow2_temperatures(b, greedy_every=2, seed=5)
  key = jax.random.key(5)
  want = np.asarray(fs.reference.sample(h, w, key, temperature=t))
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = make_mesh(2, 4, axis_type)
    for hh, ww in ((h, w), (jax.device_put(h, NamedSharding(mesh, P("dp"))),
                            jax.device_put(w, NamedSharding(mesh, P("tp"))))):
      got = fs.sample_sharded(hh, ww, key, mesh=mesh, vocab_axis="tp",
                              batch_axis="dp", temperature=t)
      np.testing.assert_array_equal(got, want)


def test_arrays_committed_elsewhere_are_moved_to_the_mesh():
  # The docstring's "resharded first" for arrays committed to one device or
  # to another device set (found by review: a raw "incompatible devices"
  # error that named p.hidden for the weight).
  b, d, v = 8, 64, 512
  h, w = inputs.exact_inputs(b, d, v, seed=6)
  key = jax.random.key(6)
  want = np.asarray(fs.reference.sample(h, w, key, top_k=5))
  mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[4:8])
  for hh, ww, kk in ((h, jax.device_put(w, jax.devices()[0]), key),
                     (jax.device_put(h, jax.devices()[1]), w, jax.device_put(key, jax.devices()[3])),
                     (h, jax.device_put(w, NamedSharding(make_mesh(2, 4), P("tp"))), key)):
    got = fs.sample_sharded(hh, ww, kk, mesh=mesh, vocab_axis="tp", top_k=5)
    np.testing.assert_array_equal(got, want)


def test_params_and_abstract_meshes():
  # Found by review: params= reached prepare_controls as an unknown keyword,
  # a misspelled control was reported under that internal name, and an
  # AbstractMesh failed in the runtime unless it was the one set.
  b, d, v = 8, 64, 512
  h, w = inputs.exact_inputs(b, d, v, seed=7)
  key = jax.random.key(7)
  t = inputs.pow2_temperatures(b, seed=7)
  want = np.asarray(fs.reference.sample(h, w, key, temperature=t, top_k=5, top_p=0.9))
  mesh = make_mesh(2, 4)
  params = fs.SamplingParams(temperature=t, top_k=5, top_p=0.9)
  np.testing.assert_array_equal(
      fs.sample_sharded(h, w, key, params, mesh=mesh, vocab_axis="tp", batch_axis="dp"), want)
  with pytest.raises(TypeError, match=r"sample_sharded\(\) got unexpected keyword "
                                      r"arguments \['topk'\]"):
    fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis="tp", topk=5)
  with pytest.raises(TypeError, match=r"got params and \['top_k'\]"):
    fs.sample_sharded(h, w, key, params, mesh=mesh, vocab_axis="tp", top_k=5)
  with pytest.raises(ValueError, match="AbstractMesh that is not the one set"):
    fs.sample_sharded(h, w, key, mesh=mesh.abstract_mesh, vocab_axis="tp")
  with jax.set_mesh(mesh):
    np.testing.assert_array_equal(
        fs.sample_sharded(h, w, key, params, mesh=mesh.abstract_mesh, vocab_axis="tp"), want)


def test_auto_picks_the_backend_for_one_shard(monkeypatch):
  # Found by review on two H200s: an 8-bit head of 192 rows suits the mosaic
  # kernel, its 96-row halves do not, and auto chose by the whole head.
  from flashsample_jax import backends
  seen = []
  resolve = backends.resolve
  monkeypatch.setattr(backends, "resolve",
                      lambda b, p, c: seen.append((p.weight.shape, p.hidden.shape,
                                                   p.weight_scale.shape, p.vocab_shards))
                      or resolve(b, p, c))
  b, d, v = 8, 64, 512
  h, w = inputs.exact_inputs(b, d, v, seed=8)
  w8, scale = fs.quantize_weight(w, "int8")
  key = jax.random.key(8)
  got = fs.sample_sharded(h, w8, key, mesh=make_mesh(2, 4), vocab_axis="tp", batch_axis="dp",
                          weight_scale=scale)
  assert seen == [((v // 4, d), (b // 2, d), (v // 4,), 4)]
  np.testing.assert_array_equal(got, fs.reference.sample(h, w8, key, weight_scale=scale))


def test_sample_sharded_flagged_rows_on_every_batch_shard():
  # Zero hidden rows (all-equal logits) take the exact path on each batch
  # shard; its branches make the noise counters again, which must be each
  # shard's own rows' (a scalar key's counters are global rows), eagerly and
  # under the user's jit.
  b, d, v = 8, 64, 512
  h, w = inputs.exact_inputs(b, d, v, seed=6)
  h = h.at[np.array([1, 5, 6])].set(0)
  kw = dict(temperature=0.5, top_k=20, top_p=0.9)
  key = jax.random.key(6)
  want = np.asarray(fs.reference.sample(h, w, key, **kw))
  mesh = make_mesh(2, 4)
  call = lambda h, k: fs.sample_sharded(h, w, k, mesh=mesh, vocab_axis="tp",
                                        batch_axis="dp", backend="xla", **kw)
  np.testing.assert_array_equal(call(h, key), want)
  np.testing.assert_array_equal(jax.jit(call)(h, key), want)


# -- 2-D meshes: data parallel x vocabulary parallel --------------------------


@pytest.mark.parametrize("dp,tp", [(2, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("key_kind", ["scalar", "row"])
def test_dp_x_tp_mesh_matches_one_device(dp, tp, key_kind):
  b, d, v = 16, 64, 640
  h, w = inputs.exact_inputs(b, d, v, seed=6)
  t = inputs.pow2_temperatures(b, greedy_every=5, seed=6)
  key = keys_for(key_kind, b, seed=6)
  want = np.asarray(fs.reference.sample(h, w, key, temperature=t,
                                        vocab_size=600))
  mesh = make_mesh(dp, tp)
  got = in_shard_map(h, w, key, t, mesh, batch_axis="dp", vocab_size=600)
  check_all_shards_agree(got, want)
  got = fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis="tp",
                          batch_axis="dp", temperature=t, vocab_size=600)
  np.testing.assert_array_equal(got, want)


def test_tuple_vocab_axis_over_both_mesh_axes():
  # vocab_axis=("dp", "tp"): 8 shards, shard index dp * 4 + tp.
  b, d, v = 6, 64, 1024
  h, w = inputs.exact_inputs(b, d, v, layout="dv", seed=7)
  t = inputs.pow2_temperatures(b, seed=7)
  mesh = make_mesh(2, 4)
  for key in (jax.random.key(7), inputs.row_keys(b, seed=7)):
    want = np.asarray(fs.reference.sample(h, w, key, temperature=t,
                                          weight_layout="dv"))
    got = in_shard_map(h, w, key, t, mesh, layout="dv",
                       vocab_axis=("dp", "tp"))
    check_all_shards_agree(got, want)
    got = fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis=("dp", "tp"),
                            temperature=t, weight_layout="dv")
    np.testing.assert_array_equal(got, want)


def test_batch_axis_alone_keys_rows_globally():
  # Data parallel only: no collective, but the scalar key's counters must
  # use the global row index.
  b, d, v = 8, 64, 300
  h, w = inputs.exact_inputs(b, d, v, seed=8)
  t = jnp.full((b,), 0.5, jnp.float32)
  key = jax.random.key(8)
  want = np.asarray(fs.reference.sample(h, w, key, temperature=t))
  mesh = make_mesh(4, 1)
  f = jax.shard_map(
      lambda h, w, k, t: fs.sample(h, w, k, temperature=t, batch_axis="dp"),
      mesh=mesh, in_specs=(P("dp"), P(), P(), P("dp")), out_specs=P("dp"),
      check_vma=False)
  np.testing.assert_array_equal(jax.jit(f)(h, w, key, t), want)


# -- padding, greedy rows, NaN/inf --------------------------------------------


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_padded_vocab_never_returns_padding(layout):
  # 4 shards of 200 rows; vocab_size 550 leaves shard 3 entirely padding and
  # shard 2 partly. Padding rows are made attractive.
  b, d, v = 11, 64, 800
  h, w = inputs.exact_inputs(b, d, v, layout=layout, seed=9)
  big = jnp.asarray(100, w.dtype)
  w = w.at[550:].set(big) if layout == "vd" else w.at[:, 550:].set(big)
  h = jnp.abs(h) + 1
  mesh = make_mesh(1, 4)
  for key in (jax.random.key(9), inputs.row_keys(b, seed=9)):
    for t in (jnp.ones((b,)), jnp.zeros((b,)),
              inputs.pow2_temperatures(b, greedy_every=2, seed=9)):
      want = np.asarray(fs.reference.sample(h, w, key, temperature=t,
                                            weight_layout=layout,
                                            vocab_size=550))
      got = in_shard_map(h, w, key, t, mesh, layout=layout, vocab_size=550)
      check_all_shards_agree(got, want)
      assert (got < 550).all()


def test_greedy_ties_across_shards_take_lowest_id():
  # Equal maxima in shards 1 and 3: the lower id wins on every shard.
  b, d, v = 5, 64, 512
  h, w = inputs.exact_inputs(b, d, v, seed=10)
  w = w.at[:].set(0).at[200].set(1).at[450].set(1)
  h = jnp.abs(h) + 1
  got = in_shard_map(h, w, jax.random.key(0), jnp.zeros((b,)), make_mesh(1, 4))
  check_all_shards_agree(got, np.full((b,), 200))


def test_nan_and_inf_match_reference():
  b, d, v = 6, 64, 1024
  h, w = inputs.exact_inputs(b, d, v, dtype=jnp.float32, seed=11)
  h = h.at[0, 0].set(jnp.nan)              # row 0: every logit NaN
  w = w.at[417, :].set(jnp.inf)            # id 417 (shard 3): +-inf or NaN
  w = w.at[900, 3].set(jnp.nan)            # id 900 (shard 7): NaN everywhere
  mesh = make_mesh(1, 8)
  for t in (jnp.ones((b,)), jnp.zeros((b,))):
    for key in (jax.random.key(0), inputs.row_keys(b)):
      want = np.asarray(fs.reference.sample(h, w, key, temperature=t))
      check_all_shards_agree(in_shard_map(h, w, key, t, mesh), want)


def test_random_inputs_agree_with_one_device():
  b, d, v = 32, 128, 4096
  h, w = inputs.random_inputs(b, d, v, seed=12)
  t = jnp.full((b,), 0.7, jnp.float32)
  key = jax.random.key(12)
  one = np.asarray(fs.sample(h, w, key, temperature=t))
  got = in_shard_map(h, w, key, t, make_mesh(2, 4), batch_axis="dp")
  check_all_shards_agree(got[:1], got[0])
  assert (got[0] == one).mean() >= 0.999


def test_prepare_batch_shard_and_vocab_shards():
  # Rows 4..7 of a batch, prepared as data-parallel shard 1 of 2, get the
  # global counters, and their samples step over the global batch.
  b, d, v = 8, 64, 100
  h, w = inputs.exact_inputs(b, d, v, seed=13)
  key = jax.random.key(0)
  whole = problem.prepare(h, w, key, vocab_size=300, vocab_shards=4)
  part = problem.prepare(h[4:], w, key, vocab_size=300, vocab_shards=4,
                         batch_shard=(1, 2))
  np.testing.assert_array_equal(part.ctr_hi, whole.ctr_hi[4:])
  np.testing.assert_array_equal(part.ctr_lo, whole.ctr_lo[4:])
  np.testing.assert_array_equal(part.ctr_lo, np.arange(4, 8) * 300)
  assert part.sample_stride == whole.sample_stride == 8 * 300
  for got, want in zip(part.counters(3), whole.counters(3)):
    np.testing.assert_array_equal(got, np.asarray(want)[:, 4:])
  assert whole.vocab_size == 300 and whole.vocab_shards == 4
  assert problem.prepare(h, w, key, vocab_shards=4).vocab_size == 400
  traced = jax.jit(lambda o: problem.prepare(
      h[4:], w, key, vocab_size=300, vocab_shards=4, batch_shard=(o, 2)).ctr_lo)(
          jnp.int32(1))
  np.testing.assert_array_equal(traced, part.ctr_lo)


# -- the collective moves O(B) bytes, never [B, V] ----------------------------

_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-gather|all-reduce|collective-permute|all-to-all|"
    r"reduce-scatter|all-gather-start|all-reduce-start|"
    r"collective-permute-start)\(")


def collectives(hlo_text):
  """``(op, elements)`` for every cross-device op in compiled HLO text."""
  out = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    elements = 0
    for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1)):
      elements += int(np.prod([int(x) for x in dims.split(",") if x] or [1]))
    out.append((m.group(2), elements))
  return out


@pytest.mark.parametrize("dp,tp", [(1, 8), (2, 4)])
def test_compiled_collectives_are_o_of_b(dp, tp):
  b, d, v = 32, 64, 1 << 15
  mesh = make_mesh(dp, tp)
  h = jax.ShapeDtypeStruct((b, d), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("dp", None)))
  w = jax.ShapeDtypeStruct((v, d), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("tp", None)))
  t = jax.ShapeDtypeStruct((b,), jnp.float32,
                           sharding=NamedSharding(mesh, P("dp")))
  key = jax.random.key(0)
  convenience = jax.jit(lambda h, w, t: fs.sample_sharded(
      h, w, key, mesh=mesh, vocab_axis="tp", batch_axis="dp", temperature=t))

  def user(h, w, t):
    return jax.shard_map(
        lambda h, w, t: fs.sample(h, w, key, temperature=t, vocab_axis="tp",
                                  batch_axis="dp"),
        mesh=mesh, in_specs=(P("dp", None), P("tp", None), P("dp")),
        out_specs=P("dp"), check_vma=False)(h, w, t)

  for f in (convenience, jax.jit(user)):
    ops = collectives(f.lower(h, w, t).compile().as_text())
    assert ops, "expected one all-gather of the candidates"
    for op, elements in ops:
      # The local batch is b / dp rows; (score, id) per row and shard.
      assert elements <= 2 * tp * (b // dp), (op, elements)
      assert elements < b * v // 1000, (op, elements)


# -- validation -----------------------------------------------------------------


def test_validation_errors_name_the_argument():
  b, d, v = 4, 64, 256
  h, w = inputs.exact_inputs(b, d, v, seed=14)
  key = jax.random.key(0)
  mesh = make_mesh(2, 4)
  with pytest.raises(ValueError, match=r"vocab_axis='model'.*mesh's axis names"):
    fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis="model")
  with pytest.raises(ValueError, match=r"batch_axis='data'"):
    fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis="tp", batch_axis="data")
  with pytest.raises(ValueError, match=r"share the axes \['tp'\]"):
    fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis="tp", batch_axis="tp")
  with pytest.raises(ValueError, match=r"V=255 .* divisible by the size 4 of "
                                       r"vocab_axis='tp'"):
    fs.sample_sharded(h, w[:255], key, mesh=mesh, vocab_axis="tp")
  with pytest.raises(ValueError, match=r"B=3 must be divisible by the size 2 "
                                       r"of batch_axis='dp'"):
    fs.sample_sharded(h[:3], w, key, mesh=mesh, vocab_axis="tp",
                      batch_axis="dp")
  with pytest.raises(ValueError, match=r"vocab_size=257 must be in \[1, 256\]"):
    fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis="tp", vocab_size=257)
  with pytest.raises(ValueError, match=r"vocab_axis=3 must be a mesh axis name"):
    fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis=3)
  with pytest.raises(ValueError, match=r"names an axis twice"):
    fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis=("tp", "tp"))
  with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh"):
    fs.sample_sharded(h, w, key, mesh="tp", vocab_axis="tp")
  # Outside any shard_map, vocab_axis has nothing to bind to.
  with pytest.raises(ValueError, match=r"vocab_axis='tp' is not an axis of the "
                                       r"enclosing shard_map"):
    fs.sample(h, w, key, vocab_axis="tp")

  def inside(**kw):
    f = jax.shard_map(lambda h, w: fs.sample(h, w, key, **kw), mesh=mesh,
                      in_specs=(P(), P("tp")), out_specs=P(), check_vma=False)
    return jax.jit(f)(h, w)

  with pytest.raises(ValueError, match=r"vocab_axis='model' is not an axis"):
    inside(vocab_axis="model")
  with pytest.raises(ValueError, match=r"batch_axis='data' is not an axis"):
    inside(vocab_axis="tp", batch_axis="data")
  # The local shard has 64 rows: 4 shards hold at most 256 ids.
  with pytest.raises(ValueError, match=r"vocab_size=300 must be in \[1, 256\]"
                                       r".*4 vocabulary shards"):
    inside(vocab_axis="tp", vocab_size=300)


def test_inside_shard_map_with_check_vma():
  b, d, v = 8, 64, 512
  h, w = inputs.exact_inputs(b, d, v, seed=15)
  t = jnp.ones((b,))
  key = jax.random.key(15)
  want = np.asarray(fs.reference.sample(h, w, key, temperature=t))
  got = in_shard_map(h, w, key, t, make_mesh(2, 4), batch_axis="dp",
                     check_vma=True)
  check_all_shards_agree(got, want)


def _replicated_weight(fn, h, w, mesh, *, w_spec_=P(), check_vma=True):
  sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), w_spec_), out_specs=P(),
                     check_vma=check_vma)
  return jax.jit(sm)(h, w)


def test_a_per_row_scale_replicated_beside_a_sharded_head_is_refused():
  # A shard's [V / n] weight_scale given replicated (P()) beside a head
  # sharded over vocab_axis would scale every shard's rows by those scales:
  # refused, naming weight_scale. Sharded like the head, or a scalar: the
  # reference's tokens.
  h, w = inputs.exact_inputs(8, 64, 512, seed=21)
  w8, scale = fs.quantize_weight(w, "int8")
  key = jax.random.key(5)
  mesh = make_mesh(1, 4)

  def sharded(scale_spec, scale):
    fn = lambda h, w, s: fs.sample(h, w, key, weight_scale=s, vocab_axis="tp",
                                   temperature=0.7, top_k=20)
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("tp", None), scale_spec),
                       out_specs=P())
    return np.asarray(jax.jit(sm)(h, w8, scale))

  # A shard's worth of scales replicated (the whole [V] replicated has the
  # wrong shape on every shard, which the shape check names).
  with pytest.raises(ValueError, match=r"weight_scale is replicated over vocab_axis='tp'"
                                       r".*in_specs P\('tp'\)"):
    sharded(P(), scale[:128])
  with pytest.raises(ValueError, match=r"weight_scale.shape=\(512,\) must be"):
    sharded(P(), scale)
  want = fs.reference.sample(h, w8, key, weight_scale=scale, temperature=0.7, top_k=20)
  np.testing.assert_array_equal(sharded(P("tp"), scale), want)
  one = jnp.float32(0.02)
  want = fs.reference.sample(h, w8, key, weight_scale=one, temperature=0.7, top_k=20)
  np.testing.assert_array_equal(sharded(P(), one), want)


def test_check_weight_refuses_a_head_replicated_over_vocab_axis():
  # Issue #42, defect 4: a head replicated over vocab_axis is read as 4 slices
  # of a 4x larger vocabulary. vma types (check_vma=True) tell; the check
  # names weight and vocab_axis and says what to do.
  from flashsample_jax import mesh as fs_mesh
  h, w = inputs.exact_inputs(4, 64, 256, seed=16)
  mesh = make_mesh(2, 4)

  def check(vocab_axis, layout="vd"):
    def fn(h, w):
      fs_mesh.MeshAxes.of(vocab_axis).check_weight(w, layout)
      return h
    return fn

  for spec, layout in ((P(), "vd"), (P("dp", None), "vd"), (P(), "dv")):
    with pytest.raises(ValueError, match=r"weight is replicated over vocab_axis='tp'.*"
                                         r"Shard the head over the axis.*drop vocab_axis"):
      _replicated_weight(check("tp", layout), h, w, mesh, w_spec_=spec)
  with pytest.raises(ValueError, match=r"vocab_axis=\('dp', 'tp'\).*not over \['dp'\]"):
    _replicated_weight(check(("dp", "tp")), h, w, mesh, w_spec_=P("tp", None))
  # Sharded over the axis: accepted (one axis, a tuple, either layout).
  _replicated_weight(check("tp"), h, w, mesh, w_spec_=P("tp", None))
  _replicated_weight(check(("dp", "tp")), h, w, mesh, w_spec_=P(("dp", "tp"), None))
  _replicated_weight(check("tp", "dv"), h, w.T, mesh, w_spec_=P(None, "tp"))
  # An axis of size 1: replicated and sharded are the same.
  _replicated_weight(check("tp"), h, w, make_mesh(8, 1))
  # check_vma=False tracks no variance: nothing to tell, nothing refused
  # (documented in MeshAxes.check_weight).
  _replicated_weight(check("tp"), h, w, mesh, check_vma=False)


def test_sample_refuses_a_head_replicated_over_vocab_axis():
  # The case: every input replicated, vocab_axis="tp": ids up to
  # 4 * V - 1 came back silently for V = 256.
  h, w = inputs.exact_inputs(4, 64, 256, seed=17)
  key = jax.random.key(17)
  with pytest.raises(ValueError, match=r"weight is replicated over vocab_axis='tp'"):
    _replicated_weight(lambda h, w: fs.sample(h, w, key, vocab_axis="tp"), h, w,
                       make_mesh(2, 4))


# -- multi-host: 2 processes x 4 CPU devices via jax.distributed ----------------


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one_process(tmp_path):
  from tests import _multihost_worker as worker
  out = tmp_path / "tokens.json"
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests._multihost_worker", str(i), "2", str(port),
       str(out)], cwd=_ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=150)[0].decode(errors="replace"))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{logs[i][-3000:]}"
  got = json.loads(out.read_text())
  for case in worker.cases():
    kd = worker.key_data(case)
    key = jax.random.wrap_key_data(jnp.asarray(kd))
    want = fs.reference.sample(
        jnp.asarray(case["hidden"], jnp.bfloat16),
        jnp.asarray(case["weight"], jnp.bfloat16), key,
        temperature=jnp.asarray(case["temperature"]),
        weight_layout=case["layout"], vocab_size=case["vocab_size"])
    np.testing.assert_array_equal(np.asarray(got[case["name"]]), want,
                                  err_msg=case["name"])


# -- sampling controls on sharded heads ------------------------------------------

_CB, _CD, _CV = 16, 64, 1024
_R = np.random.default_rng(7)
_CONTROLS = {
    "truncation": dict(top_k=jnp.asarray(_R.integers(0, 40, _CB), jnp.int32),
                       top_p=0.8, min_p=0.02),
    "transforms": dict(softcap=6.0,
                       logit_bias=jnp.asarray(_R.integers(-3, 4, _CV), jnp.float32),
                       allowed_mask=jnp.asarray(_R.integers(0, 2**32, (_CB, _CV // 32),
                                                            dtype=np.uint32))),
    "samples_logprobs": dict(top_k=20, num_samples=3, return_logprobs=True),
    # Penalties (exact: powers of two, quarters) with histories spread over
    # every shard's rows, and the top log-probabilities.
    "penalties_top_logprobs": dict(
        top_k=25, top_p=0.9, top_logprobs=6,
        repetition_penalty=jnp.asarray(_R.choice([0.5, 1.0, 2.0], _CB), jnp.float32),
        presence_penalty=0.5, frequency_penalty=jnp.asarray(
            _R.choice([0.0, 0.25, 1.0], _CB), jnp.float32),
        prompt_ids=jnp.asarray(_R.integers(-1, _CV, (_CB, 30)), jnp.int32),
        output_ids=jnp.asarray(_R.integers(-1, 200, (_CB, 20)), jnp.int32)),
}


def _controls_in_shard_map(h, w, key, t, mesh, ctl, *, batch_axis=None,
                           backend="auto"):
  """Each vocab shard's output of sample(..., **ctl) in a user's shard_map."""
  arrays = {n: v for n, v in ctl.items() if hasattr(v, "ndim")}
  statics = {n: v for n, v in ctl.items() if n not in arrays}
  specs = {n: (P(batch_axis, None) if v.ndim == 2 else
               P(batch_axis) if v.ndim == 1 and n != "logit_bias" else P())
           for n, v in arrays.items()}

  def f(h, w, k, t, arrays):
    out = fs.sample(h, w, k, temperature=t, vocab_axis="tp", batch_axis=batch_axis,
                    backend=backend, **arrays, **statics)
    return jax.tree.map(lambda a: a[None], out)

  s = statics.get("num_samples")
  tok = P("tp", batch_axis) if s is None else P("tp", None, batch_axis)
  top = P("tp", batch_axis, None) if statics.get("top_logprobs") else None
  lp = tok if statics.get("return_logprobs") else None
  out = (fs.SampleOutput(tok, lp, lp, lp, top, top)
         if statics.get("return_logprobs") or top else tok)
  per_row = key.ndim == 1
  sm = jax.shard_map(f, mesh=mesh,
                     in_specs=(P(batch_axis, None), P("tp", None),
                               P(batch_axis) if per_row else P(), P(batch_axis), specs),
                     out_specs=out)
  return jax.jit(sm)(h, w, key, t, arrays)


def _check_controls(got, want):
  """``got``: per-shard outputs (leading axis = vocab shard)."""
  if isinstance(want, fs.SampleOutput):
    for shard in range(got.tokens.shape[0]):
      np.testing.assert_array_equal(got.tokens[shard], want.tokens)
      if want.logprob is not None:
        np.testing.assert_allclose(got.logprob[shard], want.logprob, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got.logprob_truncated[shard], want.logprob_truncated,
                                   rtol=2e-5, atol=2e-5)
      if want.top_ids is not None:
        np.testing.assert_array_equal(got.top_ids[shard], want.top_ids)
        np.testing.assert_allclose(got.top_logprobs[shard], want.top_logprobs,
                                   rtol=2e-5, atol=2e-5)
  else:
    for shard in np.asarray(got):
      np.testing.assert_array_equal(shard, want)


# Each control case with one key kind (the key decides only the noise
# counters, whose sharding the plain tests cover with both): a scalar key
# where samples make the counters span the global batch.
@pytest.mark.parametrize("case,key_kind", [
    ("truncation", "row"), ("transforms", "scalar"), ("samples_logprobs", "scalar"),
    ("penalties_top_logprobs", "row")])
def test_controls_same_on_1_2_4_8_shards(case, key_kind):
  h, w = inputs.exact_inputs(_CB, _CD, _CV, scale=1, seed=8)
  t = inputs.pow2_temperatures(_CB, greedy_every=5, seed=8) * 4
  key = keys_for(key_kind, _CB, seed=8)
  ctl = _CONTROLS[case]
  want = fs.reference.sample(h, w, key, temperature=t, **ctl)
  # 1, 2 and 8 shards (CI time: the plain tests run 4 as well).
  for n in (1, 2, 8):
    _check_controls(_controls_in_shard_map(h, w, key, t, make_mesh(1, n), ctl), want)


def test_controls_on_dp_x_tp_mesh_and_fallback(monkeypatch):
  # Scalar key with num_samples on a 2x4 mesh: counters use the global batch.
  # 4 candidates force most truncated rows through the gathered fallback.
  monkeypatch.setattr(stage2, "CANDIDATES", 4)
  jax.clear_caches()  # M is read when the sampler is traced
  h, w = inputs.exact_inputs(_CB, _CD, _CV, scale=1, seed=9)
  t = inputs.pow2_temperatures(_CB, seed=9) * 4
  key = jax.random.key(9)
  ctl = dict(top_k=30, top_p=0.7, num_samples=2, top_logprobs=3,
             presence_penalty=1.0, prompt_ids=_CONTROLS["penalties_top_logprobs"]["prompt_ids"],
             output_ids=_CONTROLS["penalties_top_logprobs"]["output_ids"])
  want = fs.reference.sample(h, w, key, temperature=t, **ctl)
  got = _controls_in_shard_map(h, w, key, t, make_mesh(2, 4), ctl, batch_axis="dp")
  _check_controls(got, want)


def test_sample_sharded_passes_controls():
  h, w = inputs.exact_inputs(_CB, _CD, _CV, scale=1, seed=10)
  t = inputs.pow2_temperatures(_CB, seed=10) * 4
  key = inputs.row_keys(_CB, seed=10)
  ctl = dict(top_k=jnp.full((_CB,), 25, jnp.int32), top_p=0.9,
             allowed_mask=_CONTROLS["transforms"]["allowed_mask"], num_samples=2,
             return_logprobs=True, top_logprobs=4, repetition_penalty=2.0,
             frequency_penalty=0.5,
             output_ids=_CONTROLS["penalties_top_logprobs"]["output_ids"])
  want = fs.reference.sample(h, w, key, temperature=t, **ctl)
  mesh = make_mesh(2, 4)
  got = fs.sample_sharded(h, jax.device_put(w, NamedSharding(mesh, P("tp", None))), key,
                          mesh=mesh, vocab_axis="tp", batch_axis="dp", temperature=t,
                          **ctl)
  _check_controls(jax.tree.map(lambda a: np.asarray(a)[None], got), want)


def test_top_p_boundary_rows_same_on_any_shard_count():
  # Found in review: near p the mass before an id rounds differently per
  # shard count; such rows take the exact (gathered) path.
  h, w = inputs.exact_inputs(8, 4, 1024, scale=2, seed=0)
  key = jax.random.key(0)
  for row, p in ((7, 0.1696888655424118), (5, 0.4627354145050049)):
    hr = jnp.broadcast_to(h[row:row + 1], (8, 4))
    t = jnp.ones((8,), jnp.float32)
    ctl = dict(top_p=p, num_samples=8)
    want = np.asarray(fs.reference.sample(hr, w, key, temperature=t, **ctl))
    for n in (1, 4):
      _check_controls(_controls_in_shard_map(hr, w, key, t, make_mesh(1, n), ctl), want)


@pytest.mark.parametrize("case", ["transforms", "truncation", "penalties_top_logprobs"])
def test_mosaic_controls_on_shards_not_multiple_of_32(case):
  # The mosaic controls kernel on vocabulary shards of 500 and 250 rows:
  # shard offsets that are not multiples of 32, so the bias and the mask
  # words are realigned per shard (and the history's planes hold each
  # shard's own ids). Interpret mode cannot run a Mosaic GPU
  # kernel on several devices at once (its shared-memory bookkeeping
  # reports barriers left allocated, for the plain kernel too), so the
  # shards run one after another on one device, each with its own offset,
  # and their states are merged as the all-gather inside shard_map does.
  from flashsample_jax import controls
  from flashsample_jax.backends.mosaic import MosaicBackend
  v = 1000
  h, w = inputs.exact_inputs(_CB, _CD, v, scale=1, seed=9)
  t = inputs.pow2_temperatures(_CB, greedy_every=5, seed=9) * 4
  r = np.random.default_rng(9)
  ctl = dict(_CONTROLS[case])
  if case != "truncation":
    ctl["allowed_mask"] = jnp.asarray(r.integers(0, 2**32, (_CB, -(-v // 32)),
                                                 dtype=np.uint32))
  if case == "transforms":
    ctl["logit_bias"] = jnp.asarray(r.integers(-3, 4, v), jnp.float32)
  # History ids over every shard's rows (the outputs, drawn below 200 with
  # repeats, spread by 5 keeping their repeats).
  for name, scale in (("prompt_ids", 1), ("output_ids", 5)):
    if name in ctl:
      ctl[name] = jnp.where(ctl[name] >= 0, ctl[name] * scale % v, -1)
  key = jax.random.key(9)
  want = fs.reference.sample(h, w, key, temperature=t, **ctl)
  kernel = MosaicBackend(interpret=True)
  # Jitted as inside shard_map: each shard's offset a traced operand (the
  # kernel takes it as one either way), so the shards of one size share a
  # program.
  state = jax.jit(lambda p, c, offset: kernel.controls_state(p, c, vocab_offset=offset))
  finish = jax.jit(lambda p, c, st: stage2.finish(p, c, st))
  c = controls.prepare_controls(batch=_CB, vocab_size=v, rows=v, **ctl)
  for n in (2, 4):
    rows = v // n
    shard = lambda i: problem.prepare(h, w[i * rows:(i + 1) * rows], key,
                                      temperature=t, vocab_size=v, vocab_shards=n)
    states = [state(shard(i), c, jnp.int32(i * rows)) for i in range(n)]
    combine = jax.jit(stage2.state_combine(c, stage2.candidate_count(shard(0), c)))
    st = states[0]
    for other in states[1:]:   # shard order = id order, as after the all-gather
      st = combine(st, other)
    # Decided on the whole head: the rare materialized rows read all of W,
    # as the gathered logits inside shard_map do.
    whole = problem.prepare(h, w, key, temperature=t)
    tokens, out, _ = finish(whole, c, st)
    if isinstance(want, fs.SampleOutput):
      out = out.first_sample()
      np.testing.assert_array_equal(out.top_ids, want.top_ids, err_msg=f"{n} shards")
      np.testing.assert_allclose(out.top_logprobs, want.top_logprobs, rtol=2e-5, atol=2e-5)
      np.testing.assert_array_equal(out.tokens, want.tokens, err_msg=f"{n} shards")
    else:
      np.testing.assert_array_equal(tokens[0], want, err_msg=f"{n} shards")


@pytest.mark.parametrize("check_vma", [True, False])
def test_all_gather_tree_is_one_collective_and_bit_exact(check_vma):
  """The controls state's exchange: every leaf (f32 with NaN, -0.0 and inf
  payloads, int32, uint32, mixed shapes) comes back bit for bit as a
  leaf-by-leaf all-gather gives it, from one all-gather in the program."""
  from flashsample_jax import mesh as fs_mesh
  m = make_mesh(1, 4)
  rng = np.random.default_rng(0)
  f = rng.standard_normal((4 * 3, 5)).astype(np.float32)
  f[0, :4] = [np.nan, -0.0, np.inf, -np.inf]
  tree = {"f": jnp.asarray(f), "i": jnp.arange(4 * 3 * 2, dtype=jnp.int32).reshape(12, 2),
          "u": jnp.asarray(rng.integers(0, 2**32, (4 * 3,), dtype=np.uint32))}
  specs = {"f": P("tp"), "i": P("tp"), "u": P("tp")}

  def run(fn):
    sm = jax.shard_map(lambda t: fn(t, ("tp",)), mesh=m, in_specs=(specs,),
                       out_specs={"f": P(), "i": P(), "u": P()}, check_vma=check_vma)
    return jax.jit(sm)

  packed = run(fs_mesh.all_gather_tree)
  leafwise = run(lambda t, ax: jax.tree.map(lambda a: fs_mesh.all_gather_invariant(a, ax), t))
  got, want = packed(tree), leafwise(tree)
  for k in tree:
    assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape == (4, 3, *tree[k].shape[1:])
    np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint32),
                                  np.asarray(want[k]).view(np.uint32))
  hlo = packed.lower(tree).compile().as_text()
  assert len(re.findall(r"\sall-gather(?:-start)?\(", hlo)) == 1, hlo
