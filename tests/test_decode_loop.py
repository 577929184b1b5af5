"""A jitted decode loop compiles once and moves nothing to or from the host per step.

A serving loop calls its jitted step thousands of times; a sampler that
retraces (a Python value that changes per step, a shape that depends on
data) or syncs with the host (a concrete check of a traced value, a
``device_get`` inside) would cost a compilation or a round trip on every
token. The loops here feed each sampled token's embedding back as the next
hidden state, so every step depends on the last.

* A Python loop calling a jitted step: after the first (compiling) step, the
  steps run under ``jax.transfer_guard("disallow")`` and may not compile
  anything (counted from jax's compile events, and with
  ``chex.assert_max_traces`` on the step).
* A ``lax.scan`` over the steps: called again, it neither compiles nor
  transfers.
* Neither compiled program holds a host callback, send/recv or in/outfeed
  (which the transfer guard does not see).

Both with plain sampling and with truncation controls (whose exact fallback
sits behind a ``lax.cond``), for every backend that runs here and "auto".
Exact inputs make the tokens checkable against the same loop over
``fs.reference.sample``.
"""

from __future__ import annotations

import contextlib
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from tests import inputs

B, D, V = 4, 64, 512
STEPS = 12
OPTIONS = {
    "plain": {},
    "controls": dict(top_k=20, top_p=0.9, min_p=0.01, return_logprobs=True),
}
_COMPILE_EVENT = "backend_compile_duration"


# What in a compiled program moves data to or from the host. The transfer
# guard sees only transfers of arguments and results; a host callback inside
# the program (jax.debug.print, pure_callback) passes it, so the compiled HLO
# is checked for them too.
_HOST_OPS = re.compile(r'custom_call_target="[^"]*callback[^"]*"'
                       r"|\b(?:send|recv|infeed|outfeed)(?:-start|-done)?\(")


def host_ops(jitted, *args) -> list[str]:
  """The host-communicating ops of ``jitted``'s compiled program for ``args``."""
  text = jitted.lower(*args).compile().as_text()
  return sorted({m.group(0) for m in _HOST_OPS.finditer(text)})


@contextlib.contextmanager
def count_compiles():
  """Counts XLA compilations (jax's compile events) inside the block."""
  events = []

  def listener(name, duration_secs, **kwargs):
    del duration_secs, kwargs
    if name.endswith(_COMPILE_EVENT):
      events.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _backend_or_skip(backend, h, w):
  try:
    return fs.which_backend(h, w, jax.random.key(0), backend=backend)
  except NotImplementedError as e:
    pytest.skip(f"backend {backend!r} does not run here: {e}")


def _inputs():
  # The embedding is the head (tied): integer rows keep every logit exact.
  h, w = inputs.exact_inputs(B, D, V, scale=1, seed=40)
  return h, w, inputs.pow2_temperatures(B, greedy_every=3, seed=40)


def _tokens(out):
  return out.tokens if isinstance(out, fs.SampleOutput) else out


def _make_step(sampler, options):
  def step(w, h, key, pos, t):
    out = sampler(h, w, jax.random.fold_in(key, pos), temperature=t, **options)
    tok = _tokens(out)
    return tok, w[tok], pos + 1
  return step


@functools.lru_cache(maxsize=None)
def _reference_tokens(options: str):
  """``[STEPS, B]`` tokens of the same loop over ``fs.reference.sample``."""
  h, w, t = _inputs()
  step = jax.jit(_make_step(fs.reference.sample, OPTIONS[options]))
  key, pos, out = jax.random.key(41), jnp.int32(0), []
  for _ in range(STEPS):
    tok, h, pos = step(w, h, key, pos, t)
    out.append(tok)
  return np.stack(jax.device_get(out))


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("backend", ["auto", *fs.BACKENDS])
def test_python_loop_of_a_jitted_step(backend, options):
  h, w, t = _inputs()
  _backend_or_skip(backend, h, w)
  kw = dict(OPTIONS[options], backend=backend)
  # chex counts traces per function code, shared by every parametrization.
  chex.clear_trace_counter()
  raw_step = _make_step(fs.sample, kw)
  step = jax.jit(chex.assert_max_traces(raw_step, n=1))
  # Everything the loop passes lives on the device before the guard.
  key, pos = jax.device_put(jax.random.key(41)), jax.device_put(jnp.int32(0))
  w, h, t = jax.device_put((w, h, t))
  with count_compiles() as compiles:
    tok, h, pos = step(w, h, key, pos, t)  # the one compilation
  assert compiles, "no compile event seen: the counter would miss recompilations"
  out = [tok]
  with count_compiles() as compiles, jax.transfer_guard("disallow"):
    for _ in range(STEPS - 1):
      tok, h, pos = step(w, h, key, pos, t)
      out.append(tok)
    jax.block_until_ready(out)
  assert not compiles, f"{len(compiles)} compilation(s) in the steady state"
  assert step._cache_size() == 1
  assert host_ops(jax.jit(raw_step), w, h, key, pos, t) == []
  np.testing.assert_array_equal(np.stack(jax.device_get(out)),
                                _reference_tokens(options))


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("backend", ["auto", *fs.BACKENDS])
def test_scan_decode_loop(backend, options):
  h, w, t = _inputs()
  _backend_or_skip(backend, h, w)
  step = _make_step(fs.sample, dict(OPTIONS[options], backend=backend))

  @jax.jit
  def decode(w, h, key, t):
    def body(carry, _):
      h, pos = carry
      tok, h, pos = step(w, h, key, pos, t)
      return (h, pos), tok
    return jax.lax.scan(body, (h, jnp.int32(0)), length=STEPS)[1]

  args = jax.device_put((w, h, jax.random.key(41), t))
  first = decode(*args)
  with count_compiles() as compiles, jax.transfer_guard("disallow"):
    again = jax.block_until_ready(decode(*args))
  assert not compiles and decode._cache_size() == 1
  assert host_ops(decode, *args) == []
  chex.assert_trees_all_equal(first, again)
  np.testing.assert_array_equal(again, _reference_tokens(options))


def test_the_detectors_catch_what_they_are_for():
  # The checks above can fail: a step fed a host value per step trips the
  # transfer guard, and one whose Python argument changes per step retraces.
  h, w, t = _inputs()
  step = jax.jit(_make_step(fs.sample, dict(backend="xla")))
  args = jax.device_put((w, h, jax.random.key(0)))
  step(*args, jnp.int32(0), t)
  with (jax.transfer_guard("disallow"),
        pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device")):
    step(*args, np.int32(1), t)  # a host scalar each step

  chex.clear_trace_counter()
  traced = chex.assert_max_traces(lambda h, n: h * n, n=1)
  retrace = jax.jit(traced, static_argnums=1)
  retrace(h, 1)
  with pytest.raises(AssertionError, match="traced > 1 times"):
    retrace(h, 2)  # a new static value: a second trace
  # A host callback inside the program passes the transfer guard; the HLO
  # check sees it.
  def printing_step(*a):
    out = _make_step(fs.sample, dict(backend="xla"))(*a)
    jax.debug.print("token {}", out[0][0])
    return out
  assert host_ops(jax.jit(printing_step), *args, jnp.int32(0), t)
  # And the compile counter sees a recompilation.
  grow = jax.jit(lambda x: x + 1)
  grow(h)
  with count_compiles() as compiles:
    grow(h[:2])  # a new shape
  assert compiles and grow._cache_size() == 2
