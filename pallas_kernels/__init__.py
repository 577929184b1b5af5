"""The kernels of flashsample-jax, with array-level signatures.

Nothing here imports ``flashsample_jax``: kernels take arrays and a static
config, and the backend adapters in ``flashsample_jax.backends`` turn a
validated problem into those arguments. Importing this package imports no
Pallas or Triton module; each kernel module does that itself.

* :mod:`~pallas_kernels.threefry`: JAX's threefry-2x32 Gumbel noise in ``lax``.
* :mod:`~pallas_kernels.state`: the per-row state of a pass with sampling
  controls, and the candidate lists' pairing and top-M merge.
* :mod:`~pallas_kernels.devices`: the device kind that measured per-device
  choices of the heuristics are keyed by.
* :mod:`~pallas_kernels.rules`: the tie rule and the greedy rule, shared by
  every kernel and by the XLA code.
* ``sm90_*``: the Pallas Mosaic GPU kernels for Hopper: the shared frame
  (:mod:`~pallas_kernels.sm90_common`), configs and the heuristic
  (:mod:`~pallas_kernels.sm90_config`), plain sampling
  (:mod:`~pallas_kernels.sm90_sampler`) and sampling controls
  (:mod:`~pallas_kernels.sm90_controls`).
"""
