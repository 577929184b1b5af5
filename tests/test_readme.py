"""The README's code: every ```python block runs as written.

The blocks run in file order in one namespace, as a reader who copies them
one after the other would run them (later blocks use ``hidden``, ``W``,
``key``, ... of the first). A block can opt out only with an HTML comment on
the line right before it, ``<!-- readme-test: skip (reason) -->``, and the
reason is required. The sharding block needs the 8 host devices of
tests/conftest.py.

Also checks two statements of the README against the code: the list of
options to declare static when jitting ``fs.sample``, and the shape of
``allowed_mask``.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashsample_jax as fs
from tests import inputs

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"^<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$")


def python_blocks(text: str):
  """``(first line number, code, skip reason or None)`` of each ```python block."""
  lines = text.splitlines()
  blocks, i = [], 0
  while i < len(lines):
    if lines[i].strip() == "```python":
      start = i + 1
      end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
      prev = lines[i - 1].strip() if i else ""
      m = SKIP.match(prev)
      if prev.startswith("<!-- readme-test") and not m:
        raise ValueError(f"README.md:{i}: malformed skip marker {prev!r}; "
                         "write <!-- readme-test: skip (reason) -->")
      blocks.append((start + 1, "\n".join(lines[start:end]), m and m["reason"]))
      i = end
    i += 1
  return blocks


def test_the_extractor():
  text = "\n".join([
      "```python", "a = 1", "```", "text", "```bash", "ls", "```",
      "<!-- readme-test: skip (needs a GPU) -->", "```python", "b = 2", "```"])
  assert python_blocks(text) == [(2, "a = 1", None), (10, "b = 2", "needs a GPU")]
  with pytest.raises(ValueError, match="malformed"):
    python_blocks("<!-- readme-test: skip -->\n```python\nx\n```")


@pytest.mark.skipif(jax.device_count() < 8, reason="the sharding block needs 8 devices")
def test_readme_python_blocks_run():
  blocks = python_blocks(README.read_text())
  assert len(blocks) >= 5  # API, jit, controls, Flax, sharding
  ns: dict = {"__name__": "readme"}
  ran = 0
  for line, code, skip in blocks:
    if skip:
      continue
    try:
      exec(compile(code, f"README.md:{line}", "exec"), ns)
    except Exception as e:
      raise AssertionError(f"the README's python block at line {line} fails: "
                           f"{type(e).__name__}: {e}") from e
    ran += 1
  assert ran == len(blocks), "a block is skipped: prefer making it runnable"
  # What the sharding block computes is what it says: the unsharded tokens.
  tokens = np.asarray(ns["tokens"])
  want = fs.reference.sample(np.asarray(ns["hidden"]), np.asarray(ns["W"]),
                             ns["key"])
  np.testing.assert_array_equal(tokens, want)


def _documented_static_argnames() -> tuple[str, ...]:
  text = README.read_text()
  m = re.search(r"jax\.jit\(fs\.sample, static_argnames=\((?P<names>[^)]*)\)\)", text)
  assert m, "the README no longer shows jax.jit(fs.sample, static_argnames=(...))"
  return tuple(re.findall(r'"(\w+)"', m["names"]))


def test_documented_static_argnames_are_every_non_array_option():
  names = _documented_static_argnames()
  params = inspect.signature(fs.sample).parameters
  assert set(names) <= set(params), set(names) - set(params)
  assert set(names) == {"weight_layout", "vocab_size", "backend", "vocab_axis",
                        "batch_axis", "num_samples", "return_logprobs",
                        "top_logprobs", "truncation_order", "return_entropy",
                        "return_raw_logprobs", "return_kept", "top_logprobs_mode"}
  if hasattr(fs, "STATIC_ARGNAMES"):  # once the package exports the list
    assert set(names) == set(fs.STATIC_ARGNAMES)


def test_jit_with_the_documented_static_argnames():
  # Every option at once, with the traceable ones traced: the jitted call
  # returns what the plain call returns.
  b, d, v, rows = 6, 32, 200, 256
  h, w = inputs.exact_inputs(b, d, rows, layout="dv", seed=30)
  key = jax.random.key(30)
  kw = dict(temperature=inputs.pow2_temperatures(b, greedy_every=3, seed=30),
            top_k=jnp.full((b,), 20), top_p=0.9, min_p=0.01,
            logit_bias=jnp.zeros((v,), jnp.float32).at[3].set(2.0),
            allowed_mask=jnp.full((b, -(-v // 32)), 0xFFFFFFFF, jnp.uint32),
            softcap=20.0)
  static = dict(weight_layout="dv", vocab_size=v, backend="xla", num_samples=2,
                return_logprobs=True)
  jitted = jax.jit(fs.sample, static_argnames=_documented_static_argnames())
  got = jitted(h, w, key, **kw, **static)
  want = fs.sample(h, w, key, **kw, **static)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.logprob, want.logprob)
  np.testing.assert_array_equal(
      got.tokens, fs.reference.sample(h, w, key, **kw, **static).tokens)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_jit_with_static_mesh_axes_inside_shard_map():
  from jax.sharding import AxisType, PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
  h, w = inputs.exact_inputs(4, 32, 512, seed=31)
  key = jax.random.key(31)
  jitted = jax.jit(fs.sample, static_argnames=_documented_static_argnames())
  f = lambda h, w, k: jitted(h, w, k, vocab_axis="tp", batch_axis="dp")[None]
  got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("dp", None), P("tp", None), P()),
                              out_specs=P("tp", "dp"), check_vma=False))(h, w, key)
  for row in np.asarray(got):  # every vocabulary shard returns the same tokens
    np.testing.assert_array_equal(row, fs.reference.sample(h, w, key))


def test_allowed_mask_shape_is_as_documented():
  # The README says [B, ceil(vocab_size / 32)]: with padded weight rows that
  # differs from ceil(rows / 32), and only the documented shape is accepted.
  text = README.read_text()
  assert "ceil(vocab_size / 32)" in text and "ceil(V/32)" not in text
  b, d, v, rows = 3, 16, 100, 160  # ceil(100/32) = 4 words, ceil(160/32) = 5
  h, w = inputs.exact_inputs(b, d, rows, seed=32)
  key = jax.random.key(32)
  ok = jnp.full((b, 4), 0xFFFFFFFF, jnp.uint32)
  np.testing.assert_array_equal(fs.sample(h, w, key, vocab_size=v, allowed_mask=ok),
                                fs.reference.sample(h, w, key, vocab_size=v))
  with pytest.raises(ValueError, match=r"allowed_mask\.shape=\(3, 5\)"):
    fs.sample(h, w, key, vocab_size=v, allowed_mask=jnp.full((b, 5), 1, jnp.uint32))
