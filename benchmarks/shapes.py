"""The LM heads the benchmarks time and the GPU tests check, in one place.

``(D, V)`` of real models' heads, bf16. Tests import these (the benchmark
shapes are also correctness tests on the GPU), benchmarks time them.
"""

HEADS = {
    "S": (4096, 151936),            # Qwen3-8B
    "L": (8192, 128256),            # Llama-3-70B
    "qwen3-1.7b": (2048, 151936),
    "gpt-oss": (2880, 201088),
}


def random_head(head: str, logit_std: float = 3.0, seed: int = 1):
  """A random bf16 weight ``[V, D]`` of ``head``, drawn on the device, whose
  logits against N(0, 1) hidden states have standard deviation about
  ``logit_std`` (the experiments' stand-in for a trained head)."""
  return random_weight(*HEADS[head], logit_std, seed)


def random_weight(d: int, v: int, logit_std: float = 3.0, seed: int = 1):
  """:func:`random_head` of any shape ``(D, V)`` (a smoke run's tiny one)."""
  import jax
  import jax.numpy as jnp
  w = jax.random.normal(jax.random.key(seed), (v, d), jnp.float32)
  return (w * (logit_std / d**0.5)).astype(jnp.bfloat16)


def points(specs, logit_std: float = 1.3):
  """``(head, D, V, B, w, h)`` for each point of ``specs`` like
  ``["S:256,512", "L:256"]``: the head's :func:`random_head` (drawn once per
  head) and N(0, 1) bf16 hidden states of B rows (seeded by B)."""
  import jax
  import jax.numpy as jnp
  for spec in specs:
    head, batches = spec.split(":")
    d, v = HEADS[head]
    w = random_head(head, logit_std)
    for b in (int(x) for x in batches.split(",")):
      yield head, d, v, b, w, jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)


def fp8_points(heads, batches, logit_std: float = 3.0):
  """``(head, B, h, w8, scale, keys)`` for each head and B: the head's
  :func:`random_head` quantized per row to ``float8_e4m3fn`` (drawn once
  per head), N(0, 1) bf16 hidden states of B rows (seeded by B) and one
  key per row (the FP8 experiments' inputs)."""
  import jax
  import jax.numpy as jnp
  import flashsample_jax as fs
  for head in heads:
    d, _ = HEADS[head]
    w8, scale = fs.quantize_weight(random_head(head, logit_std), jnp.float8_e4m3fn)
    for b in batches:
      yield (head, b, jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16), w8, scale,
             jax.random.split(jax.random.key(3), b))
