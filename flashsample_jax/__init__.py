"""flashsample-jax: exact LLM-head sampling fused with the matmul.

``sample(hidden, weight, key, ...)`` returns the tokens that
``jax.random.categorical`` would draw from ``hidden @ weight.T / T``, without
writing the ``[B, V]`` logits to device memory.
"""

from flashsample_jax import backends, controls, mesh, noise, problem, reference, sharding
from flashsample_jax.checks import traced_checks
from flashsample_jax.api import STATIC_ARGNAMES, sample, sample_logits, which_backend
from flashsample_jax.backends import BACKENDS, Backend
from flashsample_jax.controls import SampleOutput
from flashsample_jax.params import SamplingParams
from flashsample_jax.quantize import quantize_weight
from flashsample_jax.scoring import ScoreOutput, score_tokens
from flashsample_jax.sharding import sample_sharded
from flashsample_jax.speculative import VerifyOutput, verify_drafts

__all__ = ["sample", "sample_logits", "sample_sharded", "verify_drafts", "VerifyOutput",
           "SamplingParams", "quantize_weight", "score_tokens", "ScoreOutput", "traced_checks",
           "SampleOutput", "Backend", "BACKENDS",
           "STATIC_ARGNAMES", "which_backend", "reference", "noise", "sharding",
           "controls", "backends", "mesh", "problem"]
__version__ = "0.1.0"


def __getattr__(name):
  # flax_heads imports flax, which users of the plain API need not install.
  if name == "flax_heads":
    import importlib
    return importlib.import_module("flashsample_jax.flax_heads")
  raise AttributeError(f"module 'flashsample_jax' has no attribute {name!r}")
