"""A Llama/Qwen3-style decoder in Flax nnx, for decoding examples and benchmarks.

RMSNorm, RoPE, grouped-query attention with per-head q/k RMSNorm (Qwen3) and a
KV cache, SwiGLU MLP; randomly initialised (the weights' values do not matter
for timing, their sizes do). Layers are stacked and run with ``lax.scan`` so
a 36-layer model compiles as fast as a one-layer model.

The LM head is either the tied ``nnx.Embed`` (Qwen3-1.7B, ``weight_layout``
"vd") or an ``nnx.Linear`` without bias (Qwen3-8B, "dv"); the fused sampler
reads either in place through :mod:`flashsample_jax.flax_heads`.

Letters: ``B`` batch, ``T`` new tokens in a forward pass, ``S`` cache length,
``D`` hidden, ``H``/``K`` query/KV heads, ``G = H / K``, ``E`` head dim,
``F`` MLP width, ``V`` vocabulary, ``L`` layers, ``N`` decoded tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flashsample_jax import flax_heads

Sampler = Literal["fused", "xla"]
SAMPLERS: tuple[str, ...] = get_args(Sampler)


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
  def params(self) -> int:
    """Parameter count (the weights a decode step streams)."""
    attn = self.dim * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + 2 * self.head_dim
    layer = attn + 3 * self.dim * self.ffn + 2 * self.dim
    head = 0 if self.tied else self.vocab * self.dim
    return self.layers * layer + self.vocab * self.dim + head + self.dim


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
}


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta: float):
  """Rotary embedding (rotate-half form) of ``x [B, T, *, E]`` at ``positions [T]``."""
  e = x.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, e, 2, dtype=jnp.float32) / e)  # [E/2]
  ang = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, E/2]
  cos = jnp.cos(ang)[None, :, None, :]
  sin = jnp.sin(ang)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attend(q, k_cache, v_cache, pos):
  """Causal GQA over the cache.

  Args:
    q: ``[B, T, H, E]`` queries of positions ``pos .. pos + T - 1``.
    k_cache, v_cache: ``[B, S, K, E]``, already holding this step's keys.
    pos: int32 scalar, the first query's position.

  Returns:
    ``[B, T, H * E]``.
  """
  b, t, h, e = q.shape
  s, k = k_cache.shape[1], k_cache.shape[2]
  q = q.reshape(b, t, k, h // k, e)
  logits = jnp.einsum("btkge,bske->bkgts", q, k_cache,
                      preferred_element_type=jnp.float32) * (e ** -0.5)
  visible = jnp.arange(s)[None, :] <= (pos + jnp.arange(t))[:, None]  # [T, S]
  logits = jnp.where(visible, logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1).astype(v_cache.dtype)
  return jnp.einsum("bkgts,bske->btkge", p, v_cache).reshape(b, t, h * e)


class Block(nnx.Module):
  """Pre-norm attention + SwiGLU MLP block (Qwen3: q/k RMSNorm per head)."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    lin = functools.partial(nnx.Linear, use_bias=False, param_dtype=dt, rngs=rngs)
    d, e = cfg.dim, cfg.head_dim
    self.attn_norm = RMSNorm(d, cfg.eps, dt)
    self.q_proj = lin(d, cfg.heads * e)
    self.k_proj = lin(d, cfg.kv_heads * e)
    self.v_proj = lin(d, cfg.kv_heads * e)
    self.o_proj = lin(cfg.heads * e, d)
    self.q_norm = RMSNorm(e, cfg.eps, dt)
    self.k_norm = RMSNorm(e, cfg.eps, dt)
    self.mlp_norm = RMSNorm(d, cfg.eps, dt)
    self.gate = lin(d, cfg.ffn)
    self.up = lin(d, cfg.ffn)
    self.down = lin(cfg.ffn, d)
    self.cfg = cfg

  def qkv(self, x, positions):
    """Queries ``[B, T, H, E]``, keys and values ``[B, T, K, E]`` of ``x [B, T, D]``."""
    cfg = self.cfg
    b, t, _ = x.shape
    h = self.attn_norm(x)
    q = self.q_norm(self.q_proj(h).reshape(b, t, cfg.heads, cfg.head_dim))
    k = self.k_norm(self.k_proj(h).reshape(b, t, cfg.kv_heads, cfg.head_dim))
    v = self.v_proj(h).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v

  def finish(self, x, attn_out):
    x = x + self.o_proj(attn_out)
    h = self.mlp_norm(x)
    return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab, cfg.dim, param_dtype=dt, rngs=rngs)

    # One Block's parameters stacked along a leading [L] axis, for lax.scan.
    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def blocks(rngs):
      return Block(cfg, rngs)

    self.blocks = blocks(rngs)
    self.norm = RMSNorm(cfg.dim, cfg.eps, dt)
    self.lm_head = (None if cfg.tied else
                    nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, param_dtype=dt, rngs=rngs))

  @property
  def head(self):
    """The LM head module: the tied ``nnx.Embed`` or the ``nnx.Linear``."""
    return self.embed if self.cfg.tied else self.lm_head

  def __call__(self, tokens, k_cache, v_cache, pos):
    """Runs ``tokens [B, T]`` at positions ``pos ..``, updating the cache.

    Args:
      tokens: int32 ``[B, T]``.
      k_cache, v_cache: ``[L, B, S, K, E]``.
      pos: int32 scalar.

    Returns:
      (final-normed hidden ``[B, T, D]``, k_cache, v_cache).
    """
    x = self.embed(tokens)
    positions = pos + jnp.arange(tokens.shape[1])
    graphdef, stacked = nnx.split(self.blocks)

    def layer(carry, xs):
      x, kc, vc = carry
      state, i = xs
      block = nnx.merge(graphdef, state)
      q, k, v = block.qkv(x, positions)
      # Write this step's keys into the cache in place (the cache is the scan
      # carry, so XLA updates the buffer rather than copying a new one).
      kc = jax.lax.dynamic_update_slice(kc, k[None].astype(kc.dtype), (i, 0, pos, 0, 0))
      vc = jax.lax.dynamic_update_slice(vc, v[None].astype(vc.dtype), (i, 0, pos, 0, 0))
      out = attend(q, kc[i], vc[i], pos)
      return (block.finish(x, out), kc, vc), None

    (x, k_cache, v_cache), _ = jax.lax.scan(
        layer, (x, k_cache, v_cache), (stacked, jnp.arange(self.cfg.layers)))
    return self.norm(x), k_cache, v_cache


def init(cfg: Config, seed: int = 0):
  """Random weights made directly on the default device, in one program.

  Returns:
    ``(graphdef, state)`` of a :class:`Decoder`.
  """
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(seed))))
  state = jax.jit(lambda: nnx.state(Decoder(cfg, nnx.Rngs(seed))))()
  return graphdef, state


def empty_cache(cfg: Config, batch: int, length: int):
  shape = (cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim)
  return jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)


def next_token(model: Decoder, hidden, key, temperature, sampler: str, backend: str = "auto"):
  """One token per row from ``softmax(head(hidden) / T)``.

  "fused": :func:`flashsample_jax.sample` (``backend``, default "auto") on the
  head as stored, never writing the ``[B, V]`` logits. "xla": materialize the
  f32 logits, then ``jax.random.categorical``. Same key, same tokens.
  ``temperature`` 0 is greedy (the argmax of the logits) for both.
  """
  if sampler == "fused":
    return flax_heads.sample_from_head(model.head, hidden, key, temperature=temperature,
                                       backend=backend)
  if sampler == "xla":
    logits = flax_heads.logits(model.head, hidden)
    # T = 0 is greedy, as in flashsample_jax.sample: logits / 0 would give
    # inf/NaN scores, so divide by 1 there and take the argmax instead.
    t = jnp.asarray(temperature, jnp.float32)
    sampled = jax.random.categorical(key, logits / jnp.where(t == 0, 1.0, t))
    return jnp.where(t == 0, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
  raise ValueError(f"{sampler=} must be one of {SAMPLERS}")


@functools.lru_cache(maxsize=None)
def _prefill_fn(graphdef):
  @functools.partial(jax.jit, donate_argnums=(2, 3))
  def prefill(state, prompt, k_cache, v_cache):
    """The prompt's forward pass: last hidden state ``[B, D]`` and the cache."""
    model = nnx.merge(graphdef, state)
    h, k_cache, v_cache = model(prompt, k_cache, v_cache, jnp.int32(0))
    return h[:, -1], k_cache, v_cache
  return prefill


@functools.lru_cache(maxsize=None)
def _step_fn(graphdef, sampler: str, backend: str):
  @functools.partial(jax.jit, donate_argnums=(2, 3))
  def step(state, hidden, k_cache, v_cache, pos, key, temperature):
    """Samples the token at ``pos`` from ``hidden``, then runs it through the model."""
    model = nnx.merge(graphdef, state)
    tok = next_token(model, hidden, jax.random.fold_in(key, pos), temperature, sampler, backend)
    h, k_cache, v_cache = model(tok[:, None], k_cache, v_cache, pos)
    return tok, h[:, -1], k_cache, v_cache
  return step


@dataclasses.dataclass
class Result:
  tokens: np.ndarray  # int32 [B, N]
  prefill_s: float  # the prompt's forward pass
  decode_s: float  # N decode steps, dispatched back to back

  @property
  def tpot_ms(self) -> float:
    """Time per output token: one decode step for the whole batch."""
    return 1e3 * self.decode_s / self.tokens.shape[1]

  @property
  def tokens_per_s(self) -> float:
    return self.tokens.size / self.decode_s


class Decoding:
  """Compiled prefill + decode step for one (config, B, lengths, sampler).

  Compiles ahead of time (``compile_s``), so :meth:`run` times only the work.
  """

  def __init__(self, cfg: Config, graphdef, state, *, batch: int, tokens: int,
               prompt_len: int, sampler: str, backend: str = "auto"):
    if sampler not in SAMPLERS:
      raise ValueError(f"{sampler=} must be one of {SAMPLERS}")
    self.cfg, self.state = cfg, state
    self.batch, self.tokens, self.prompt_len = batch, tokens, prompt_len
    kc, vc = jax.eval_shape(lambda: empty_cache(cfg, batch, prompt_len + tokens))
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    t0 = time.perf_counter()
    self._prefill = _prefill_fn(graphdef).lower(
        state, jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32), kc, vc).compile()
    h = jax.ShapeDtypeStruct((batch, cfg.dim), jnp.dtype(cfg.dtype))
    self._step = _step_fn(graphdef, sampler, backend).lower(
        state, h, kc, vc, i32, jax.random.key(0), jnp.float32(1)).compile()
    self.compile_s = time.perf_counter() - t0

  def run(self, *, seed: int = 0, temperature: float = 1.0) -> Result:
    """Prefills a random prompt, then decodes ``tokens`` tokens per row.

    The prompt and the sampling keys (``fold_in(key(seed), position)``) depend
    only on ``seed``, so runs with the same seed sample with the same keys.
    """
    cfg, b, p = self.cfg, self.batch, self.prompt_len
    prompt = jax.random.randint(jax.random.key(seed + 1), (b, p), 0, cfg.vocab, jnp.int32)
    key, temp = jax.random.key(seed), jnp.float32(temperature)
    positions = [jnp.int32(p + i) for i in range(self.tokens)]
    kc, vc = empty_cache(cfg, b, p + self.tokens)
    jax.block_until_ready((prompt, kc, vc, positions))

    t0 = time.perf_counter()
    h, kc, vc = jax.block_until_ready(self._prefill(self.state, prompt, kc, vc))
    prefill_s = time.perf_counter() - t0

    out = []
    t0 = time.perf_counter()
    for pos in positions:
      tok, h, kc, vc = self._step(self.state, h, kc, vc, pos, key, temp)
      out.append(tok)
    jax.block_until_ready(out)
    decode_s = time.perf_counter() - t0
    return Result(np.stack(jax.device_get(out), axis=1), prefill_s, decode_s)


def generate(cfg: Config, graphdef, state, *, batch: int, tokens: int, prompt_len: int,
             sampler: str, seed: int = 0, temperature: float = 1.0,
             backend: str = "auto") -> Result:
  """Compiles, prefills a random prompt and decodes ``tokens`` tokens per row."""
  return Decoding(cfg, graphdef, state, batch=batch, tokens=tokens, prompt_len=prompt_len,
                  sampler=sampler, backend=backend).run(seed=seed, temperature=temperature)


def fused_backend(cfg: Config, batch: int, backend: str = "auto") -> str:
  """The backend ``backend`` resolves to for this model's head at ``batch`` rows."""
  import flashsample_jax as fs
  picked = []

  def probe(h, w):
    layout = "vd" if cfg.tied else "dv"
    picked.append(fs.which_backend(h, w, jax.random.key(0), backend=backend,
                                   weight_layout=layout))
    return h

  w_shape = (cfg.vocab, cfg.dim) if cfg.tied else (cfg.dim, cfg.vocab)
  jax.eval_shape(probe, jax.ShapeDtypeStruct((batch, cfg.dim), jnp.dtype(cfg.dtype)),
                 jax.ShapeDtypeStruct(w_shape, jnp.dtype(cfg.dtype)))
  return picked[0]
