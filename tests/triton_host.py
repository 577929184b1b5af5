"""NumPy arrays as the slice of ``torch.Tensor`` that Triton 3.6's
interpreter touches, so that the kernels' interpreter tests
(``TRITON_INTERPRET=1``) run on host arrays without torch."""

import os
import subprocess
import sys

import numpy as np


def run_interpreter_tests(test_file: str) -> None:
  """Runs ``test_file``'s interpreter tests (``-k "interpreter and not
  suite"``) in a child process with ``TRITON_INTERPRET=1``: the interpreter
  must be on before triton is imported. Fails unless they all ran and
  passed."""
  env = dict(os.environ, TRITON_INTERPRET="1")
  r = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-k", "interpreter and not suite", test_file],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(test_file))),
      env=env, capture_output=True, text=True, timeout=600)
  tail = (r.stdout + r.stderr)[-6000:]
  assert r.returncode == 0, tail
  assert " passed" in r.stdout and "skipped" not in r.stdout.split("\n")[-2], tail


class _Storage:

  def __init__(self, t):
    self._t = t

  def data_ptr(self):
    return self._t.a.ctypes.data

  def cpu(self):
    return self

  def copy_(self, other):
    del other  # host memory already: nothing to copy back


class _DType:

  def __init__(self, d):
    self._d = np.dtype(d)

  def __str__(self):  # the torch-style name Triton's type mangling reads
    return f"torch.{self._d.name}"


_DTYPES: dict = {}


class HostTensor:
  """The slice of torch.Tensor that Triton 3.6's interpreter touches, over a
  NumPy array (so the interpreter runs without torch)."""

  def __init__(self, a):
    self.a = np.require(np.array(a), requirements=["C", "W"])

  @property
  def dtype(self):
    # One object per dtype, alive for the whole process: Triton's
    # interpreter caches what it derives from a dtype object by the
    # object's id, so a fresh (soon freed) object per call let a later
    # array's dtype take a dead one's id and its cached type (a uint32 block
    # read as bf16, in about one process in three).
    return _DTYPES.setdefault(self.a.dtype, _DType(self.a.dtype))

  def data_ptr(self):
    return self.a.ctypes.data

  def untyped_storage(self):
    return _Storage(self)

  def new_empty(self, *args, **kwargs):
    del args, kwargs
    return self

  def set_(self, *args, **kwargs):
    del args, kwargs
    return self

  def storage_offset(self):
    return 0

  def size(self):
    return self.a.shape

  def stride(self):
    return tuple(s // self.a.itemsize for s in self.a.strides)


def interpreted_triton_call(*args, kernel, out_shape, grid, num_warps=None, num_stages=None,
                            name=None, **constexprs):
  """``jax_triton.triton_call``'s contract on host arrays, the kernel run by
  Triton's interpreter: the inputs then zeroed outputs of ``out_shape`` as
  the kernel's arguments. Standing in for jax-triton, it lets the
  interpreter tests run a module's own launch code."""
  del num_warps, num_stages, name
  many = isinstance(out_shape, (tuple, list))
  shapes = out_shape if many else (out_shape,)
  ins = [HostTensor(np.asarray(a)) for a in args]
  outs = [HostTensor(np.zeros(s.shape, s.dtype)) for s in shapes]
  kernel[grid](*ins, *outs, **constexprs)
  got = tuple(o.a for o in outs)
  return got if many else got[0]
