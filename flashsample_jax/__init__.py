"""flashsample-jax: exact LLM-head sampling fused with the matmul.

``sample(hidden, weight, key, ...)`` returns the tokens that
``jax.random.categorical`` would draw from ``hidden @ weight.T / T``, without
writing the ``[B, V]`` logits to device memory.
"""

from flashsample_jax import noise, reference
from flashsample_jax.api import BACKENDS, Backend, resolve_backend, sample

__all__ = ["sample", "Backend", "BACKENDS", "resolve_backend", "reference", "noise"]
__version__ = "0.1.0"
