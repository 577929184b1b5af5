"""Executes every notebook under notebooks/ on the CPU, so they never rot.

The kernel is this interpreter (``sys.executable``) through a kernel spec
written to a temporary directory: an installed ``python3`` spec often runs
whatever ``python`` is first on ``PATH``, which need not have jax (a CI venv
that is not activated). The repository root goes on the kernel's
``PYTHONPATH``; ``JAX_PLATFORMS=cpu``.

To refresh the committed outputs after editing a notebook:

  python tests/test_notebooks.py notebooks/correctness.ipynb ...   # or no args: all
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = f"flashsample-test-py{sys.version_info[0]}{sys.version_info[1]}"


@contextlib.contextmanager
def _kernel_env(extra_env: dict[str, str] | None = None):
  """A kernel spec named KERNEL running sys.executable, and the kernel's env."""
  tmp = Path(tempfile.mkdtemp(prefix="fsj-kernel-"))
  spec = tmp / "kernels" / KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": f"Python {sys.version_info[0]}.{sys.version_info[1]} (tests)",
      "language": "python",
  }))
  saved = dict(os.environ)
  os.environ["JUPYTER_PATH"] = os.pathsep.join(
      [str(tmp), *filter(None, [saved.get("JUPYTER_PATH")])])
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT), *filter(None, [saved.get("PYTHONPATH")])])
  os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
  os.environ.update(extra_env or {})
  try:
    yield
  finally:
    os.environ.clear()
    os.environ.update(saved)
    shutil.rmtree(tmp, ignore_errors=True)


def execute(path: Path, *, extra_env: dict[str, str] | None = None, timeout: int = 300):
  """Runs the notebook at ``path`` top to bottom; returns the executed notebook."""
  import nbformat
  from nbclient import NotebookClient

  nb = nbformat.read(path, as_version=4)
  with _kernel_env(extra_env):
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=timeout,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
  # Keep the committed notebooks' kernelspec the generic one users have.
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                               "language": "python"}
  return nb


def _errors(nb) -> list[str]:
  return [f"cell {i}: {o.get('ename')}: {o.get('evalue')}"
          for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
          for o in cell.get("outputs", []) if o.get("output_type") == "error"]


def test_every_notebook_is_tested():
  assert {p.name for p in NOTEBOOKS} >= {
      "correctness.ipynb", "performance.ipynb", "sharding.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
  nb = execute(path)
  assert not _errors(nb)


def test_committed_notebooks_have_outputs():
  import nbformat
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{path.name} is not executed"
    assert not _errors(nb), path.name


def _write_perf_fixtures(out: Path) -> None:
  """Made-up results in each layout the performance notebook's loader accepts."""
  bs = [1, 4, 16, 64]
  meta = {"gpu": "Test GPU", "jax_version": "0.11.2", "date": "2026-01-01T00:00:00+00:00"}
  # benchmarks/bench_sampler.py's layout: flat meta, "rows", batch "B", a floor
  # column and a provider that failed (None).
  (out / "sampler_test-wide.json").write_text(json.dumps({
      "gpu": "Test GPU", "jax": "0.11.2", "date": "2026-01-01T00:00:00+00:00",
      "read_bandwidth_Bps": 3.06e12, "shapes": {"S": [4096, 151936]}, "rows": [
          {"shape": s, "D": 4096, "V": 151936, "B": b, "floor_us": 407.0,
           "mosaic_us": 410.0 + b, "mosaic_samples": [410.0, 411.0],
           "xla_baseline_us": 430.0 + 2 * b, "xla_us": None}
          for s in ("S", "L") for b in bs]}))
  # Long records (provider + median_us), a bare list, floor as a provider.
  (out / "sampler_test-long.json").write_text(json.dumps([
      {"shape": "S", "batch": b, "provider": p, "median_us": us}
      for b in bs for p, us in (("fused", 420 + b), ("xla", 440 + b), ("floor", 407))]))
  # bench_sharded.py's layout.
  (out / "sharded_test_L_tp1-2-4.json").write_text(json.dumps({"meta": {**meta, "shape": "L"},
      "results": [{"tp": n, "batch": b, "backend": "xla", "fused_us": 500 / n + 20,
                   "gather_us": 500 / n + 80, "matmul_us": 490 / n,
                   "goal_us": 1.2 * 520 / n + 30 if n > 1 else 654}
                  for n in (1, 2, 4) for b in (16, 64, 256)]}))
  # bench_e2e.py's layout.
  (out / "e2e_test.json").write_text(json.dumps({**meta, "rows": [
      {"config": c, "batch": b, "sampler": s, "tpot_ms": t * (1.0 if s == "fused" else 1.05)}
      for c, t in (("qwen3-1.7b", 1.4), ("qwen3-8b", 6.0)) for b in bs
      for s in ("fused", "xla")]}))
  (out / "sampler_broken.json").write_text("{not json")


def test_performance_notebook_plots_results(tmp_path):
  # Synthetic results files in the schemas the notebook's loader accepts, so
  # the plotting paths run even before the GPU benchmarks are committed.
  _write_perf_fixtures(tmp_path)
  nb = execute(ROOT / "notebooks" / "performance.ipynb",
               extra_env={"FSJ_RESULTS_DIR": str(tmp_path)})
  assert not _errors(nb)
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")
  assert "MISSING" not in text and "skipping sampler_broken.json" in text, text
  images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []))
  assert images >= 4  # two sampler files, one sharded, one e2e


if __name__ == "__main__":
  import nbformat
  targets = [Path(a).resolve() for a in sys.argv[1:]] or NOTEBOOKS
  for p in targets:
    nb = execute(p)
    errs = _errors(nb)
    nbformat.write(nb, p)
    print(f"{p.relative_to(ROOT)}: {'ERRORS ' + '; '.join(errs) if errs else 'ok'}")
