"""compute-sanitizer over every kernel schedule (GPU suite, marked ``gpu``).

memcheck, racecheck and synccheck run benchmarks/sanitize_kernels.py, which
launches each schedule of the sampling kernel, the controls kernel and the
Triton kernels on small problems and checks their tokens. The sanitizer is
filtered to this package's kernels (``--kernel-name kns=flashsample``): a
whole JAX process under racecheck crashed the tool. XLA's GEMM autotuning is
off (``--xla_gpu_autotune_level=0``): on an H200 racecheck failed inside
XLA's autotuner ("Internal Sanitizer Error: failed to handle a hardware
exception") before any kernel of ours ran. Skipped where compute-sanitizer is
missing. Logs go to ``$FSJ_SANITIZER_LOGS`` when set.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import is_sm90

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not shutil.which("compute-sanitizer"), reason="no compute-sanitizer")
@pytest.mark.skipif(not is_sm90(), reason="the Mosaic GPU kernels need an sm90 GPU")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_sanitizer_finds_no_errors(tool):
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip(),
             PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
  r = subprocess.run(
      ["compute-sanitizer", "--tool", tool, "--kernel-name", "kns=flashsample",
       "--error-exitcode", "3", sys.executable, "-m", "benchmarks.sanitize_kernels"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  out = r.stdout + r.stderr
  log = os.environ.get("FSJ_SANITIZER_LOGS")
  if log:
    os.makedirs(log, exist_ok=True)
    with open(os.path.join(log, f"sanitizer_{tool}.log"), "w") as fh:
      fh.write(out)
  assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
  assert r.returncode == 0, out[-4000:]
  assert "DIFFER" not in out, out[-4000:]
