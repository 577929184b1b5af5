"""Counter-based Gumbel noise, bit-identical to ``jax.random.gumbel``.

The implementation lives with the kernels (:mod:`pallas_kernels.threefry`),
because the same ``lax`` code runs inside the Mosaic GPU kernels and in the
XLA paths; this module is its public name. See that module for how JAX makes
the noise.
"""

from pallas_kernels import threefry as _threefry
from pallas_kernels.threefry import *  # noqa: F401,F403  (re-exported)

__all__ = list(_threefry.__all__)
