"""Placeholder until the Mosaic GPU kernel lands: always unsupported."""


def check_supported(p):
  raise NotImplementedError("the mosaic backend is not built yet")


def candidates(p, *, vocab_offset=0):
  raise NotImplementedError("the mosaic backend is not built yet")
