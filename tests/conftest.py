"""Shared pytest setup.

* 8 host CPU devices, so the sharding tests can build 1/2/4/8-way meshes
  (must be set before jax is imported; harmless for the other tests, which
  use the first device).
* GPU tests (marked ``gpu``) skip cleanly where there is no GPU; on the H100
  run them with ``pytest -m gpu``.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

# One Triton cache per pytest-xdist worker, in a directory this process can
# write (workers compiling into one shared cache at once can fail). jax_triton
# empties TRITON_CACHE_DIR when it is imported; the inspection compiles
# (triton_sampler.compile_for_inspection) bring their own directory then.
_triton_cache = os.environ.get("TRITON_CACHE_DIR") or ""
if not (_triton_cache and os.access(_triton_cache, os.W_OK)):
  import tempfile
  _triton_cache = os.path.join(tempfile.gettempdir(), "fsj-triton")
os.environ["TRITON_CACHE_DIR"] = os.path.join(
    _triton_cache, os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.makedirs(os.environ["TRITON_CACHE_DIR"], exist_ok=True)

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def is_sm90() -> bool:
  if not has_gpu():
    return False
  return getattr(jax.devices("gpu")[0], "compute_capability", "") == "9.0"


_SESSION_CACHE = "FSJ_TEST_JAX_CACHE_DIR"


def pytest_configure(config):
  # On the CPU, a persistent compilation cache for this session: a new
  # directory, made by the first process (pytest-xdist's controller, whose
  # workers inherit the variable) and removed when it exits. Tests that
  # clear jax's caches (to retrace with a patched constant), interpret mode
  # (which traces a kernel's threads again on every trace of the kernel) and
  # the two workers, which run tests on the same shapes, compile programs
  # identical to ones compiled before; those come from the cache (the same
  # executable: the key is the program and the compile options). Without
  # jax's eviction the cache takes no lock: a read that races a write of the
  # same entry fails to decompress, warns and compiles. A cache directory of
  # the user's (JAX_COMPILATION_CACHE_DIR) is left alone.
  del config
  if jax.config.jax_compilation_cache_dir or has_gpu():
    return
  path = os.environ.get(_SESSION_CACHE)
  if not path:
    path = tempfile.mkdtemp(prefix="fsj-jax-cache-")
    os.environ[_SESSION_CACHE] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def session_cache_dir() -> str | None:
  """The session's compilation cache directory (None on a GPU, or where the
  user set their own): subprocesses that compile on the CPU share it."""
  return os.environ.get(_SESSION_CACHE)


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marked gpu)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
