"""Shared pytest setup: GPU tests skip cleanly where there is no GPU."""

import jax
import pytest


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def is_sm90() -> bool:
  if not has_gpu():
    return False
  return getattr(jax.devices("gpu")[0], "compute_capability", "") == "9.0"


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marked gpu)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
