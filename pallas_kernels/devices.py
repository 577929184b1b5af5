"""Which GPU a heuristic is choosing for: measured differences between
devices of one CUDA family (an H100 and an H200 are both sm90) are keyed by
jax's ``device_kind``."""

from __future__ import annotations

import re

import jax

__all__ = ["cuda_capability", "device_kind", "is_kind"]


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


def cuda_capability() -> tuple[int, int] | None:
  """The default device's CUDA compute capability ``(major, minor)``, or None
  where it is not a CUDA GPU: no device, another platform, or a ROCm GPU
  (a "gpu" too, whose capability is a "gfx..." name)."""
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  cc = str(getattr(device, "compute_capability", "") or "")
  if device.platform != "gpu" or not re.fullmatch(r"\d+\.\d+", cc):
    return None
  major, minor = cc.split(".")
  return int(major), int(minor)
