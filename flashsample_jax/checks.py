"""Run-time checks of traced values: off unless asked for.

A control, a draft id or a token id that is traced when a call is traced
cannot be checked eagerly. The package can check it with
``checkify.debug_check``, which does nothing on the device unless the caller
wraps the call in ``checkify.checkify``, but which is not free: the check
carries a JAX effect, and a jitted program with an effect leaves JAX's C++
dispatch path for the Python one on every call: host time that exceeded the
device time of a small batch's sampling (docs/design.md, "Checks of traced
values"; docs/performance.md, "Dispatch"). So the checks are written into a trace
only while they are on: ``with fs.traced_checks(): ...`` around the
tracing, or ``FSJ_TRACED_CHECKS=1`` in the environment for the whole
process.

The setting is read when a function is traced. A :func:`traced_checks`
block is part of JAX's tracing and compilation cache key
(``jax.make_user_context``): a jitted function traced before without checks
is traced again inside the block. The environment variable is read at each
trace and is not part of that key: set it before the process starts.
"""

from __future__ import annotations

import contextlib
import os

import jax
from jax.experimental import checkify

__all__ = ["traced_checks", "traced_checks_enabled", "debug_check"]

ENV = "FSJ_TRACED_CHECKS"
_TRUE = ("1", "true", "yes", "on")

# None: follow the environment; True / False: a traced_checks() block's
# choice, in JAX's cache keys.
_enabled = jax.make_user_context(default_value=None)


def traced_checks_enabled() -> bool:
  """Whether calls traced now carry checks of their traced values: the
  innermost :func:`traced_checks` block's choice, else ``FSJ_TRACED_CHECKS``
  (``1``, ``true``, ``yes`` or ``on``; off when unset)."""
  chosen = _enabled.value
  if chosen is not None:
    return chosen
  return os.environ.get(ENV, "").strip().lower() in _TRUE


@contextlib.contextmanager
def traced_checks(enabled: bool = True):
  """Within the block, calls that are traced carry (``enabled=True``) or
  leave out ``checkify`` checks of their traced values.

  Wrap the tracing: ``checkify.checkify(f)(...)`` or the first call of a
  jitted function. The checks report only under ``checkify.checkify``.

  Raises:
    TypeError: ``enabled`` is not a bool.
  """
  if not isinstance(enabled, bool):
    raise TypeError(f"enabled={enabled!r} must be a bool")
  with _enabled(enabled):
    yield


def debug_check(pred, msg: str, **fmt) -> None:
  """``checkify.debug_check(pred, msg, **fmt)`` while checks are on
  (:func:`traced_checks_enabled`), else nothing: no effect in the trace."""
  if traced_checks_enabled():
    checkify.debug_check(pred, msg, **fmt)
