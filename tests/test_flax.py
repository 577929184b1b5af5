"""Flax heads (flashsample_jax.flax_heads) against the reference and the modules.

Exact inputs (tests/inputs.py) make every logit an exact small integer, so the
fused tokens must equal both the reference's and those of
``jax.random.categorical`` on what the Flax module itself computes, on 100%
of rows.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flashsample_jax as fs
from flashsample_jax import flax_heads
from tests import inputs

B, D, V = 12, 64, 1000


def _linear(weight_dv, *, bias=False, **kw):
  head = nnx.Linear(D, weight_dv.shape[1], use_bias=bias, param_dtype=weight_dv.dtype,
                    rngs=nnx.Rngs(0), **kw)
  head.kernel[...] = weight_dv
  return head


def _embed(weight_vd):
  embed = nnx.Embed(weight_vd.shape[0], D, param_dtype=weight_vd.dtype, rngs=nnx.Rngs(0))
  embed.embedding[...] = weight_vd
  return embed


def _module_tokens(logits, key, temperature):
  """``jax.random.categorical`` on a module's own logits (vmapped per-row keys)."""
  lt = logits.astype(jnp.float32) / temperature
  if key.ndim:
    return jax.vmap(jax.random.categorical)(key.reshape(-1), lt.reshape(-1, lt.shape[-1])
                                            ).reshape(lt.shape[:-1])
  return jax.random.categorical(key, lt)


def _keys():
  return [jax.random.key(7), inputs.row_keys(B, seed=7)]


def _assert_same(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == np.int32 and got.shape == want.shape
  mismatch = np.nonzero(got.reshape(-1) != want.reshape(-1))[0]
  assert mismatch.size == 0, f"{mismatch.size}/{want.size} rows differ"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nnx_linear(dtype):
  h, w = inputs.exact_inputs(B, D, V, layout="dv", dtype=dtype, seed=1)
  # bf16 logits of up to 9*D would round: ask the module for f32 output.
  head = _linear(w, preferred_element_type=jnp.float32)
  t = inputs.pow2_temperatures(B, seed=1)
  for key in _keys():
    got = flax_heads.sample_from_linear(head, h, key, temperature=t)
    _assert_same(got, fs.reference.sample(h, w, key, temperature=t, weight_layout="dv"))
    _assert_same(got, _module_tokens(head(h), key, t[:, None]))
  assert flax_heads.head_weight(head)[0] is head.kernel[...]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nnx_embed_tied(dtype):
  h, w = inputs.exact_inputs(B, D, V, layout="vd", dtype=dtype, seed=2)
  embed = _embed(w)
  for key in _keys():
    got = flax_heads.sample_from_embed(embed, h, key, temperature=0.5)
    _assert_same(got, fs.reference.sample(h, w, key, temperature=0.5))
    # attend() returns logits in the param dtype; exact in f32 only.
    if dtype == jnp.float32:
      _assert_same(got, _module_tokens(embed.attend(h), key, 0.5))
    _assert_same(got, _module_tokens(flax_heads.logits(embed, h), key, 0.5))


def test_linen_dense_and_embed_params():
  h, w_dv = inputs.exact_inputs(B, D, V, layout="dv", dtype=jnp.float32, seed=3)
  dense = nn.Dense(V, use_bias=False)
  variables = {"params": {"kernel": w_dv}}
  emb = nn.Embed(V, D)
  evars = {"params": {"embedding": w_dv.T}}
  for key in _keys():
    got = flax_heads.sample_from_params(variables, h, key, temperature=2.0)
    _assert_same(got, fs.reference.sample(h, w_dv, key, temperature=2.0, weight_layout="dv"))
    _assert_same(got, _module_tokens(dense.apply(variables, h), key, 2.0))
    # Unwrapped params and the tied embedding of the same matrix agree too.
    _assert_same(flax_heads.sample_from_params(variables["params"], h, key, temperature=2.0), got)
    got_e = flax_heads.sample_from_params(evars, h, key, temperature=2.0)
    _assert_same(got_e, got)
    _assert_same(got_e, _module_tokens(emb.apply(evars, h, method=emb.attend), key, 2.0))


def test_linen_boxed_params():
  h, w_dv = inputs.exact_inputs(B, D, V, layout="dv", seed=4)
  boxed = {"kernel": nn.Partitioned(w_dv, names=(None, "vocab"))}
  key = jax.random.key(4)
  _assert_same(flax_heads.sample_from_params(boxed, h, key),
               fs.reference.sample(h, w_dv, key, weight_layout="dv"))


def test_kwargs_pass_through():
  h, w = inputs.exact_inputs(B, D, V, layout="dv", seed=5)
  head = _linear(w)
  # Make the padding columns attractive: vocab_size must exclude them.
  head.kernel[...] = w.at[:, 900:].set(3)
  h = jnp.abs(h) + 1
  t = inputs.pow2_temperatures(B, greedy_every=3, seed=5)
  key = jax.random.key(5)
  got = flax_heads.sample_from_head(head, h, key, temperature=t, vocab_size=900,
                                    backend="xla")
  assert (np.asarray(got) < 900).all()
  _assert_same(got, fs.reference.sample(h, head.kernel[...], key, temperature=t,
                                        vocab_size=900, weight_layout="dv"))


def test_leading_dimensions_flatten_exactly():
  # [B, T, D] hidden states: categorical on [B, T, V] logits is the same draw.
  b, t = 3, 5
  h, w = inputs.exact_inputs(b * t, D, V, layout="dv", dtype=jnp.float32, seed=6)
  h = h.reshape(b, t, D)
  head = _linear(w)
  temp = jnp.asarray(inputs.pow2_temperatures(b * t, seed=6)).reshape(b, t)
  for key in (jax.random.key(6), jax.random.split(jax.random.key(6), (b, t))):
    got = flax_heads.sample_from_head(head, h, key, temperature=temp)
    assert got.shape == (b, t)
    _assert_same(got, _module_tokens(head(h), key, temp[..., None]))


def _flat_rows(a, lead, trailing=0):
  return a.reshape(int(np.prod(lead)), *a.shape[a.ndim - trailing:])


@pytest.mark.parametrize("key_kind", ["scalar", "typed", "raw"])
def test_leading_dimensions_for_every_argument_and_output(key_kind):
  # Issue #42: with hidden [b, t, D], SampleOutput has no reshape, S samples
  # could not be reshaped to (b, t), and controls shaped (b, t) were refused
  # with a [B] size the caller never passed. Every per-row argument may be
  # shaped like the leading dimensions; every output field comes back so,
  # the RL outputs (entropies, kept sets, raw log-probabilities) too.
  b, t, p = 2, 3, 4
  lead = (b, t)
  h, w = inputs.exact_inputs(b * t, D, V, layout="dv", dtype=jnp.float32, seed=30)
  head = _linear(w)
  r = np.random.default_rng(30)
  key = {"scalar": jax.random.key(30),
         "typed": jax.random.split(jax.random.key(30), lead),
         "raw": jax.random.key_data(jax.random.split(jax.random.key(30), lead))}[key_kind]
  words = -(-V // 32)
  per_row = dict(
      temperature=jnp.asarray(inputs.pow2_temperatures(b * t, greedy_every=4,
                                                       seed=30)).reshape(lead),
      top_k=jnp.asarray(r.integers(0, 50, lead), jnp.int32),
      top_p=jnp.asarray(r.choice([0.5, 0.9, 1.0], lead), jnp.float32),
      min_p=jnp.asarray(r.choice([0.0, 0.05], lead), jnp.float32),
      repetition_penalty=jnp.full(lead, 1.5, jnp.float32),
      presence_penalty=jnp.full(lead, 0.5, jnp.float32),
      frequency_penalty=jnp.full(lead, 0.25, jnp.float32),
      prompt_ids=jnp.asarray(r.integers(-1, V, (*lead, p)), jnp.int32),
      output_ids=jnp.asarray(r.integers(-1, V, (*lead, p)), jnp.int32),
      allowed_mask=jnp.asarray(r.integers(0, 2**32, (*lead, words), dtype=np.uint64)
                               .astype(np.uint32) | np.uint32(1)))
  flat = {k: _flat_rows(x, lead, 1 if k in ("prompt_ids", "output_ids",
                                            "allowed_mask") else 0)
          for k, x in per_row.items()}
  flat_key = key if key_kind == "scalar" else _flat_rows(key, lead, key.ndim - 2)
  # Every output option with one key kind; the others (which change only
  # how the key is flattened) with the fullest option. Jitted, as decoders
  # run it: op by op, each call took tens of seconds on the CPU.
  every = (dict(return_logprobs=True), dict(top_logprobs=3), dict(num_samples=2),
           dict(num_samples=2, return_entropy=True, return_kept=4, return_raw_logprobs=True))
  full = dict(num_samples=2, return_logprobs=True, top_logprobs=3)
  for opts in (every + (full,) if key_kind == "typed" else (full,)):
    run = jax.jit(lambda h3, k, rows, opts=opts: flax_heads.sample_from_head(
        head, h3, k, backend="xla", **rows, **opts))
    got = run(h.reshape(*lead, D), key, per_row)
    want = fs.reference.sample(h, w, flat_key, weight_layout="dv", **flat, **opts)
    if not isinstance(want, fs.SampleOutput):
      want = fs.SampleOutput(want, None, None, None)
      got = fs.SampleOutput(got, None, None, None)
    samples = (opts["num_samples"],) if "num_samples" in opts else ()
    for name, g, x in zip(want._fields, got, want):
      assert (g is None) == (x is None), name
      if x is None:
        continue
      if name in ("top_ids", "top_logprobs", "kept_ids"):       # lists per row
        shape = (*lead, x.shape[-1])
      elif name in ("entropy", "entropy_truncated", "kept_count"):  # one per row
        shape = lead
      else:
        shape = (*samples, *lead)
      assert g.shape == shape, (name, opts, g.shape)
      if name in ("logprob_raw", "entropy", "entropy_truncated"):   # cases.check_rl's bound
        np.testing.assert_allclose(g, x.reshape(shape), rtol=1e-5, atol=1e-5,
                                   err_msg=f"{name} {opts}")
      else:
        np.testing.assert_array_equal(g, x.reshape(shape), err_msg=f"{name} {opts}")


def test_leading_dimensions_mismatched_shapes_name_the_callers_shapes():
  h, w = inputs.exact_inputs(6, D, V, layout="dv", dtype=jnp.float32, seed=31)
  head, h3 = _linear(w), h.reshape(2, 3, D)
  key = jax.random.key(0)
  with pytest.raises(ValueError, match=r"top_p.shape=\(2,\) must be a scalar, "
                                       r"hidden.shape\[:-1\]=\(2, 3\) or the flattened "
                                       r"\[B\]=\(6,\)"):
    flax_heads.sample_from_head(head, h3, key, top_p=jnp.full((2,), 0.9))
  with pytest.raises(ValueError, match=r"prompt_ids.shape=\(3, 2, 4\) must be "
                                       r"\[\*hidden.shape\[:-1\], n\]=\(2, 3, n\)"):
    flax_heads.sample_from_head(head, h3, key, repetition_penalty=1.5,
                                prompt_ids=jnp.zeros((3, 2, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"key.shape=\(3, 2\) must be a scalar, "
                                       r"hidden.shape\[:-1\]=\(2, 3\)"):
    flax_heads.sample_from_head(head, h3, jax.random.split(key, (3, 2)))
  # Already-flattened per-row arguments are accepted as before.
  flat_t = inputs.pow2_temperatures(6, seed=31)
  _assert_same(flax_heads.sample_from_head(head, h3, jax.random.split(key, 6),
                                           temperature=flat_t),
               fs.reference.sample(h, w, jax.random.split(key, 6), temperature=flat_t,
                                   weight_layout="dv").reshape(2, 3))


def test_under_jit_in_a_decode_loop():
  # The helper inside an nnx.jit-ed step that takes the module as an argument.
  h0, w = inputs.exact_inputs(4, D, 256, layout="vd", dtype=jnp.float32, seed=8)
  embed = _embed(w)

  @nnx.jit
  def loop(embed, h0, key):
    def step(h, k):
      tok = flax_heads.sample_from_embed(embed, h, k, temperature=2.0)
      return embed(tok), tok
    return jax.lax.scan(step, h0, jax.random.split(key, 6))[1]

  @jax.jit
  def ref_loop(w, h0, key):
    def step(h, k):
      tok = jax.random.categorical(k, (h @ w.T) / 2.0)
      return w[tok], tok
    return jax.lax.scan(step, h0, jax.random.split(key, 6))[1]

  _assert_same(loop(embed, h0, jax.random.key(8)), ref_loop(w, h0, jax.random.key(8)))


def test_no_transpose_of_the_weight():
  # The [D, V] kernel must be read in place: no transpose (or copy) in the jaxpr.
  h, w = inputs.exact_inputs(4, D, V, layout="dv", seed=9)
  f = lambda w, h, k: flax_heads.sample_from_params({"kernel": w}, h, k, backend="xla")
  jaxpr = jax.make_jaxpr(f)(w, h, jax.random.key(0))

  text = str(jaxpr)  # includes the loop bodies' jaxprs
  assert "transpose" not in text
  assert "dot_general" in text


def _biased_head(bias_seed: int):
  """``(h, w, bias, head)``: exact inputs and an nnx.Linear head with an
  integer bias."""
  h, w = inputs.exact_inputs(B, D, V, layout="dv", seed=10)
  bias = jnp.asarray(np.random.default_rng(bias_seed).integers(-3, 4, V), jnp.bfloat16)
  head = _linear(w, bias=True)
  head.bias[...] = bias
  return h, w, bias, head


def test_head_bias_is_the_logit_bias():
  h, w, bias, head = _biased_head(10)
  key = jax.random.key(0)
  want = fs.reference.sample(h, w, key, weight_layout="dv",
                             logit_bias=bias.astype(jnp.float32))
  np.testing.assert_array_equal(flax_heads.sample_from_linear(head, h, key), want)
  # Integer logits and bias: the module's own output is exact too.
  np.testing.assert_array_equal(_module_tokens(head(h), key, 1.0), want)
  params = {"kernel": w, "bias": bias}
  np.testing.assert_array_equal(flax_heads.sample_from_params(params, h, key), want)
  # A caller's logit_bias adds to the head's.
  extra = jnp.ones((V,), jnp.float32)
  np.testing.assert_array_equal(
      flax_heads.sample_from_params(params, h, key, logit_bias=extra),
      fs.reference.sample(h, w, key, weight_layout="dv",
                          logit_bias=bias.astype(jnp.float32) + extra))
  # With vocab_size, the caller's [vocab_size] bias adds to the head's first ids.
  n = V - 24
  np.testing.assert_array_equal(
      flax_heads.sample_from_params(params, h, key, vocab_size=n, logit_bias=extra[:n]),
      fs.reference.sample(h, w, key, weight_layout="dv", vocab_size=n,
                          logit_bias=bias.astype(jnp.float32)[:n] + extra[:n]))
  # A caller's bias that would broadcast in the sum is refused by name (found
  # by review: a scalar or a [B, V] array passed as a new [V] bias).
  for bad, exc in ((jnp.float32(1.0), ValueError), (jnp.ones((B, V), jnp.float32), ValueError),
                   (jnp.ones((V + 1,), jnp.float32), ValueError), (1.0, TypeError),
                   (jnp.ones((V,), jnp.int32), TypeError)):
    with pytest.raises(exc, match="logit_bias"):
      flax_heads.sample_from_params(params, h, key, logit_bias=bad)


def test_params_work_as_the_keywords_do():
  # Found by review: with params, the head's bias went beside it as a
  # keyword (which sample refuses) and params' per-row fields kept the
  # leading dimensions' shape.
  h, w, bias, head = _biased_head(11)
  key = jax.random.key(0)
  lead = (2, B // 2)
  t = jnp.asarray(np.random.default_rng(12).choice([0.5, 1.0, 2.0], lead), jnp.float32)
  extra = jnp.ones((V,), jnp.float32)
  kw = dict(temperature=t, top_k=5, logit_bias=extra)
  want = flax_heads.sample_from_head(head, h.reshape(*lead, D), key, **kw)
  got = flax_heads.sample_from_head(head, h.reshape(*lead, D), key,
                                    params=fs.SamplingParams(**kw))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(
      want.reshape(-1), fs.reference.sample(h, w, key, weight_layout="dv", temperature=t.reshape(-1),
                                            top_k=5, logit_bias=bias.astype(jnp.float32) + extra))
  with pytest.raises(TypeError, match=r"got params and \['top_k'\]"):
    flax_heads.sample_from_head(head, h, key, params=fs.SamplingParams(), top_k=5)


def test_bad_arguments():
  h, w = inputs.exact_inputs(B, D, V, layout="dv", seed=11)
  head = _linear(w)
  key = jax.random.key(0)
  with pytest.raises(TypeError, match="weight_layout"):
    flax_heads.sample_from_head(head, h, key, weight_layout="vd")
  with pytest.raises(TypeError, match="nnx.Linear"):
    flax_heads.sample_from_head(object(), h, key)
  with pytest.raises(TypeError, match="nnx.Embed"):
    flax_heads.sample_from_embed(head, h, key)
  with pytest.raises(TypeError, match="nnx.Linear"):
    flax_heads.sample_from_linear(_embed(w.T), h, key)
  with pytest.raises(ValueError, match="must be exactly"):
    flax_heads.sample_from_params({"kernel": w, "embedding": w.T}, h, key)
  with pytest.raises(ValueError, match="must be exactly"):
    flax_heads.sample_from_params({"scale": w}, h, key)
  with pytest.raises(ValueError):  # D mismatch, reported by sample()
    flax_heads.sample_from_head(head, h[:, :32], key)
  with pytest.raises(ValueError, match=r"\[B, D\]"):
    flax_heads.sample_from_head(head, h[0], key)
  # logits() takes what sample_from_head takes; a QuantizedHead names its layout.
  with pytest.raises(TypeError, match=r"hidden.dtype=int32 must be a float dtype"):
    flax_heads.logits(head, h.astype(jnp.int32))
  with pytest.raises(ValueError, match=rf"hidden.shape=\({B}, 32\) must end in the head's D={D}"):
    flax_heads.logits(head, h[:, :32])
  q = flax_heads.quantize_head(head, "int8", layout="dv")
  with pytest.raises(ValueError, match=r"layout='xx' must be one of"):
    flax_heads.QuantizedHead(q.weight, q.scale, None, "xx")
  # A hand-built QuantizedHead (one restored from a checkpoint) is checked as
  # sample checks it, by logits() too (found by review: logits() returned
  # logits for heads sampling refuses, and a bad bias was named logit_bias).
  QH = flax_heads.QuantizedHead
  for bad, exc, match in (
      (QH(q.weight, q.scale, jnp.zeros(5), "dv"), ValueError, r"the head's bias has shape \(5,\)"),
      (QH(q.weight, None, None, "dv"), TypeError, "needs weight_scale"),
      (QH(q.weight, q.scale[:, None], None, "dv"), ValueError, r"weight_scale.shape=\(1000, 1\)"),
      (QH(q.weight, q.scale.astype(jnp.float16), None, "dv"), TypeError, "must be float32"),
      (QH(q.weight.astype(jnp.bfloat16), q.scale, None, "dv"), TypeError,
       "weight_scale is for quantized weights"),
      # found by review: logits() indexed a 1-D weight's shape (IndexError).
      (QH(q.weight[0], q.scale, None, "dv"), ValueError, r"weight must be 2-D")):
    for f in (lambda: flax_heads.logits(bad, h), lambda: flax_heads.sample_from_head(bad, h, key)):
      with pytest.raises(exc, match=match):
        f()
  # An 8-bit stored parameter: its scales are elsewhere, so it is refused
  # with a pointer to QuantizedHead, not sampled or quantized again.
  for helper in (lambda p: flax_heads.sample_from_params(p, h, key),
                 lambda p: flax_heads.logits(p, h), flax_heads.quantize_head):
    with pytest.raises(TypeError, match=r"stored parameter is int8.*QuantizedHead"):
      helper({"kernel": q.weight})


# -- Heads whose logits are not hidden @ the stored parameter: refused --------
#
# Sampling from the stored kernel of such a head draws from another
# distribution, silently. Each helper must refuse them with an error that
# names the problem and says what to do.

def _every_helper(head, h, key):
  """Calls every public helper that reads a head; each must raise."""
  yield lambda: flax_heads.sample_from_head(head, h, key)
  yield lambda: flax_heads.head_weight(head)
  yield lambda: flax_heads.head_bias(head)
  yield lambda: flax_heads.logits(head, h)
  if isinstance(head, nnx.Linear):
    yield lambda: flax_heads.sample_from_linear(head, h, key)
  if isinstance(head, nnx.Embed):
    yield lambda: flax_heads.sample_from_embed(head, h, key)
  if isinstance(head, dict):
    yield lambda: flax_heads.sample_from_params(head, h, key)


def _assert_every_helper_raises(head, h, key, error, match):
  for call in _every_helper(head, h, key):
    with pytest.raises(error, match=match):
      call()


def test_lora_linear_is_refused_and_the_merged_weight_is_exact():
  # The case: nnx.LoRALinear with a nonzero lora_b. Its logits are
  # kernel + lora_a @ lora_b, so sampling from the kernel alone is wrong.
  d, v, rank = 16, 300, 2
  r = np.random.default_rng(20)
  h = jnp.asarray(r.integers(-3, 4, (B, d)), jnp.float32)
  lora = nnx.LoRALinear(d, v, lora_rank=rank, use_bias=False, rngs=nnx.Rngs(0))
  lora.kernel[...] = jnp.asarray(r.integers(-3, 4, (d, v)), jnp.float32)
  lora.lora.lora_a[...] = jnp.asarray(r.integers(-2, 3, (d, rank)), jnp.float32)
  lora.lora.lora_b[...] = jnp.asarray(r.integers(-2, 3, (rank, v)), jnp.float32)
  key = jax.random.key(20)
  want = _module_tokens(lora(h), key, 1.0)
  kernel_only = fs.reference.sample(h, lora.kernel[...], key, weight_layout="dv")
  assert (np.asarray(kernel_only) != np.asarray(want)).any()  # the hazard is real
  _assert_every_helper_raises(lora, h, key, TypeError,
                              r"LoRALinear.*subclass of nnx\.Linear.*lora_a @ lora_b")
  # Also its nnx.state, which is a Mapping holding 'kernel' (and 'lora').
  _assert_every_helper_raises(dict(nnx.state(lora)), h, key, ValueError,
                              r"got keys \['kernel', 'lora'\].*lora_a @ lora_b")
  # The advice in the message is exact: integer weights make every sum exact.
  merged = lora.kernel[...] + lora.lora.lora_a[...] @ lora.lora.lora_b[...]
  _assert_same(fs.sample(h, merged, key, weight_layout="dv"), want)


def test_module_subclasses_are_refused():
  h, w = inputs.exact_inputs(B, D, V, layout="dv", dtype=jnp.float32, seed=21)
  key = jax.random.key(21)

  class ScaledLinear(nnx.Linear):
    def __call__(self, x):
      return 2 * super().__call__(x)

  class PlainSubclass(nnx.Linear):
    pass  # refused too: the check is on the class, not on what it overrides

  class ScaledEmbed(nnx.Embed):
    def attend(self, query):
      return 2 * super().attend(query)

  for cls in (ScaledLinear, PlainSubclass):
    head = cls(D, V, use_bias=False, rngs=nnx.Rngs(0))
    head.kernel[...] = w
    _assert_every_helper_raises(head, h, key, TypeError,
                                rf"{cls.__name__}, a subclass of nnx\.Linear")
  embed = ScaledEmbed(V, D, rngs=nnx.Rngs(0))
  embed.embedding[...] = w.T
  _assert_every_helper_raises(embed, h, key, TypeError,
                              r"ScaledEmbed, a subclass of nnx\.Embed")


def test_custom_products_are_refused():
  h, w = inputs.exact_inputs(B, D, V, layout="dv", dtype=jnp.float32, seed=22)
  key = jax.random.key(22)

  def doubled_dot(*args, **kwargs):  # e.g. a quantized or rescaled product
    return 2 * jax.lax.dot_general(*args, **kwargs)

  def identity_promote(arrays, dtype=None, inexact=True):
    return arrays

  head = _linear(w, dot_general=doubled_dot)
  _assert_every_helper_raises(head, h, key, ValueError, r"head\.dot_general=.*not Flax's default")
  head = _linear(w, promote_dtype=identity_promote)
  _assert_every_helper_raises(head, h, key, ValueError, r"head\.promote_dtype=")
  embed = nnx.Embed(V, D, promote_dtype=identity_promote, rngs=nnx.Rngs(0))
  _assert_every_helper_raises(embed, h, key, ValueError, r"head\.promote_dtype=")


def test_precision_is_accepted():
  # precision only changes how the same product rounds; with exact inputs the
  # module's own tokens and the helper's agree.
  h, w = inputs.exact_inputs(B, D, V, layout="dv", dtype=jnp.float32, seed=23)
  head = _linear(w, precision=jax.lax.Precision.HIGHEST)
  key = jax.random.key(23)
  _assert_same(flax_heads.sample_from_head(head, h, key), _module_tokens(head(h), key, 1.0))


@pytest.mark.parametrize("params,keys", [
    ({"kernel": 0, "lora_a": 0, "lora_b": 0}, "['kernel', 'lora_a', 'lora_b']"),
    ({"kernel": 0, "kernel_scale": 0}, "['kernel', 'kernel_scale']"),
    ({"embedding": 0, "bias": 0}, "['bias', 'embedding']"),
    ({"params": {"kernel": 0}, "lora": {"a": 0}}, "['lora', 'params']"),
])
def test_linen_params_with_other_keys_are_refused(params, keys):
  h, w = inputs.exact_inputs(B, D, V, layout="dv", dtype=jnp.float32, seed=24)
  arrays = {"kernel": w, "embedding": w.T, "bias": jnp.zeros((V,))}
  fill = lambda d: {k: fill(x) if isinstance(x, dict) else arrays.get(k, w)
                    for k, x in d.items()}
  _assert_every_helper_raises(fill(params), h, jax.random.key(0), ValueError,
                              f"got keys {re.escape(keys)}")


def test_bias_of_the_wrong_shape_is_refused():
  h, w = inputs.exact_inputs(B, D, V, layout="dv", dtype=jnp.float32, seed=25)
  params = {"kernel": w, "bias": jnp.zeros((V - 1,))}
  _assert_every_helper_raises(params, h, jax.random.key(0), ValueError,
                              r"bias has shape \(999,\).*\[V\]=\(1000,\)")


# -- quantized heads: quantize_head, then sample_from_head --------------------


@pytest.mark.parametrize("dtype", ["fp8", "float8_e5m2", "int8"])
def test_quantized_head_in_two_lines(dtype):
  h, w = inputs.exact_inputs(B, D, V, layout="dv", dtype=jnp.float32, seed=11)
  head = _linear(w.astype(jnp.bfloat16), bias=True, preferred_element_type=jnp.float32)
  head.bias[...] = jnp.asarray(np.arange(V) % 5, jnp.bfloat16)
  qhead = flax_heads.quantize_head(head, dtype)
  name = fs.quantize._dtype_name(dtype)
  # Stored [V, D] by default (the kernels' register path), the same values
  # and scales as in the original's [D, V] layout.
  as_stored = flax_heads.quantize_head(head, dtype, layout="dv")
  assert qhead.layout == "vd" and qhead.weight.shape == w.T.shape
  assert as_stored.layout == "dv" and as_stored.weight.shape == w.shape
  np.testing.assert_array_equal(np.asarray(qhead.weight.T.astype(jnp.float32)),
                                np.asarray(as_stored.weight.astype(jnp.float32)))
  np.testing.assert_array_equal(qhead.scale, as_stored.scale)
  with pytest.raises(ValueError, match=r"layout='VD' must be one of"):
    flax_heads.quantize_head(head, dtype, layout="VD")
  assert qhead.weight.dtype == jnp.dtype(fs.quantize.QUANT_DTYPES[name][0])
  # The materialized logits are the definition written out, and close to
  # the float head's (the quantization error, not the sampling's).
  l = flax_heads.logits(qhead, h)
  want = jnp.dot(h.astype(jnp.bfloat16), as_stored.weight.astype(jnp.bfloat16),
                 preferred_element_type=jnp.float32) * qhead.scale + qhead.bias
  np.testing.assert_array_equal(l, want)
  np.testing.assert_array_equal(flax_heads.logits(as_stored, h), want)
  step = {"int8": 0.5 / 127, "float8_e5m2": 2**-3, "float8_e4m3fn": 2**-4}[name]
  bound = step * 3 * np.abs(np.asarray(h)).sum(axis=1, keepdims=True) + 1e-3
  assert np.all(np.abs(np.asarray(l) - np.asarray(head(h))) <= bound)
  t = inputs.pow2_temperatures(B, seed=11)
  for key in _keys():
    got = flax_heads.sample_from_head(qhead, h, key, temperature=t, top_k=40)
    _assert_same(got, fs.reference.sample(h, qhead.weight, key, temperature=t, top_k=40,
                                          weight_layout="vd", weight_scale=qhead.scale,
                                          logit_bias=qhead.bias))
    _assert_same(got, flax_heads.sample_from_head(as_stored, h, key, temperature=t, top_k=40))
    _assert_same(got, fs.reference.sample_logits(l, key, temperature=t, top_k=40))
  with pytest.raises(TypeError, match="weight_scale is set by the head"):
    flax_heads.sample_from_head(qhead, h, jax.random.key(0), weight_scale=qhead.scale)
  # A pytree: it passes through jit.
  f = jax.jit(lambda q, h: flax_heads.sample_from_head(q, h, jax.random.key(1)))
  _assert_same(f(qhead, h), flax_heads.sample_from_head(qhead, h, jax.random.key(1)))
