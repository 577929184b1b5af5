"""Speculative decoding with fs.verify_drafts: a drafter proposes K tokens, the
target verifies them from its LM head in one fused pass.

  python examples/speculative.py [--method one_hot] [--k 4] [--batch 8] [--steps 16]
      [--noise 0.1] [--temperature 0.8] [--top-p 0.95]

The target is a small recurrent language model with random weights (hidden
state ``h' = tanh(E[token] + h R)``, head ``W``); the drafter is the same
model with its weights perturbed by ``--noise`` (0: the drafter is the
target, and with ``strict`` or greedy rows every draft is accepted). Each
step: the drafter samples K tokens (and their probabilities, for
``probabilistic``), the target runs the K + 1 positions, ``fs.verify_drafts``
accepts a prefix and emits one more token. Prints tokens per step and the
acceptance rate.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

import flashsample_jax as fs


def make_model(key, vocab: int, dim: int):
  """``(E [V, D], R [D, D], W [V, D])`` in bf16 (R f32 for the recurrence)."""
  k1, k2, k3 = jax.random.split(key, 3)
  emb = jax.random.normal(k1, (vocab, dim), jnp.float32)
  rec = jax.random.normal(k2, (dim, dim), jnp.float32) / dim**0.5
  head = jax.random.normal(k3, (vocab, dim), jnp.float32) * (8.0 / dim**0.5)
  return emb, rec, head.astype(jnp.bfloat16)


def perturbed(model, key, noise: float):
  keys = jax.random.split(key, len(model))
  return tuple((m.astype(jnp.float32) + noise * jnp.std(m.astype(jnp.float32))
                * jax.random.normal(k, m.shape)).astype(m.dtype) for m, k in zip(model, keys))


def step_state(model, h, tokens):
  """The hidden states after each of ``tokens [B, T]``: ``[B, T, D]`` (bf16)."""
  emb, rec, _ = model

  def one(h, tok):
    h = jnp.tanh(emb[tok] + h @ rec)
    return h, h
  h, hs = jax.lax.scan(one, h, tokens.T)
  return h, jnp.swapaxes(hs, 0, 1)


def draft(model, h, last, key, k: int, controls):
  """K drafted tokens ``[B, K]`` and their probabilities ``[B, K, V]``."""
  _, _, head = model

  def one(carry, key):
    h, tok = carry
    h = jnp.tanh(model[0][tok] + h @ model[1])
    hb = h.astype(jnp.bfloat16)
    tok = fs.sample(hb, head, key, **controls)
    logits = jnp.dot(hb, head.T, preferred_element_type=jnp.float32)
    t = controls.get("temperature", 1.0)
    probs = jax.nn.softmax(logits / t if t else logits * 1e4, axis=-1)
    return (h, tok), (tok, probs)
  _, (toks, probs) = jax.lax.scan(one, (h, last), jax.random.split(key, k))
  return toks.T, jnp.swapaxes(probs, 0, 1)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--method", default="one_hot", choices=fs.speculative.METHODS)
  p.add_argument("--k", type=int, default=4, help="drafts per step")
  p.add_argument("--batch", type=int, default=8, help="requests")
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--dim", type=int, default=256)
  p.add_argument("--noise", type=float, default=0.1, help="drafter's weight perturbation")
  p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--backend", default="auto", choices=("auto", *fs.BACKENDS))
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.k < 1 or args.batch < 1 or args.steps < 1:
    print("speculative.py: --k, --batch and --steps must be >= 1", file=sys.stderr)
    return 2
  controls = dict(temperature=args.temperature)
  if args.top_p is not None:
    controls["top_p"] = args.top_p
  key = jax.random.key(args.seed)
  target = make_model(jax.random.fold_in(key, 1), args.vocab, args.dim)
  drafter = perturbed(target, jax.random.fold_in(key, 2), args.noise)
  b, k = args.batch, args.k
  h_t = jnp.zeros((b, args.dim))
  h_d = jnp.zeros((b, args.dim))
  last = jnp.zeros((b,), jnp.int32)

  @jax.jit
  def step(h_t, h_d, last, key):
    k_draft, k_verify = jax.random.split(key)
    drafts, q = draft(drafter, h_d, last, k_draft, k, controls)
    # The target's hidden states at the K + 1 positions: after `last`, then
    # after each draft (position j predicts the token after drafts[:j]).
    _, hs = step_state(target, h_t, jnp.concatenate([last[:, None], drafts], axis=1))
    extra = {"draft_probs": q} if args.method == "probabilistic" else {}
    out = fs.verify_drafts(hs.astype(jnp.bfloat16), target[2], k_verify, drafts,
                           method=args.method, backend=args.backend, **controls, **extra)
    # Advance both models over the accepted drafts (the emitted token is the
    # next step's `last`): replay them from the step's start, masked per row.
    n = out.num_accepted
    accepted = jnp.where(jnp.arange(k)[None] < n[:, None], drafts, 0)
    emitted = jnp.take_along_axis(out.tokens, n[:, None], axis=1)[:, 0]
    seq = jnp.concatenate([last[:, None], accepted], axis=1)              # [B, K + 1]

    def advance(model, h):
      _, hs = step_state(model, h, seq)
      return jnp.take_along_axis(hs, n[:, None, None], axis=1)[:, 0].astype(h.dtype)
    return advance(target, h_t), advance(drafter, h_d), emitted, out

  total_tokens, total_accepted = 0, 0
  for s in range(args.steps):
    h_t, h_d, last, out = step(h_t, h_d, last, jax.random.fold_in(key, 100 + s))
    n = jax.device_get(out.num_accepted)
    total_accepted += int(n.sum())
    total_tokens += int(n.sum()) + b
    if s < 3:
      print(f"step {s}: accepted {n.tolist()}; row 0 emits {out.tokens[0].tolist()}")
  print(f"{args.method}, K = {k}, B = {b}, noise {args.noise}: "
        f"{total_tokens / (args.steps * b):.2f} tokens per step per request, "
        f"acceptance rate {total_accepted / (args.steps * b * k):.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
