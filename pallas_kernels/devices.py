"""Which GPU a heuristic is choosing for: measured differences between
devices of one CUDA family (an H100 and an H200 are both sm90) are keyed by
jax's ``device_kind``."""

from __future__ import annotations

import jax

__all__ = ["device_kind", "is_kind"]


def device_kind() -> str:
  """The abstract mesh's device kind if one is set (tracing for a device
  that is not here, as the CUDA-lowering tests do), else the first GPU's,
  else ``""``."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None and getattr(device, "device_kind", None):
    return str(device.device_kind)
  try:
    return jax.devices("gpu")[0].device_kind
  except RuntimeError:
    return ""


def is_kind(kind: str, name: str) -> bool:
  """``kind`` is the device ``name`` or a variant of it (``"NVIDIA H200
  NVL"`` for ``"NVIDIA H200"``), not one that only contains the name
  (``"NVIDIA GH200 480GB"``)."""
  return kind == name or kind.startswith(name + " ")
