"""Pallas kernels behind flashsample_jax's backends, one module per backend/arch."""
