"""A Llama/Qwen3-style decoder in Flax nnx, for decoding examples and benchmarks.

RMSNorm, RoPE, grouped-query attention with per-head q/k RMSNorm (Qwen3) and a
KV cache, SwiGLU MLP; randomly initialised (the weights' values do not matter
for timing, their sizes do). The LM head is either the tied ``nnx.Embed``
(Qwen3-1.7B, ``weight_layout`` "vd") or an ``nnx.Linear`` without bias
(Qwen3-8B, "dv"); the fused sampler reads either in place through
:mod:`flashsample_jax.flax_heads`.

Written to be a fair host for a sampler on a GPU: at B = 1 a decode step
should cost little more than reading its weights once (``weight_read_floor_ms``;
examples/decode.py --floor prints the ratio). The previous version of this
file ran several times slower than that (issue 22); reading its code, the
likely causes and what replaced them:

* Layers are an unrolled Python loop over separate per-layer arrays, not a
  ``lax.scan`` over ``[L, ...]``-stacked ones. Inside XLA's while loop a
  layer's weight is a dynamic slice of the stack, which the GPU backend may
  copy into a fresh buffer before a cuBLAS matmul (the weights then cross
  memory three times), and the loop body's kernels are launched from the host
  one iteration at a time. Unrolled, every matmul reads its weight where it
  lies and the whole step can run as CUDA graphs. XLA reuses the kernels of
  identical layers, so a 36-layer step still compiles in seconds.
* One fused QKV projection and one fused gate/up projection per layer (one
  weight stream and one launch each, as vLLM and MaxText's fused options do).
* The KV cache is one ``[B, S, K, E]`` pair per layer, donated to the step and
  updated in place with ``dynamic_update_slice``; attention reads it as is
  (no per-layer slice of a stacked cache).
* Attention is ``jax.nn.dot_product_attention``: "xla" (default: GQA heads
  share their K/V read) or "cudnn" (cuDNN flash attention). RoPE tables are
  made once per step, not once per layer.
* Decode steps take the weights as a flat list of arrays, so dispatching a
  step does not walk the nnx state in Python.

Letters: ``B`` batch, ``T`` new tokens in a forward pass, ``S`` cache length,
``D`` hidden, ``H``/``K`` query/KV heads, ``E`` head dim, ``F`` MLP width,
``V`` vocabulary, ``L`` layers, ``N`` decoded tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from flashsample_jax import flax_heads

Sampler = Literal["fused", "xla"]
SAMPLERS: tuple[str, ...] = get_args(Sampler)
Attention = Literal["xla", "cudnn"]
ATTENTIONS: tuple[str, ...] = get_args(Attention)


@dataclasses.dataclass(frozen=True)
class Config:
  name: str
  vocab: int  # V
  dim: int  # D
  layers: int  # L
  heads: int  # H
  kv_heads: int  # K
  head_dim: int  # E
  ffn: int  # F
  tied: bool  # LM head = the input embedding (weight_layout "vd")
  rope_theta: float = 1e6
  eps: float = 1e-6
  dtype: str = "bfloat16"

  def __post_init__(self):
    if self.heads % self.kv_heads:
      raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")

  @property
  def layer_params(self) -> int:
    attn = self.dim * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + 2 * self.head_dim
    return attn + 3 * self.dim * self.ffn + 2 * self.dim

  @property
  def params(self) -> int:
    """Parameter count, as the model cards give it."""
    head = 0 if self.tied else self.vocab * self.dim
    return self.layers * self.layer_params + self.vocab * self.dim + head + self.dim

  def step_weight_bytes(self, vocab_shards: int = 1) -> int:
    """Bytes of weights one decode step must read on one device.

    Every layer, the final norm and the LM head (``1 / vocab_shards`` of it
    when the head is sharded over the vocabulary). The input embedding of an
    untied model is not counted: a step gathers only ``B`` of its rows.
    """
    if vocab_shards < 1 or self.vocab % vocab_shards:
      raise ValueError(f"{vocab_shards=} must be >= 1 and divide V={self.vocab}")
    head = self.vocab * self.dim // vocab_shards
    n = self.layers * self.layer_params + self.dim + head
    return n * jnp.dtype(self.dtype).itemsize


# Sizes from the models' Hugging Face config.json files.
CONFIGS = {
    "tiny": Config("tiny", vocab=4096, dim=128, layers=2, heads=4, kv_heads=2,
                   head_dim=32, ffn=384, tied=True),
    "tiny-untied": Config("tiny-untied", vocab=3001, dim=128, layers=2, heads=4,
                          kv_heads=2, head_dim=32, ffn=384, tied=False),
    "qwen3-1.7b": Config("qwen3-1.7b", vocab=151936, dim=2048, layers=28, heads=16,
                         kv_heads=8, head_dim=128, ffn=6144, tied=True),
    "qwen3-8b": Config("qwen3-8b", vocab=151936, dim=4096, layers=36, heads=32,
                       kv_heads=8, head_dim=128, ffn=12288, tied=False),
    # Qwen2.5-32B's layer and head (Qwen3-32B has V 151936) with 4 of its 64
    # layers: the LM head is a large share of the step, which is what the
    # vocabulary-parallel run (benchmarks/bench_tp_e2e.py) is about.
    "32b-4l": Config("32b-4l", vocab=152064, dim=5120, layers=4, heads=40,
                     kv_heads=8, head_dim=128, ffn=27648, tied=False),
    # The same layout, small enough for a CPU; V divisible by 8 shards.
    "tiny-tp": Config("tiny-tp", vocab=2048, dim=128, layers=2, heads=4,
                      kv_heads=2, head_dim=32, ffn=384, tied=False),
}


# -- generation configs -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """What a serving stack is asked to sample with. Off: top_k 0, top_p 1, min_p 0.

  Applied in Hugging Face's order (temperature, then top-k, top-p, min-p on
  the tempered logits), the order :func:`flashsample_jax.sample` implements.
  ``temperature`` 0 is greedy (the other controls then do not matter).
  """
  name: str
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
    if not (math.isfinite(t) and t >= 0):
      raise ValueError(f"temperature={t!r} must be finite and >= 0 (0 means greedy)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise ValueError(f"top_k={k!r} must be an int >= 0 (0 = off)")
    if not 0 < p <= 1:
      raise ValueError(f"top_p={p!r} must be in (0, 1] (1 = off)")
    if not 0 <= m <= 1:
      raise ValueError(f"min_p={m!r} must be in [0, 1] (0 = off)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def fused_kwargs(self) -> dict:
    """Keyword arguments of :func:`flashsample_jax.sample`; controls that are
    off are not passed, so plain sampling takes the package's plain path."""
    kw = {"temperature": self.temperature}
    if not self.greedy:
      if self.top_k:
        kw["top_k"] = self.top_k
      if self.top_p < 1:
        kw["top_p"] = self.top_p
      if self.min_p > 0:
        kw["min_p"] = self.min_p
    return kw

  @property
  def baseline_noise_is_reference(self) -> bool:
    """Whether :func:`baseline_tokens` draws the same Gumbel noise as
    ``jax.random.categorical`` on the full ``[B, V]`` logits (then it returns
    the fused sampler's tokens up to near-ties). Top-k baselines draw theirs
    over the ``k`` candidates only, as MaxText and T5X do."""
    return self.greedy or not self.top_k

  def describe_baseline(self) -> str:
    if self.greedy:
      return "argmax of the f32 logits"
    if self.top_k:
      return ("f32 logits, lax.top_k, top-p on the k candidates, categorical over "
              "the candidates (MaxText / T5X)")
    if self.top_p < 1:
      return "f32 logits, full sort for the top-p cutoff, categorical (MaxText nucleus)"
    if self.min_p > 0:
      return "f32 logits, min-p mask, categorical"
    return "f32 logits, jax.random.categorical"


# Recommended settings from the models' generation_config.json files.
GENERATION_CONFIGS = {
    "plain": GenerationConfig("plain", temperature=1.0),
    "greedy": GenerationConfig("greedy", temperature=0.0),
    "qwen3": GenerationConfig("qwen3", temperature=0.6, top_k=20, top_p=0.95),
    "llama3": GenerationConfig("llama3", temperature=0.6, top_p=0.9),
    "min-p": GenerationConfig("min-p", temperature=1.0, min_p=0.1),
}


def generation_config(g: GenerationConfig | str) -> GenerationConfig:
  """A :class:`GenerationConfig`, or the named one of :data:`GENERATION_CONFIGS`."""
  if isinstance(g, GenerationConfig):
    return g
  if g not in GENERATION_CONFIGS:
    raise ValueError(f"generation config {g!r} must be one of {sorted(GENERATION_CONFIGS)}")
  return GENERATION_CONFIGS[g]


def _temper(logits, gen: GenerationConfig):
  # Dividing by 1 is exact; skipping it keeps the plain baseline the plain
  # one-liner people write.
  return logits if gen.temperature == 1 else logits / jnp.float32(gen.temperature)


def baseline_tokens(logits, key, gen: GenerationConfig, *, noise: str = "baseline"):
  """Tokens ``[B]`` from materialized f32 ``logits [B, V]``, written the way
  JAX codebases write each control (see :meth:`GenerationConfig.describe_baseline`).

  ``noise="baseline"`` is the timed version. ``noise="reference"`` keeps the
  same kept set but draws with ``jax.random.categorical`` over the full
  ``[B, V]`` (what :func:`flashsample_jax.sample` matches): for top-k configs
  that is how to check that the fused sampler keeps what the baseline keeps.
  Top-p is applied to the tempered probabilities (Hugging Face's order, the
  package's); MaxText applies its temperature after the cutoff.
  """
  if noise not in ("baseline", "reference"):
    raise ValueError(f"{noise=} must be 'baseline' or 'reference'")
  if gen.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  t = _temper(logits, gen)
  if gen.top_k:
    vals, ids = jax.lax.top_k(t, gen.top_k)  # [B, k], sorted descending
    if gen.top_p < 1:
      q = jax.nn.softmax(vals, axis=-1)
      vals = jnp.where(jnp.cumsum(q, axis=-1) - q < gen.top_p, vals, -jnp.inf)
    if gen.min_p > 0:
      vals = jnp.where(jnp.exp(vals - vals[:, :1]) >= gen.min_p, vals, -jnp.inf)
    if noise == "baseline":
      pick = jax.random.categorical(key, vals)
      return jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0].astype(jnp.int32)
    rows = jnp.arange(t.shape[0])[:, None]
    full = jnp.full(t.shape, -jnp.inf, t.dtype).at[rows, ids].set(vals)
    return jax.random.categorical(key, full).astype(jnp.int32)
  if gen.top_p < 1:
    # MaxText's sample_nucleus_topp_logits: the cutoff from a full sort, then
    # mask the unsorted logits (ties at the cutoff are kept).
    srt = jnp.sort(t, axis=-1)[..., ::-1]
    cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
    cut = jnp.minimum(jnp.sum(cum < gen.top_p, axis=-1, keepdims=True), t.shape[-1] - 1)
    t = jnp.where(t < jnp.take_along_axis(srt, cut, axis=-1), -jnp.inf, t)
  if gen.min_p > 0:
    # p / p_max = exp(t - t_max): Hugging Face's MinPLogitsWarper without the
    # softmax's normalizing sum, which cancels.
    t = jnp.where(jnp.exp(t - jnp.max(t, axis=-1, keepdims=True)) >= gen.min_p, t, -jnp.inf)
  return jax.random.categorical(key, t).astype(jnp.int32)


# -- the model ----------------------------------------------------------------

class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions, head_dim: int, theta: float):
  """``(cos, sin)``, each f32 ``[T, E/2]``, for ``positions [T]``."""
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  ang = positions.astype(jnp.float32)[:, None] * inv_freq
  return jnp.cos(ang), jnp.sin(ang)


def rope(x, cos, sin):
  """Rotary embedding (rotate-half form) of ``x [B, T, *, E]``."""
  cos, sin = cos[None, :, None, :], sin[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def check_attention(attention: str) -> None:
  """Raises ``ValueError`` unless ``attention`` is one of :data:`ATTENTIONS`,
  and ``NotImplementedError`` (saying why) where it cannot run on the default
  device: "cudnn" is cuDNN's flash attention, for NVIDIA GPUs only (on a GPU
  without cuDNN, or with shapes cuDNN declines, jax raises at trace time)."""
  if attention not in ATTENTIONS:
    raise ValueError(f"{attention=} must be one of {ATTENTIONS}")
  if attention == "cudnn" and jax.default_backend() != "gpu":
    raise NotImplementedError(
        "cuDNN attention needs an NVIDIA GPU with cuDNN; the default device is a "
        f"{jax.default_backend()} (use --attention xla)")


def attend(q, k_cache, v_cache, pos, implementation: str = "xla"):
  """Causal GQA over the cache with ``jax.nn.dot_product_attention``.

  Args:
    q: ``[B, T, H, E]`` queries of positions ``pos .. pos + T - 1``.
    k_cache, v_cache: ``[B, S, K, E]``, already holding this step's keys.
    pos: int32 scalar, the first query's position.
    implementation: "xla" or "cudnn" for one-token decode steps; a prompt
      (T > 1) always takes "xla" with an explicit mask, since cuDNN's causal
      mask assumes the queries start at position 0 of the keys.

  Returns:
    ``[B, T, H, E]``.
  """
  b, t = q.shape[:2]
  if t == 1:
    lengths = jnp.broadcast_to(jnp.asarray(pos + 1, jnp.int32), (b,))
    return jax.nn.dot_product_attention(q, k_cache, v_cache, key_value_seq_lengths=lengths,
                                        implementation=implementation)
  s = k_cache.shape[1]
  visible = jnp.arange(s)[None, :] <= (pos + jnp.arange(t))[:, None]  # [T, S]
  return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=visible[None, None],
                                      implementation="xla")


class Block(nnx.Module):
  """Pre-norm attention + SwiGLU MLP block (Qwen3: q/k RMSNorm per head)."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    lin = functools.partial(nnx.Linear, use_bias=False, param_dtype=dt, rngs=rngs)
    d, e = cfg.dim, cfg.head_dim
    self.attn_norm = RMSNorm(d, cfg.eps, dt)
    self.qkv_proj = lin(d, (cfg.heads + 2 * cfg.kv_heads) * e)
    self.o_proj = lin(cfg.heads * e, d)
    self.q_norm = RMSNorm(e, cfg.eps, dt)
    self.k_norm = RMSNorm(e, cfg.eps, dt)
    self.mlp_norm = RMSNorm(d, cfg.eps, dt)
    self.gate_up = lin(d, 2 * cfg.ffn)
    self.down = lin(cfg.ffn, d)
    self.cfg = cfg

  def __call__(self, x, kv, pos, cos, sin, attention: str):
    """``x [B, T, D]`` at positions ``pos ..``; ``kv`` this layer's cache pair."""
    cfg = self.cfg
    b, t, _ = x.shape
    h, k_, e = cfg.heads, cfg.kv_heads, cfg.head_dim
    q, k, v = jnp.split(self.qkv_proj(self.attn_norm(x)), [h * e, (h + k_) * e], axis=-1)
    q = rope(self.q_norm(q.reshape(b, t, h, e)), cos, sin)
    k = rope(self.k_norm(k.reshape(b, t, k_, e)), cos, sin)
    kc, vc = kv
    zero = jnp.zeros((), jnp.int32)
    at = (zero, jnp.asarray(pos, jnp.int32), zero, zero)
    kc = jax.lax.dynamic_update_slice(kc, k.astype(kc.dtype), at)
    vc = jax.lax.dynamic_update_slice(vc, v.reshape(b, t, k_, e).astype(vc.dtype), at)
    out = attend(q, kc, vc, pos, attention).reshape(b, t, h * e)
    x = x + self.o_proj(out)
    gate, up = jnp.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)
    return x + self.down(jax.nn.silu(gate) * up), (kc, vc)


class Decoder(nnx.Module):

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab, cfg.dim, param_dtype=dt, rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
    self.norm = RMSNorm(cfg.dim, cfg.eps, dt)
    self.lm_head = (None if cfg.tied else
                    nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, param_dtype=dt, rngs=rngs))

  @property
  def head(self):
    """The LM head module: the tied ``nnx.Embed`` or the ``nnx.Linear``."""
    return self.embed if self.cfg.tied else self.lm_head

  def __call__(self, tokens, cache, pos, *, attention: str = "xla"):
    """Runs ``tokens [B, T]`` at positions ``pos ..``, updating the cache.

    Args:
      tokens: int32 ``[B, T]``.
      cache: ``L`` pairs ``(k, v)``, each ``[B, S, K, E]`` (:func:`empty_cache`).
      pos: int32 scalar.
      attention: "xla" or "cudnn", see :func:`attend`.

    Returns:
      (final-normed hidden ``[B, T, D]``, the updated cache).
    """
    if attention not in ATTENTIONS:
      raise ValueError(f"{attention=} must be one of {ATTENTIONS}")
    if len(cache) != self.cfg.layers:
      raise ValueError(f"cache has {len(cache)} (k, v) pairs; the model has "
                       f"{self.cfg.layers} layers (see empty_cache)")
    x = self.embed(tokens)
    cos, sin = rope_tables(pos + jnp.arange(tokens.shape[1]), self.cfg.head_dim,
                           self.cfg.rope_theta)
    new_cache = []
    for layer, kv in zip(self.layers, cache):
      x, kv = layer(x, kv, pos, cos, sin, attention)
      new_cache.append(kv)
    return self.norm(x), new_cache


def init(cfg: Config, seed: int = 0, logit_std: float | None = None):
  """Random weights made directly on the default device, in one program.

  Args:
    logit_std: if given, the final norm's gain is set so that the logits'
      standard deviation over the vocabulary is about this (the head's
      weights' std x sqrt(D) x gain, the normed hidden state having unit
      RMS). Random weights give about 1: distributions far flatter than a
      trained model's, where top-p alone or min-p keep thousands of ids. None
      keeps the gain at 1.

  Returns:
    ``(graphdef, state)`` of a :class:`Decoder`.
  """
  if logit_std is not None and not (math.isfinite(logit_std) and logit_std > 0):
    raise ValueError(f"logit_std={logit_std!r} must be a finite number > 0 (or None)")

  def make():
    model = Decoder(cfg, nnx.Rngs(seed))
    if logit_std is not None:
      w = model.head.embedding if cfg.tied else model.head.kernel
      spread = jnp.std(w[...].astype(jnp.float32)) * math.sqrt(cfg.dim)
      gain = jnp.float32(logit_std) / spread
      model.norm.weight.value = jnp.full((cfg.dim,), gain, model.norm.weight.dtype)
    return nnx.state(model)

  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(seed))))
  state = jax.jit(make)()
  return graphdef, state


def empty_cache(cfg: Config, batch: int, length: int, sharding=None):
  """``L`` pairs of zero ``[B, S, K, E]`` arrays (``S = length``), made on the
  device (with ``sharding`` if given)."""
  return _zeros_fn(cfg, batch, length, sharding)()


@functools.lru_cache(maxsize=None)
def _zeros_fn(cfg: Config, batch: int, length: int, sharding):
  shape = (batch, length, cfg.kv_heads, cfg.head_dim)

  def make():
    return [(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
            for _ in range(cfg.layers)]
  return jax.jit(make) if sharding is None else jax.jit(make, out_shardings=sharding)


def weight_read_floor_ms(cfg: Config, bandwidth_Bps: float, vocab_shards: int = 1) -> float:
  """A decode step's lower bound: its weights (:meth:`Config.step_weight_bytes`)
  read once at ``bandwidth_Bps``."""
  if not bandwidth_Bps > 0:
    raise ValueError(f"{bandwidth_Bps=} must be > 0")
  return 1e3 * cfg.step_weight_bytes(vocab_shards) / bandwidth_Bps


# -- sampling and the decode loop ---------------------------------------------

def next_token(model: Decoder, hidden, key, generation, sampler: str,
               backend: str = "auto", vocab_axis: str | None = None):
  """One token per row from ``head(hidden)`` under ``generation``.

  "fused": :func:`flashsample_jax.sample` (``backend``) on the head as
  stored, never writing the ``[B, V]`` logits. "xla": materialize the f32
  logits, then :func:`baseline_tokens`. With ``vocab_axis`` (inside a
  ``shard_map`` whose head is this device's vocabulary slice), "fused" passes
  it to the package and "xla" all-gathers the logits over it first.
  """
  gen = generation_config(generation)
  if sampler == "fused":
    return flax_heads.sample_from_head(model.head, hidden, key, backend=backend,
                                       vocab_axis=vocab_axis, **gen.fused_kwargs())
  if sampler == "xla":
    logits = flax_heads.logits(model.head, hidden)
    if vocab_axis is not None:
      logits = jax.lax.all_gather(logits, vocab_axis, axis=1, tiled=True)
    return baseline_tokens(logits, key, gen)
  raise ValueError(f"{sampler=} must be one of {SAMPLERS}")


def step_key(seed: int, pos):
  """The sampling key of the token at ``pos`` in a run with ``seed``."""
  return jax.random.fold_in(jax.random.key(seed), pos)


VOCAB_AXIS = "tp"


def head_sharded_specs(cfg: Config, state):
  """PartitionSpecs of ``state``'s leaves: the LM head split over the vocabulary
  on mesh axis :data:`VOCAB_AXIS`, everything else replicated."""
  if cfg.tied:
    raise ValueError(
        f"config {cfg.name!r} has a tied head: a vocabulary-sharded head needs an "
        "untied nnx.Linear head (the embedding lookup would need the whole table)")
  specs = []
  for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    specs.append(P(None, VOCAB_AXIS) if names[:2] == ["lm_head", "kernel"] else P())
  if sum(s != P() for s in specs) != 1:
    raise ValueError("could not find the lm_head kernel in the model state")
  return tuple(specs)


def place_state(cfg: Config, state, mesh):
  """``state`` on ``mesh``: the LM head split over the vocabulary, the rest
  replicated (:func:`head_sharded_specs`). Do it once per model: a
  :class:`Decoding` then finds its weights in place."""
  leaves, treedef = jax.tree.flatten(state)
  specs = head_sharded_specs(cfg, state)
  return jax.tree.unflatten(treedef, jax.device_put(
      leaves, [NamedSharding(mesh, s) for s in specs]))


def _donate_cache(fn):
  return jax.jit(fn, donate_argnums=(2,))


class _Programs:
  """The jitted prefill and step of one model, built once and shared."""

  def __init__(self, graphdef, treedef, mesh, specs, attention, backend):
    self.graphdef, self.treedef = graphdef, treedef
    self.mesh, self.specs, self.attention, self.backend = mesh, specs, attention, backend
    self.lock = threading.Lock()
    self.prefill_cache = {}

  def _model(self, leaves):
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, list(leaves)))

  def _shard(self, body, n_out):
    """``body`` as is, or in a ``shard_map`` with replicated activations and the
    weights as ``self.specs`` (check_vma=False: see flashsample_jax.sharding)."""
    if self.mesh is None:
      return body
    rep = P()
    return jax.shard_map(body, mesh=self.mesh, in_specs=(list(self.specs), rep, rep, rep, rep),
                         out_specs=(rep,) * n_out, check_vma=False)

  def prefill(self):
    def body(leaves, prompt, cache, pos, unused):
      del unused
      h, cache = self._model(leaves)(prompt, cache, pos, attention=self.attention)
      return h[:, -1], cache
    return _donate_cache(self._shard(body, 2))

  def step(self, sampler: str, generation: GenerationConfig):
    axis = None if self.mesh is None else VOCAB_AXIS

    def body(leaves, hidden, cache, pos, key):
      model = self._model(leaves)
      tok = next_token(model, hidden, jax.random.fold_in(key, pos), generation, sampler,
                       self.backend, vocab_axis=axis)
      h, cache = model(tok[:, None], cache, pos, attention=self.attention)
      return tok, h[:, -1], cache
    return _donate_cache(self._shard(body, 3))


@dataclasses.dataclass
class Result:
  tokens: np.ndarray  # int32 [B, N]
  prefill_s: float  # the prompt's forward pass
  decode_s: float  # N decode steps, dispatched back to back
  hidden0: jax.Array | None = None  # [B, D]: the prompt's last hidden state

  @property
  def tpot_ms(self) -> float:
    """Time per output token: one decode step for the whole batch."""
    return 1e3 * self.decode_s / self.tokens.shape[1]

  @property
  def tokens_per_s(self) -> float:
    return self.tokens.size / self.decode_s


class Decoding:
  """Compiled prefill + decode step for one (config, B, lengths, sampler, generation).

  Lowers in the constructor; :meth:`compile` compiles (releasing the GIL, so
  several Decodings may compile in threads), and :meth:`run` compiles first if
  needed, so it times only the work. Decodings of one model share the prefill.

  With ``mesh`` (one axis named :data:`VOCAB_AXIS`), the LM head is split over
  the vocabulary across the mesh's devices and everything else is replicated:
  each device runs the whole decoder and samples from its slice of the head.
  """

  def __init__(self, cfg: Config, graphdef, state, *, batch: int, tokens: int,
               prompt_len: int, sampler: str, generation: GenerationConfig | str = "plain",
               backend: str = "auto", attention: str = "xla", mesh=None):
    if sampler not in SAMPLERS:
      raise ValueError(f"{sampler=} must be one of {SAMPLERS}")
    check_attention(attention)
    for name, v in (("batch", batch), ("tokens", tokens), ("prompt_len", prompt_len)):
      if v < 1:
        raise ValueError(f"{name}={v} must be >= 1")
    self.cfg, self.generation = cfg, generation_config(generation)
    self.sampler, self.mesh = sampler, mesh
    self.batch, self.tokens, self.prompt_len = batch, tokens, prompt_len
    leaves, treedef = jax.tree.flatten(state)
    specs, act = None, None
    if mesh is not None:
      specs = head_sharded_specs(cfg, state)
      act = NamedSharding(mesh, P())
      # A no-op for a state already placed by place_state().
      leaves = jax.device_put(leaves, [NamedSharding(mesh, s) for s in specs])
    self.leaves, self._act = leaves, act
    progs = _programs(graphdef, treedef, mesh, specs, attention, backend)
    s = prompt_len + tokens

    def sds(shape, dtype):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=act)

    kv = sds((batch, s, cfg.kv_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
    cache = [(kv, kv)] * cfg.layers
    i32 = sds((), jnp.int32)
    key = sds((), jax.random.key(0).dtype)
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
    t0 = time.perf_counter()
    with progs.lock:
      # The parameters' dtypes too: heads of one structure may differ in
      # dtype only (an fp8 and an int8 quantized head).
      pkey = (batch, prompt_len, s, tuple((a.shape, str(a.dtype)) for a in avals))
      if pkey not in progs.prefill_cache:
        progs.prefill_cache[pkey] = progs.prefill().lower(
            avals, sds((batch, prompt_len), jnp.int32), cache, i32, key).compile()
      self._prefill = progs.prefill_cache[pkey]
    h = sds((batch, cfg.dim), jnp.dtype(cfg.dtype))
    self._lowered = progs.step(sampler, self.generation).lower(avals, h, cache, i32, key)
    self._step = None
    self.compile_s = time.perf_counter() - t0

  def compile(self) -> "Decoding":
    if self._step is None:
      t0 = time.perf_counter()
      self._step = self._lowered.compile()
      self._lowered = None
      self.compile_s += time.perf_counter() - t0
    return self

  def warm_up(self, steps: int = 2) -> None:
    """Runs the prefill and ``steps`` decode steps untimed: the first execution
    of a program does one-time work (kernel loading, CUDA graph capture) that
    would otherwise land in the first timed run."""
    self.run(seed=0, steps=steps)

  def _put(self, x):
    return x if self._act is None else jax.device_put(x, self._act)

  def run(self, *, seed: int = 0, steps: int | None = None) -> Result:
    """Prefills a random prompt, then decodes ``tokens`` tokens per row
    (``steps`` of them if given, at most ``tokens``).

    The prompt and the sampling keys (:func:`step_key`) depend only on
    ``seed``, so runs with the same seed sample with the same keys.
    """
    self.compile()
    cfg, b, p = self.cfg, self.batch, self.prompt_len
    prompt = self._put(jax.random.randint(jax.random.key(seed + 1), (b, p), 0, cfg.vocab,
                                          jnp.int32))
    key = self._put(jax.random.key(seed))
    n = self.tokens if steps is None else max(1, min(steps, self.tokens))
    positions = [self._put(jnp.int32(p + i)) for i in range(n)]
    cache = empty_cache(cfg, b, p + self.tokens, sharding=self._act)
    zero = self._put(jnp.int32(0))
    jax.block_until_ready((prompt, cache, positions, key))

    t0 = time.perf_counter()
    h, cache = jax.block_until_ready(self._prefill(self.leaves, prompt, cache, zero, key))
    prefill_s = time.perf_counter() - t0
    h0 = h

    out = []
    t0 = time.perf_counter()
    for pos in positions:
      tok, h, cache = self._step(self.leaves, h, cache, pos, key)
      out.append(tok)
    jax.block_until_ready(out)
    decode_s = time.perf_counter() - t0
    return Result(np.stack(jax.device_get(out), axis=1), prefill_s, decode_s, h0)


_PROGRAMS: dict = {}


def _programs(graphdef, treedef, mesh, specs, attention, backend) -> _Programs:
  k = (graphdef, treedef, mesh, specs, attention, backend)
  if k not in _PROGRAMS:
    _PROGRAMS[k] = _Programs(*k)
  return _PROGRAMS[k]


def forget_programs() -> None:
  """Drops the compiled prefills kept for reuse (call when done with a model)."""
  _PROGRAMS.clear()


def generate(cfg: Config, graphdef, state, *, batch: int, tokens: int, prompt_len: int,
             sampler: str, seed: int = 0, generation: GenerationConfig | str = "plain",
             backend: str = "auto", attention: str = "xla") -> Result:
  """Compiles, prefills a random prompt and decodes ``tokens`` tokens per row."""
  return Decoding(cfg, graphdef, state, batch=batch, tokens=tokens, prompt_len=prompt_len,
                  sampler=sampler, generation=generation, backend=backend,
                  attention=attention).run(seed=seed)


def fused_backend(cfg: Config, batch: int, backend: str = "auto", vocab_shards: int = 1,
                  generation: GenerationConfig | str = "plain") -> str:
  """The backend ``backend`` resolves to for this model's head (one vocabulary
  shard of it) at ``batch`` rows."""
  import flashsample_jax as fs
  gen = generation_config(generation)
  picked = []

  def probe(h, w):
    layout = "vd" if cfg.tied else "dv"
    picked.append(fs.which_backend(h, w, jax.random.key(0), backend=backend,
                                   weight_layout=layout, **gen.fused_kwargs()))
    return h

  v = cfg.vocab // vocab_shards
  w_shape = (v, cfg.dim) if cfg.tied else (cfg.dim, v)
  jax.eval_shape(probe, jax.ShapeDtypeStruct((batch, cfg.dim), jnp.dtype(cfg.dtype)),
                 jax.ShapeDtypeStruct(w_shape, jnp.dtype(cfg.dtype)))
  return picked[0]
