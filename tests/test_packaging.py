"""Packaging: the license and metadata in pyproject.toml, and ./run's interpreter check."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
  return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_string_with_its_file():
  # A TOML-table license makes setuptools >= 77 print a deprecation warning on
  # every install; the SPDX string + license-files needs setuptools >= 77.
  cfg = _pyproject()
  assert cfg["project"]["license"] == "Apache-2.0"
  assert cfg["project"]["license-files"] == ["LICENSE"]
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
  assert "setuptools>=77" in cfg["build-system"]["requires"]
  # PEP 639: a license expression excludes License :: classifiers.
  assert not [c for c in cfg["project"]["classifiers"] if c.startswith("License ::")]


def test_extras():
  extras = _pyproject()["project"]["optional-dependencies"]
  assert extras["flax"] == ["flax>=0.12"]
  assert extras["triton"] == ["jax-triton==0.3.1", "triton>=3.6,<3.7"]
  assert any(d.startswith("hypothesis") for d in extras["test"])


def _fake_python(tmp_path, version):
  """An executable that answers like a Python of ``version`` would."""
  major, minor = version
  exe = tmp_path / f"python{major}.{minor}"
  exe.write_text(
      "#!/bin/sh\n"
      f'if [ "$1" = --version ]; then echo "Python {major}.{minor}.0"; exit 0; fi\n'
      # Any -c program: the version check, which an old Python fails.
      f"exit {0 if version >= (3, 12) else 1}\n")
  exe.chmod(0o755)
  return exe


@pytest.mark.parametrize("python", ["old", "missing"])
def test_run_refuses_a_bad_PYTHON(tmp_path, python):
  exe = _fake_python(tmp_path, (3, 11)) if python == "old" else tmp_path / "nope"
  # FSJ_VENV points at a venv that does not exist: were the check skipped,
  # ./run would start creating it, which the assertions below would catch.
  env = dict(os.environ, PYTHON=str(exe), FSJ_VENV=str(tmp_path / "venv"))
  out = subprocess.run([str(ROOT / "run"), "setup"], env=env, capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 1
  assert f"error: PYTHON={exe}" in out.stderr and ">= 3.12" in out.stderr
  if python == "old":
    assert "Python 3.11.0" in out.stderr
  assert not (tmp_path / "venv").exists()
