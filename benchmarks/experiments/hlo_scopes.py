"""Which code each kernel of a compiled program comes from.

A profiler trace names a call's kernels by XLA's fusions (``loop_select_fusion_4``,
``input_reduce_fusion_10``); the compiled module's text holds the same names, and each
fused instruction's ``op_name`` carries the JAX named scopes it was traced under (stage 2's
steps are scoped: ``stage2.certify``, ``controls.prefix_sums``, ...). So a trace's kernel
times map onto the package's functions without a guess:

  python3 -m benchmarks.experiments.exp_dense_lists --heads S --batches 1 --weight-dtypes fp8
      --variants dense_kernel --timeline --scopes

:func:`kernel_scopes` reads the text of ``jax.jit(f).lower(...).compile().as_text()``.
"""

from __future__ import annotations

import collections
import re

# `%name = <type> <opcode>(` at the start of an instruction (ROOT or not).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\(")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=%([\w.\-]+)")
_BODY = re.compile(r"body=%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# Instructions that launch nothing of their own.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start",
         "copy-done", "after-all", "opt-barrier"}


def computations(text: str) -> tuple[dict[str, list[str]], str]:
  """The module's computations, ``{name: instruction lines}``, and the
  entry's name."""
  comps, entry, name = {}, None, None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      name = m.group(2)
      comps[name] = []
      if m.group(1):
        entry = name
    elif name is not None and line.strip() == "}":
      name = None
    elif name is not None:
      comps[name].append(line)
  return comps, entry


def scope_of(op_name: str) -> str:
  """``op_name`` without its ``jit(...)`` frames and its primitive: the
  named scopes it was traced under (``""``: none)."""
  parts = [p for p in op_name.split("/") if not p.startswith("jit(")]
  return "/".join(parts[:-1])


def _scopes(lines: list[str]) -> collections.Counter:
  found = (_OP_NAME.search(line) for line in lines)
  return collections.Counter(s for s in (scope_of(m.group(1)) for m in found if m) if s)


def kernel_scopes(text: str, top: int = 4) -> list[dict]:
  """One entry per instruction of the entry computation (and of the
  conditionals' branches and loops' bodies it reaches) that launches work:
  ``kernel`` (the name a trace shows), ``opcode`` (``fusion``,
  ``custom-call``, ...), ``where`` (``entry`` or the branch / body
  computation) and ``scopes``: the ``top`` named scopes of its fused
  instructions with their counts (most first)."""
  comps, entry = computations(text)
  out = []

  def walk(comp: str, where: str):
    for line in comps.get(comp, []):
      m = _INSTRUCTION.match(line)
      if not m or m.group(2) in _FREE:
        continue
      name, opcode = m.groups()
      if opcode in ("conditional", "while"):
        called = []
        for b in _BRANCHES.finditer(line):
          called += [c.strip().lstrip("%") for c in (b.group(1) or b.group(2)).split(",")]
        called += _BODY.findall(line)
        out.append(dict(kernel=name, opcode=opcode, where=where, scopes=[]))
        for c in called:
          walk(c, c)
        continue
      calls = _CALLS.search(line)
      lines = comps.get(calls.group(1), []) if calls else [line]
      scopes = _scopes(lines) or _scopes([line])
      found = dict(kernel=name, opcode=opcode, where=where,
                    scopes=[[s, n] for s, n in scopes.most_common(top)])
      target = _TARGET.search(line)
      if target:
        found["target"] = target.group(1)
      out.append(found)

  walk(entry, "entry")
  return out
