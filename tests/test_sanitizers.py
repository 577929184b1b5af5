"""compute-sanitizer over every kernel schedule (GPU suite, marked ``gpu``).

memcheck, racecheck and synccheck each run benchmarks/sanitize_kernels.py
once per group of kernels (the Mosaic sampling kernel's schedules, the Mosaic
controls kernel, the Triton kernels): small exact problems, tokens and
log-probabilities checked against the reference computed on the CPU, so that
the only GPU work under the sanitizer is our kernels. The command line and
environment come from :func:`benchmarks.sanitize_kernels.sanitizer_command` /
``sanitizer_env``, the verdict from ``summarize``: the very ones
``benchmarks/sanitize.sh`` uses. The sanitizer is filtered to our kernels'
CUDA names (a whole JAX process under racecheck crashed the tool; XLA's GEMM
autotuner crashed it on an H200): the Mosaic kernels contain
``flashsample``, the Triton ones are named after their Python functions
(``_sampler_kernel``, ``_controls_kernel``), which the CPU tests below keep in
the filter. Skipped without compute-sanitizer or an sm90 GPU. Logs go to
``$FSJ_SANITIZER_LOGS`` when set; ``$FSJ_SANITIZER_TIMEOUT`` seconds per run
(default 420).
"""

import importlib.util
import os

import pytest

from benchmarks import sanitize_kernels as sk
from tests.conftest import is_sm90

TIMEOUT = float(os.environ.get("FSJ_SANITIZER_TIMEOUT", sk.DEFAULT_TIMEOUT))


@pytest.mark.gpu
@pytest.mark.skipif(not sk.find_sanitizer(), reason="no compute-sanitizer")
@pytest.mark.skipif(not is_sm90(), reason="the Mosaic GPU kernels need an sm90 GPU")
@pytest.mark.parametrize("group", sk.GROUPS)
@pytest.mark.parametrize("tool", sk.TOOLS)
def test_sanitizer_finds_no_errors(tool, group, tmp_path):
  if group == "triton" and importlib.util.find_spec("jax_triton") is None:
    pytest.skip("jax_triton is not installed")
  log_dir = os.environ.get("FSJ_SANITIZER_LOGS") or str(tmp_path)
  passed, line = sk.run_sanitizer(tool, group, log_dir, timeout=TIMEOUT)
  with open(sk.log_path(log_dir, tool, group), errors="replace") as fh:
    tail = fh.read()[-4000:]
  assert passed, f"{line}\n{tail}"


# -- on the CPU: what the GPU runs rely on ------------------------------------


def test_every_kernel_is_in_the_sanitizer_filter():
  triton = importlib.util.find_spec("triton") is not None
  assert sorted(sk.mosaic_kernel_names()) == sorted(
      f"flashsample_sm90{n}_mosaic_gpu_kernel"
      for n in ("", "_controls", "_tempered_rows", "_top_lists", "_exact_top", "_slots"))
  assert sk.unfiltered_kernels(triton=triton) == []


def test_mosaic_host_function_is_named_after_kernel_name():
  # MLIR's gpu-kernel-outlining names the CUDA kernel <function>_kernel, the
  # function holding the launch being <kernel_name>_mosaic_gpu.
  import jax
  import jax.numpy as jnp

  from flashsample_jax import problem
  from flashsample_jax.backends.mosaic import MosaicBackend, h100_lowering
  h = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((200, 64), jnp.bfloat16)

  def f(h, w, key):
    return MosaicBackend(assume_sm90=True).candidates(problem.prepare(h, w, key))

  with h100_lowering():
    text = jax.jit(f).trace(h, w, jax.random.key(0)).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "flashsample_sm90_mosaic_gpu" in text
  assert "flashsample_sm90_mosaic_gpu_kernel" in sk.mosaic_kernel_names()


def test_triton_cuda_entry_is_the_function_name():
  # What jax_triton launches is Triton's metadata["name"], the PTX .entry.
  pytest.importorskip("triton")
  import jax.numpy as jnp

  from pallas_kernels import triton_sampler as ts
  cfg = ts.pick_config(24, 256, 1000, (9, 0))
  compiled = ts.sampler_for_inspection(cfg, layout="vd", dtype=jnp.bfloat16, batch=24,
                                       dim=256, rows=1000)
  assert compiled.metadata.name == "_sampler_kernel"
  assert compiled.metadata.name in sk.triton_kernel_names()


def test_the_slot_lists_case_runs_the_entry_kernel():
  # The case is there for the slot lists' kernels: its call must take that
  # route (MosaicBackend.slot_lists), whatever thresholds move.
  import jax

  case = next(c for c in sk.all_cases() if c.name == "slot_lists_fp8")
  with jax.default_device(jax.devices("cpu")[0]):
    p, c = sk.case_problem(case, *sk.case_inputs(case))
  assert p.quantized and case.group == "triton"
  assert sk.case_backend(case, interpret=True).slot_lists(p, c)


def test_command_lines():
  ports = set()
  for tool in sk.TOOLS:
    for group in sk.GROUPS:
      cmd = sk.sanitizer_command(tool, group, sanitizer="cs", python="py")
      assert cmd[:3] == ["cs", "--tool", tool]
      assert cmd[-5:] == ["py", "-m", "benchmarks.sanitize_kernels", "--only", group]
      filters = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kernel-name"]
      assert filters == list(sk.KERNEL_FILTERS)
      ports.add(cmd[cmd.index("--port") + 1])
  assert len(ports) == len(sk.TOOLS) * len(sk.GROUPS)
  env = sk.sanitizer_env({"XLA_FLAGS": "--xla_gpu_autotune_level=4 --foo=1",
                          "PYTHONPATH": "/x", "TRITON_CACHE_DIR": "/t"})
  assert env["XLA_FLAGS"].split() == ["--foo=1", *sk.XLA_FLAGS]
  assert env["PYTHONPATH"] == os.pathsep.join([sk.ROOT, "/x"])
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert env["JAX_ENABLE_COMPILATION_CACHE"] == "false"


_CASES = ("case mosaic_plain/a [B=24 vd]: tokens ok (1.0 s)\n"
          "case mosaic_plain/b [B=24 dv]: tokens ok (1.0 s)\n"
          "sanitize_kernels: done: 2 cases, 2 ok, 0 DIFFER, 0 ERROR\n")


@pytest.mark.parametrize("tool,text,rc,passed", [
    ("memcheck", _CASES + "========= ERROR SUMMARY: 0 errors\n", 0, True),
    ("synccheck", _CASES + "========= ERROR SUMMARY: 2 errors\n", 3, False),
    ("racecheck", _CASES + "========= RACECHECK SUMMARY: 0 hazards displayed "
     "(0 errors, 0 warnings)\n", 0, True),
    ("racecheck", _CASES + "========= RACECHECK SUMMARY: 1 hazard displayed "
     "(0 errors, 1 warning)\n", 0, False),
    ("memcheck", _CASES, 0, False),                              # no summary
    ("memcheck", _CASES.replace("b [B=24 dv]: tokens ok", "b [B=24 dv]: tokens DIFFER")
     + "========= ERROR SUMMARY: 0 errors\n", 1, False),
    ("memcheck", _CASES.splitlines(True)[0] + "========= ERROR SUMMARY: 0 errors\n",
     124, False),                                                # stopped early
    ("memcheck", _CASES + "========= Internal Sanitizer Error: x\n"
     "========= ERROR SUMMARY: 0 errors\n", 0, False),
])
def test_summary(tool, text, rc, passed):
  got, line = sk.summarize(tool, "mosaic_plain", text, rc, 1.0)
  assert got == passed, line
  assert line.split()[:3] == [tool, "mosaic_plain", "PASS" if passed else "FAIL"]
