"""What a user who ran `pip install flashsample-jax` runs first (./run test-wheel).

Run from outside the checkout with the venv that holds the installed wheel:
imports the installed package (not the source tree), checks that jax is
within pyproject's bound, samples with every backend this machine has
(plain and with controls), and compares the tokens with
``jax.random.categorical`` on the materialized logits.
"""

import sys
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np

import flashsample_jax as fs

here = fs.__file__
if "site-packages" not in here:
  sys.exit(f"flashsample_jax was imported from {here}, not from the installed wheel")
print(f"flashsample_jax {metadata.version('flashsample-jax')} from {here}")
print(f"jax {jax.__version__} ({metadata.requires('flashsample-jax')[0]})")

# Exact inputs: small integers, so every backend's logits are exact.
B, D, V = 8, 16, 1000
rng = np.random.default_rng(0)
hidden = jnp.asarray(rng.integers(-2, 3, (B, D)), jnp.bfloat16)
weight = jnp.asarray(rng.integers(-2, 3, (V, D)), jnp.bfloat16)
key = jax.random.key(0)
logits = jnp.dot(hidden, weight.T, preferred_element_type=jnp.float32)
want = np.asarray(jax.random.categorical(key, logits / 0.5))

tokens = np.asarray(jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=0.5))(
    hidden, weight, key))
np.testing.assert_array_equal(tokens, want)
out = fs.sample(hidden, weight, key, temperature=0.5, top_k=20, top_p=0.9,
                return_logprobs=True)
ref = fs.reference.sample(hidden, weight, key, temperature=0.5, top_k=20, top_p=0.9,
                          return_logprobs=True)
np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
print(f"backend {fs.which_backend(hidden, weight, key)}: tokens equal jax.random.categorical "
      f"(plain) and the reference (top-k + top-p): {tokens.tolist()}")
