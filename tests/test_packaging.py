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


def test_demo_extra_is_lean_and_pins_the_tested_jax():
  # ./run demo installs only this extra (.venv-demo): the jax ./run test
  # runs on, nothing of the test environment's (triton alone is 641 MB).
  extras = _pyproject()["project"]["optional-dependencies"]
  test_pins = {d for d in extras["test"] if d.split("==")[0] in ("jax", "jaxlib")}
  assert set(extras["demo"]) == test_pins and len(test_pins) == 2
  run = (ROOT / "run").read_text()
  assert 'setup_demo; exec "$DEMO_VENV/bin/python" examples/demo.py' in run


def test_every_slow_entry_names_a_test():
  # tests/conftest.py's SLOW and CI_LONG: an entry that names no test
  # (renamed, moved) would quietly put nothing in ./run test-long, or take
  # a test out of CI that was meant to stay.
  import importlib
  from tests.conftest import CI_LONG, SLOW, is_deep, is_slow
  # CI runs the long tests but the deep ones, and the README's command.
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert ("step ./run test-long -m 'slow and not deep' || rc=$?" in ci
          and ci[-2:] == ["./run test || rc=$?", 'exit "$rc"'])
  # Each CI_LONG entry holds long tests (a file's: those of SLOW in it),
  # and they are not deep.
  for entry in CI_LONG:
    held = [s for s in SLOW if s == entry or s.startswith(entry + "::")] or [entry]
    assert all(is_slow(s) and not is_deep(s) for s in held), entry
  for entry in SLOW + CI_LONG:
    path, *names = entry.split("::")
    names = [n.split("[")[0] for n in names]   # a parametrization: its test
    assert (ROOT / path).is_file(), entry
    if not names:
      continue
    source = (ROOT / path).read_text()
    if f"def {names[0]}(" not in source:
      # Not a plain test function: a class's (maybe inherited) test; import
      # its module (test modules import nothing heavier than the suite's).
      obj = importlib.import_module(path[:-3].replace("/", "."))
      for name in names:
        obj = getattr(obj, name, None)
        assert obj is not None, entry


def test_every_ci_case_names_a_collected_case():
  # tests/conftest.py's CI_CASES: a case id that names no parametrization
  # (renamed, re-parametrized) would take its whole test out of CI.
  import subprocess
  import sys
  from tests.conftest import CI_CASES
  out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *CI_CASES], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  collected = set(out.stdout.split())
  for test, kept in CI_CASES.items():
    missing = [c for c in kept if f"{test}[{c}]" not in collected]
    assert not missing, (test, missing, out.stdout[-2000:], out.stderr[-2000:])


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


def _source_modules():
  """Every module of the two packages, as paths inside a wheel."""
  return sorted(str(p.relative_to(ROOT)) for pkg in ("flashsample_jax", "pallas_kernels")
                for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def test_wheel_holds_every_module(tmp_path):
  # The wheel users install, built from a copy of the sources (no build
  # files left in the checkout): every module of every subpackage, which a
  # list of top-level packages once missed (flashsample_jax.backends).
  import shutil
  import sys
  import zipfile
  src = tmp_path / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, src / name)
  for pkg in ("flashsample_jax", "pallas_kernels"):
    shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
  out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  (wheel,) = (tmp_path / "dist").glob("flashsample_jax-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  modules = _source_modules()
  assert "flashsample_jax/backends/__init__.py" in modules
  assert [m for m in modules if m not in names] == []
  # Nothing but the two packages and the metadata.
  assert {n.split("/")[0] for n in names} == {
      "flashsample_jax", "pallas_kernels", wheel.name.split("-py3")[0] + ".dist-info"}
