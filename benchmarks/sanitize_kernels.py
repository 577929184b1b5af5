"""compute-sanitizer (memcheck, racecheck, synccheck) over every kernel schedule.

Two roles, one module, so that ``benchmarks/sanitize.sh`` and
``tests/test_sanitizers.py`` run the very same command lines:

* **The host program** the sanitizer watches. It launches each schedule of
  the Mosaic GPU sampling kernel, the Mosaic GPU controls kernel and the
  Triton kernels once, on small exact problems, and checks their tokens (and
  log-probabilities) against ``flashsample_jax.reference`` computed on the
  **CPU device**: under the sanitizer the only GPU work is our kernel
  launches, the few XLA fusions around them inside the same jitted call, and
  the transfers. No reference, stage 2 or GEMM runs on the GPU, so no cuBLAS
  or XLA GEMM module is ever loaded there (racecheck crashed inside XLA's GEMM
  autotuner before; memcheck and synccheck of the old all-on-GPU program did
  not finish in 9 minutes)::

      python3 -m benchmarks.sanitize_kernels --list
      python3 -m benchmarks.sanitize_kernels --only mosaic_plain      # a group
      python3 -m benchmarks.sanitize_kernels --only mosaic_plain/cooperative_2wg,triton
      python3 -m benchmarks.sanitize_kernels --dry-run                # CPU references only
      python3 -m benchmarks.sanitize_kernels --interpret --only mosaic_plain
                                     # Mosaic cases in Pallas' GPU interpreter on the CPU

* **The driver**: ``--sanitize TOOL GROUP --log-dir DIR`` runs the host
  program for one group under ``compute-sanitizer --tool TOOL`` (command from
  :func:`sanitizer_command`, environment from :func:`sanitizer_env`), with a
  time limit, writes ``DIR/sanitizer_<tool>_<group>.log`` and prints one
  summary line (:func:`summarize`); exit status 0 iff it passed.
  ``--commands`` prints every command line.

Kernel names (what ``--kernel-name`` matches: a substring of the *mangled*
name; all of ours are unmangled ``extern "C"``-style entries):

* Mosaic GPU: ``plgpu.kernel(kernel_name=...)`` names the host function
  ``<kernel_name>_mosaic_gpu`` (jax/experimental/mosaic/gpu/core.py), and
  MLIR's ``gpu-kernel-outlining`` pass names the CUDA kernel after its parent
  function plus ``_kernel``: ``flashsample_sm90_mosaic_gpu_kernel`` and
  ``flashsample_sm90_controls_mosaic_gpu_kernel``. (Checked on the CPU: the
  lowered module's function is ``flashsample_sm90_mosaic_gpu``.)
* Triton through jax_triton: the CUDA entry is Triton's kernel name, the
  Python function's own name (``metadata["name"]`` from the PTX ``.entry``;
  Triton 3.6 keeps the part of ``module.qualname`` after the last dot), and
  ``triton_call(name=...)`` names only the XLA custom call. So the entries are
  ``_sampler_kernel``, ``_controls_kernel`` and ``_entry_lists_kernel`` (the
  slot lists' row kernel): ``kns=flashsample`` alone
  never checked them. :data:`KERNEL_FILTERS` lists them too (several
  ``--kernel-name`` options: a kernel matching any one is checked);
  :func:`check_kernel_filters` fails if a kernel's name leaves the filters.

Sanitizer options (each in the Compute Sanitizer 2025 manual): ``--tool``,
``--kernel-name`` (repeated), ``--target-processes application-only`` (no
injection into the ptxas/nvlink children of XLA and Triton),
``--report-api-errors no`` (CUDA API calls that XLA expects to fail are not
our kernels' errors; a failing launch of ours raises in the program),
``--show-backtrace device`` (host backtraces of a Python process say nothing),
``--launch-timeout``, ``--num-cuda-barriers`` (see :data:`SANITIZER_OPTIONS`),
``--port`` (a base port per tool and group: the runs go in parallel) and
``--error-exitcode``. Left at their defaults on purpose:
``--check-bulk-copy yes`` and ``--check-warpgroup-mma yes`` (the Hopper TMA
and wgmma checks our kernels need), ``--leak-check no``, racecheck's
``--racecheck-report analysis``. Not used: ``--check-device-heap no`` (only
kernels that call ``malloc()`` are affected: none of ours),
``--check-api-memory-access`` (an initcheck option now), ``--lazy-patching``
(not in the current manual).

Environment (:func:`sanitizer_env`): XLA autotuning off
(``--xla_gpu_autotune_level=0``), no CUDA graphs
(``--xla_gpu_enable_command_buffer=``: plain launches), no preallocation and
the ``platform`` allocator (one ``cudaMalloc`` per buffer, so memcheck sees
each array's own bounds instead of one arena), JAX's compilation cache off,
lazy CUDA module loading.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOOLS = ("memcheck", "racecheck", "synccheck")
GROUPS = ("mosaic_plain", "mosaic_controls", "triton")

# Substrings of the CUDA kernel names to instrument (see the module docstring).
KERNEL_FILTERS = ("kns=flashsample", "kns=_sampler_kernel", "kns=_controls_kernel",
                  "kns=_entry_lists_kernel")

SANITIZER_OPTIONS = (
    "--target-processes", "application-only",
    "--report-api-errors", "no",
    "--show-backtrace", "device",
    "--launch-timeout", "120",
    # mbarriers tracked per block (racecheck, synccheck). 0 (the default)
    # takes the count from the compiler's information about cuda::barrier
    # objects, which PTX that keeps its mbarriers in dynamic shared memory
    # (Mosaic GPU, Triton) may not give: then "Detected overflow of tracked
    # cuda::barrier structures. Results might be incorrect". Ours use < 32.
    "--num-cuda-barriers", "64",
    "--error-exitcode", "3",
)
# The driver's own additions to the environment of the sanitized program.
XLA_FLAGS = ("--xla_gpu_autotune_level=0", "--xla_gpu_enable_command_buffer=")
ENV = {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "XLA_PYTHON_CLIENT_ALLOCATOR": "platform",
    "JAX_ENABLE_COMPILATION_CACHE": "false",
    "CUDA_MODULE_LOADING": "LAZY",
    "PYTHONUNBUFFERED": "1",
}
DEFAULT_TIMEOUT = 420

# Problem size of every case: D = 256 gives 4 pipeline steps of Dt = 64 (slot
# reuse), V = 1000 is a multiple of no tile (a partial last tile).
D, V = 256, 1000
# Weight rows of the list kernels' cases: 520 tiles of 128 ids, the last
# partial (lists of 64 need 8 x 64 tiles).
LISTS_ROWS = 128 * 520 - 37
# CTAs of the Mosaic persistent grids: 8 or 16 tiles over 3 CTAs, so every
# CTA runs several tiles, unevenly (slot and warpgroup hand-over across
# tiles is where races would be).
MOSAIC_CTAS = 3


# -- the cases -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel launch (plain) or one controls call.

  ``controls`` holds ``sample()``'s control arguments as sorted pairs;
  ``logit_bias`` / ``allowed_mask`` are ``True`` there and made from the seed.
  """

  group: str
  name: str
  batch: int
  layout: str = "vd"
  per_row_keys: bool = False
  rows: int = V
  vocab_size: int = V
  weight_dtype: str = "bfloat16"
  via: str = ""   # the backend when not the group's ("mosaic")
  controls: tuple = ()
  config: object = None  # a sm90_config.TuningConfig (mosaic plain), else None
  scale: int = 3
  seed: int = 0

  @property
  def full_name(self) -> str:
    return f"{self.group}/{self.name}"

  @property
  def backend(self) -> str:
    return self.via or ("triton" if self.group == "triton" else "mosaic")

  @property
  def kind(self) -> str:
    return "controls" if self.controls else "plain"

  def describe(self) -> str:
    kw = " ".join(f"{k}={v}" for k, v in self.controls)
    keys = "row keys" if self.per_row_keys else "one key"
    s = f"B={self.batch} {self.layout} vocab_size={self.vocab_size} {keys}"
    if self.rows != V:
      s += f" rows={self.rows}"
    if self.weight_dtype != "bfloat16":
      s += f" {self.weight_dtype} per-row scales"
    if self.via:
      s += f" backend={self.via}"
    s += f" {kw}" if kw else ""
    if self.config is not None:
      cfg = self.config
      diff = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
              if getattr(cfg, f.name) != f.default]
      s += f" config({', '.join(diff)})".replace("Schedule.", "")
    return s


def _mosaic_plain_configs():
  from pallas_kernels.sm90_config import Schedule, TuningConfig
  # One config per schedule and pass structure of the sampling kernel.
  return {
      "cooperative_1wg": TuningConfig(tile_v=64, tile_d=64, max_concurrent_steps=2,
                                      epi_cols=8),
      "cooperative_2wg": TuningConfig(tile_v=128, tile_d=64, max_concurrent_steps=2,
                                      epi_cols=8, compute_wgs=2, epi_passes=2),
      "pingpong_vocab_m": TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M, tile_v=128,
                                       tile_d=64, max_concurrent_steps=2, epi_cols=16,
                                       mma_in_flight=0),
      "pingpong_vocab_m_passes": TuningConfig(schedule=Schedule.PINGPONG_VOCAB_M,
                                              tile_v=64, tile_d=64,
                                              max_concurrent_steps=3, epi_cols=16,
                                              epi_passes=2),
      "pingpong_batch_m": TuningConfig(schedule=Schedule.PINGPONG_BATCH_M, tile_v=128,
                                       tile_d=64, max_concurrent_steps=2, epi_cols=16),
      "pingpong_batch_m_128": TuningConfig(schedule=Schedule.PINGPONG_BATCH_M,
                                           tile_v=128, tile_d=64,
                                           max_concurrent_steps=2, epi_cols=8,
                                           mma_in_flight=0),
  }


def _kw(**kw) -> tuple:
  return tuple(sorted(kw.items()))


# Every control, several samples, log-probabilities: 64-row launches of the
# Mosaic controls kernel; a Triton launch with top-K lists.
_TRUNCATING = _kw(top_k=5, top_p=0.9, softcap=8.0, num_samples=2,
                  return_logprobs=True, allowed_mask=True)
# One sample, no truncation: 128-row launches of the Mosaic controls kernel.
_WIDE = _kw(logit_bias=True, allowed_mask=True, return_logprobs=True)


def all_cases() -> list[Case]:
  cases = []
  # The sampling kernel: each schedule once, layouts, key kinds and a
  # padded vocabulary (vocab_size < rows) spread over them.
  from pallas_kernels.sm90_config import Schedule
  for i, (name, cfg) in enumerate(_mosaic_plain_configs().items()):
    wide = cfg.schedule is Schedule.PINGPONG_BATCH_M and cfg.epi_cols == 8
    cases.append(Case("mosaic_plain", name, batch=100 if wide else 24,
                      layout=("vd", "dv")[i % 2], per_row_keys=bool(i // 2 % 2),
                      vocab_size=V - 10 if i % 3 == 1 else V, config=cfg,
                      seed=10 + i))
  # The controls kernel: 64-row launches (truncation, 2 samples, soft-cap,
  # mask) and 128-row ones (bias, mask), then top_logprobs.
  cases.append(Case("mosaic_controls", "n64_truncating", batch=24, controls=_TRUNCATING,
                    scale=1, seed=20))
  cases.append(Case("mosaic_controls", "n128_bias_mask", batch=100, layout="dv",
                    per_row_keys=True, controls=_WIDE, scale=1, seed=21))
  # top_logprobs: the lists' selection kernel and the exact path's two
  # early-exit launches.
  cases.append(Case("mosaic_controls", "top_logprobs", batch=24,
                    controls=_kw(top_logprobs=20), scale=1, seed=22))
  # Triton: the plain kernel at a batch in each row of the sm90 config table
  # (1, <= 16, <= 32, <= 64, more), then the controls kernel (top-K lists;
  # 5 samples = launches of 4 and 1).
  for i, b in enumerate((1, 5, 24, 48, 100)):
    cases.append(Case("triton", f"plain_b{b}", batch=b, layout=("vd", "dv")[i % 2],
                      per_row_keys=bool(i // 2 % 2),
                      vocab_size=V - 10 if i % 3 == 1 else V, seed=30 + i))
  cases.append(Case("triton", "controls_truncating", batch=24, controls=_TRUNCATING,
                    scale=1, seed=40))
  cases.append(Case("triton", "controls_bias_mask_s5", batch=100, layout="dv",
                    per_row_keys=True, scale=1, seed=41,
                    controls=_kw(logit_bias=True, allowed_mask=True,
                                 return_logprobs=True, num_samples=5)))
  # The slot lists (jax-triton's entry kernel after the plain Mosaic kernel's
  # slot epilogue): an 8-bit head, every row truncating, up to 16 rows. Lists
  # of 64 need 8 x 64 tiles of 128 ids; the last tile is partial. (The dense
  # route's list kernels read XLA's GEMM, which this program keeps off the
  # GPU: not covered here.)
  cases.append(Case("triton", "slot_lists_fp8", batch=12, rows=LISTS_ROWS,
                    vocab_size=LISTS_ROWS, weight_dtype="float8_e4m3fn", via="mosaic",
                    scale=1, seed=42, controls=_kw(top_k=5, top_p=0.9)))
  return cases


def select(cases: list[Case], only: str | None) -> list[Case]:
  """The cases named by ``only``: comma-separated groups, ``group/name`` or
  bare case names (None: all)."""
  if not only:
    return cases
  chosen = []
  for item in filter(None, (s.strip() for s in only.split(","))):
    hit = [c for c in cases if item in (c.group, c.full_name, c.name)]
    if not hit:
      names = ", ".join([*GROUPS, *(c.full_name for c in cases)])
      raise SystemExit(f"--only: unknown {item!r}; choose from {names}")
    chosen += [c for c in hit if c not in chosen]
  return [c for c in cases if c in chosen]


# -- running one case ----------------------------------------------------------


def case_inputs(case: Case):
  """Host arrays and ``sample()`` keyword arguments of a case (on the
  current default device: the CPU)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from tests import inputs
  h, w = inputs.exact_inputs(case.batch, D, case.rows, layout=case.layout, seed=case.seed,
                             scale=case.scale)
  scale = None
  if case.weight_dtype != "bfloat16":
    import flashsample_jax as fs
    w, scale = fs.quantize_weight(w, case.weight_dtype, weight_layout=case.layout)
  key = (inputs.row_keys(case.batch, seed=case.seed) if case.per_row_keys
         else jax.random.key(case.seed))
  t = inputs.pow2_temperatures(case.batch, greedy_every=7, seed=case.seed)
  kw = dict(case.controls)
  r = np.random.default_rng(case.seed)
  if kw.get("logit_bias") is True:
    kw["logit_bias"] = jnp.asarray(r.integers(-2, 3, case.vocab_size), jnp.float32)
  if kw.get("allowed_mask") is True:
    words = (case.batch, -(-case.vocab_size // 32))
    # About 3 ids in 4 allowed.
    kw["allowed_mask"] = jnp.asarray(r.integers(0, 2**32, words, dtype=np.uint32)
                                     | r.integers(0, 2**32, words, dtype=np.uint32))
  return h, w, key, t, kw, scale


def _reference(case: Case, h, w, key, t, kw, scale):
  """``flashsample_jax.reference.sample`` (runs where its inputs live)."""
  import flashsample_jax as fs
  return fs.reference.sample(h, w, key, temperature=t, weight_layout=case.layout,
                             vocab_size=case.vocab_size, weight_scale=scale, **kw)


def case_backend(case: Case, interpret: bool):
  if case.backend == "mosaic":
    from flashsample_jax.backends.mosaic import MosaicBackend
    return MosaicBackend(config=case.config, num_sms=MOSAIC_CTAS,
                         interpret=True if interpret else None)
  from flashsample_jax.backends.triton import TritonBackend
  return TritonBackend()


def case_problem(case: Case, h, w, key, t, kw, scale):
  """The checked ``(Problem, Controls)`` of a case's call (on the current
  default device)."""
  from flashsample_jax import controls, problem
  p = problem.prepare(h, w, key, temperature=t, weight_layout=case.layout,
                      vocab_size=case.vocab_size, weight_scale=scale)
  c = controls.prepare_controls(batch=case.batch, vocab_size=case.vocab_size,
                                rows=p.weight_rows, **kw)
  return p, c


def _run_kernels(case: Case, h, w, key, t, kw, scale, *, cpu, device, interpret: bool):
  """The kernels' result: tokens ``[S, B]`` and the log-probabilities
  (a ``SampleOutput`` of ``[S, B]`` arrays) or None.

  The problem is prepared on the CPU and moved to ``device``; the kernel
  call is one jitted program there; stage 2 of a controls call (sorting,
  the exact fallback) runs on the CPU from the state the kernels wrote.
  """
  import jax

  from flashsample_jax import stage2
  backend = case_backend(case, interpret)
  with jax.default_device(cpu):
    p, c = case_problem(case, h, w, key, t, kw, scale)
  p_dev, c_dev = jax.device_put((p, c), device)
  if case.kind == "plain":
    _, token = jax.jit(lambda p: backend.candidates(p))(p_dev)
    return jax.device_get(token)[None], None
  st = jax.jit(lambda p, c: backend.controls_state(p, c))(p_dev, c_dev)
  with jax.default_device(cpu):
    tokens, out, _ = jax.jit(stage2.finish)(p, c, jax.device_put(st, cpu))
  return jax.device_get(tokens), (jax.device_get(out) if out is not None else None)


def _as_rows(x, samples: int | None):
  import numpy as np
  x = np.asarray(x)
  return x[None] if samples is None else x


def _compare(case: Case, got, want) -> str:
  """'' if the kernels' result equals the reference's, else why not."""
  import numpy as np
  samples = dict(case.controls).get("num_samples")
  got_tokens, got_lp = got
  want_tokens = _as_rows(getattr(want, "tokens", want), samples)
  if got_tokens.shape != want_tokens.shape:
    return f"token shape {got_tokens.shape} != reference {want_tokens.shape}"
  bad = np.argwhere(got_tokens != want_tokens)
  if bad.size:
    s, b = bad[0]
    return (f"{len(bad)}/{want_tokens.size} tokens differ, first (sample {s}, row "
            f"{b}): {got_tokens[s, b]} vs reference {want_tokens[s, b]}")
  if got_lp is not None:
    if got_lp.top_ids is not None and not np.array_equal(got_lp.top_ids, want.top_ids):
      return "top_ids differ"
    for name in ("logprob", "logprob_truncated", "logsumexp", "top_logprobs"):
      if getattr(got_lp, name) is None:
        continue
      a = np.asarray(getattr(got_lp, name))
      e = getattr(want, name)
      e = e if name == "top_logprobs" else _as_rows(e, samples)
      if not np.allclose(a, e, rtol=1e-4, atol=1e-4, equal_nan=True):
        i = np.unravel_index(np.nanargmax(np.abs(a - e)), a.shape)
        return f"{name} differs: {a[i]} vs reference {e[i]} at {tuple(map(int, i))}"
  return ""


def run_cases(cases: list[Case], *, dry_run: bool = False,
              interpret: bool = False) -> int:
  """Runs (or, dry, only prepares) each case; prints one line per case and a
  final ``sanitize_kernels: done`` line. Returns the exit status."""
  import jax
  import numpy as np

  cpu = jax.devices("cpu")[0]
  device = cpu
  if not (dry_run or interpret):
    try:
      device = jax.devices("gpu")[0]
    except RuntimeError as e:
      print(f"sanitize_kernels: no GPU ({e}); use --dry-run or --interpret")
      return 1
    print(f"sanitize_kernels: {device.device_kind} (sm {getattr(device, 'compute_capability', '?')}), "
          f"jax {jax.__version__}", flush=True)
    check_kernel_filters(triton=any(c.group == "triton" for c in cases))
  counts = {"ok": 0, "DIFFER": 0, "ERROR": 0}
  for case in cases:
    t0 = time.perf_counter()
    head = f"case {case.full_name} [{case.describe()}]"
    print(f"start {case.full_name}", flush=True)  # where a stopped run was
    try:
      if case.group == "triton" and not (interpret or dry_run):
        import importlib.util
        if importlib.util.find_spec("jax_triton") is None:
          raise RuntimeError("jax_triton is not importable: the Triton kernels cannot run")
      with jax.default_device(cpu):
        args = case_inputs(case)
        want = jax.device_get(_reference(case, *args))
      if dry_run:
        tokens = np.asarray(getattr(want, "tokens", want))
        print(f"{head}: reference {tokens.shape} computed on the CPU "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        counts["ok"] += 1
        continue
      if interpret and case.group == "triton":
        print(f"{head}: skipped (no interpreter for the Triton kernels here)", flush=True)
        continue
      got = _run_kernels(case, *args, cpu=cpu, device=device, interpret=interpret)
      why = _compare(case, got, want)
    except Exception as e:  # noqa: BLE001 (report, go on with the next case)
      msg = " ".join(f"{type(e).__name__}: {e}".split())
      print(f"{head}: ERROR {msg[:2000]}", flush=True)
      counts["ERROR"] += 1
      continue
    status = "DIFFER" if why else "ok"
    counts[status] += 1
    print(f"{head}: tokens {status}{' (' + why + ')' if why else ''} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
  ran = sum(counts.values())
  print(f"sanitize_kernels: done: {ran} cases, {counts['ok']} ok, "
        f"{counts['DIFFER']} DIFFER, {counts['ERROR']} ERROR", flush=True)
  return 0 if ran and counts["ok"] == ran else 1


def mosaic_kernel_names() -> list[str]:
  """CUDA names of the Mosaic GPU kernels: ``<kernel_name>_mosaic_gpu_kernel``
  for each ``"flashsample_sm90..."`` literal in pallas_kernels/sm90_*.py, the
  kernel names (see the module docstring; one launcher picks between two)."""
  import glob
  names = []
  for path in sorted(glob.glob(os.path.join(ROOT, "pallas_kernels", "sm90_*.py"))):
    with open(path) as fh:
      names += [f"{n}_mosaic_gpu_kernel" for n in re.findall(r'"(flashsample_sm90\w*)"', fh.read())]
  return names


def triton_kernel_names() -> list[str]:
  """CUDA entry names of the Triton kernels that the backend launches: the
  Python function's name (see the module docstring)."""
  from pallas_kernels import triton_controls, triton_lists, triton_sampler
  return [k.fn.__name__ for k in (triton_sampler._sampler_kernel,
                                  triton_controls._controls_kernel,
                                  triton_lists._entry_lists_kernel)]


def unfiltered_kernels(*, triton: bool = True) -> list[str]:
  """Our kernels whose CUDA name matches none of :data:`KERNEL_FILTERS`
  (the sanitizer would skip them silently)."""
  subs = [f.split("=", 1)[1] for f in KERNEL_FILTERS]
  names = mosaic_kernel_names() + (triton_kernel_names() if triton else [])
  return [n for n in names if not any(s in n for s in subs)]


def check_kernel_filters(*, triton: bool = True) -> None:
  """Raises if one of our kernels would escape :data:`KERNEL_FILTERS`."""
  try:
    missed = unfiltered_kernels(triton=triton)
  except ImportError as e:  # no Triton: its cases fail on their own
    print(f"sanitize_kernels: Triton kernels not importable ({e})", flush=True)
    missed = unfiltered_kernels(triton=False)
  if missed:
    raise RuntimeError(f"kernels {missed} match none of KERNEL_FILTERS={KERNEL_FILTERS}")


# -- the sanitizer side ----------------------------------------------------------


def find_sanitizer() -> str | None:
  """``$COMPUTE_SANITIZER``, ``compute-sanitizer`` on the PATH, or the CUDA
  toolkit's."""
  env = os.environ.get("COMPUTE_SANITIZER")
  if env:
    return env if os.access(env, os.X_OK) else None
  found = shutil.which("compute-sanitizer")
  if found:
    return found
  import glob
  roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda",
           *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
  for root in filter(None, roots):
    for rel in ("bin/compute-sanitizer", "compute-sanitizer/compute-sanitizer"):
      path = os.path.join(root, rel)
      if os.access(path, os.X_OK):
        return path
  return None


def sanitizer_command(tool: str, group: str, *, sanitizer: str = "compute-sanitizer",
                      python: str | None = None) -> list[str]:
  """The command line that checks ``group``'s kernels with ``tool``."""
  if tool not in TOOLS or group not in GROUPS:
    raise ValueError(f"tool {tool!r} must be one of {TOOLS}, group {group!r} of {GROUPS}")
  # A base port of its own per (tool, group) (10 ports each by default), so
  # the nine runs can go at once.
  port = 49152 + 16 * (TOOLS.index(tool) * len(GROUPS) + GROUPS.index(group))
  cmd = [sanitizer, "--tool", tool, *SANITIZER_OPTIONS, "--port", str(port)]
  for f in KERNEL_FILTERS:
    cmd += ["--kernel-name", f]
  return cmd + [python or sys.executable, "-m", "benchmarks.sanitize_kernels",
                "--only", group]


def sanitizer_env(base: dict | None = None) -> dict:
  """The sanitized program's environment: ``base`` (default os.environ) with
  the repository first on PYTHONPATH and :data:`ENV`, :data:`XLA_FLAGS`."""
  env = dict(os.environ if base is None else base)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
  names = {f.split("=", 1)[0] for f in XLA_FLAGS}
  flags = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] not in names]
  env["XLA_FLAGS"] = " ".join([*flags, *XLA_FLAGS])
  env.update(ENV)
  if not env.get("TRITON_CACHE_DIR"):  # an empty one makes Triton fail
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fsj-sanitize-triton-")
  return env


def log_path(log_dir: str, tool: str, group: str) -> str:
  return os.path.join(log_dir, f"sanitizer_{tool}_{group}.log")


def summarize(tool: str, group: str, text: str, rc: int, seconds: float,
              timeout: float | None = None) -> tuple[bool, str]:
  """``(passed, one line)`` from a run's log text and exit status."""
  problems = []
  summary = None
  if tool == "racecheck":
    m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                  r"(\d+) warnings?\)", text)
    if m:
      summary = m.group(0)
      if int(m.group(1)) or int(m.group(2)) or int(m.group(3)):
        problems.append("hazards")
  if summary is None:
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", text)
    if m:
      summary = m.group(0)
      if int(m.group(1)):
        problems.append("errors")
  if summary is None:
    summary = "no sanitizer summary"
    problems.append(summary)
  for needle, what in (("Internal Sanitizer Error", "internal sanitizer error"),
                       ("overflow of tracked cuda::barrier", "barrier tracking overflow"),
                       ("Sanitizer is not supported", "device not supported"),
                       ("Device not supported", "device not supported")):
    if needle in text and what not in problems:
      problems.append(what)
  ok_n = len(re.findall(r"^case \S+ \[.*\]: tokens ok", text, re.MULTILINE))
  differ = len(re.findall(r"^case \S+ \[.*\]: tokens DIFFER", text, re.MULTILINE))
  errors = len(re.findall(r"^case \S+ \[.*\]: ERROR", text, re.MULTILINE))
  if differ or errors or not ok_n:
    problems.append("cases failed" if differ or errors else "no case ran")
  if not re.search(r"^sanitize_kernels: done", text, re.MULTILINE):
    problems.append("program did not finish")
  if timeout is not None and rc == 124:
    problems.append(f"time limit {timeout:.0f} s")
  elif rc:
    problems.append(f"exit status {rc}")
  passed = not problems
  line = (f"{tool:<9} {group:<15} {'PASS' if passed else 'FAIL'}  {summary}; tokens "
          f"{ok_n} ok, {differ} DIFFER, {errors} ERROR; rc={rc}; {seconds:.0f} s")
  if problems:
    line += " [" + ", ".join(problems) + "]"
  return passed, line


def _stop(proc: subprocess.Popen, grace: float) -> None:
  """SIGTERM to the process group of ``proc`` (the sanitizer and the program
  it runs), SIGKILL after ``grace`` seconds."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
      os.killpg(proc.pid, sig)
      proc.wait(timeout=grace)
      return
    except ProcessLookupError:
      return
    except subprocess.TimeoutExpired:
      continue


def run_sanitizer(tool: str, group: str, log_dir: str, *,
                  timeout: float = DEFAULT_TIMEOUT, sanitizer: str | None = None,
                  python: str | None = None) -> tuple[bool, str]:
  """Runs :func:`sanitizer_command` with :func:`sanitizer_env` (at most
  ``timeout`` seconds), writes its log, returns :func:`summarize`'s verdict."""
  sanitizer = sanitizer or find_sanitizer()
  os.makedirs(log_dir, exist_ok=True)
  log = log_path(log_dir, tool, group)
  if not sanitizer:
    line = f"{tool:<9} {group:<15} FAIL  compute-sanitizer not found (set COMPUTE_SANITIZER)"
    with open(log, "w") as fh:
      fh.write(line + "\n")
    return False, line
  cmd = sanitizer_command(tool, group, sanitizer=sanitizer, python=python)
  env = sanitizer_env()
  try:
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True,
                             timeout=60, check=False).stdout.strip().splitlines()
  except (OSError, subprocess.SubprocessError) as e:
    version = [f"--version failed: {e}"]
  t0 = time.monotonic()
  timed_out = False
  with open(log, "w") as fh:
    fh.write(f"# {' / '.join(version[-2:])}\n# command: {shlex.join(cmd)}\n")
    fh.writelines(f"# {k}={env.get(k, '')}\n" for k in ("XLA_FLAGS", *ENV, "TRITON_CACHE_DIR"))
    fh.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      timed_out = True
      _stop(proc, grace=20)
      rc = 124
    finally:  # also when this driver is stopped (SIGTERM: see main)
      if proc.poll() is None:
        _stop(proc, grace=5)
  seconds = time.monotonic() - t0
  with open(log, errors="replace") as fh:
    text = fh.read()
  passed, line = summarize(tool, group, text, rc, seconds,
                           timeout=timeout if timed_out else None)
  with open(log, "a") as fh:
    fh.write(f"# summary: {line}\n")
  return passed, line


# -- command line ----------------------------------------------------------------


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
      prog="python3 -m benchmarks.sanitize_kernels",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--only", help="comma-separated groups (" + ", ".join(GROUPS)
                  + "), group/case or case names (see --list)")
  ap.add_argument("--list", action="store_true", help="list the groups and cases")
  ap.add_argument("--commands", action="store_true",
                  help="print the sanitizer command line of each tool and group")
  ap.add_argument("--dry-run", action="store_true",
                  help="compute the CPU references only (no kernel runs)")
  ap.add_argument("--interpret", action="store_true",
                  help="run the Mosaic cases in Pallas' GPU interpret mode on the CPU")
  ap.add_argument("--sanitize", nargs=2, metavar=("TOOL", "GROUP"),
                  help="run GROUP under compute-sanitizer --tool TOOL")
  ap.add_argument("--log-dir", default=os.environ.get("OUT", "."),
                  help="where --sanitize writes sanitizer_<tool>_<group>.log")
  ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                  help="--sanitize's time limit in seconds")
  args = ap.parse_args(argv)
  if args.interpret and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    # Before jax is imported: the interpreter runs a kernel's warpgroups as
    # concurrent host callbacks, which deadlock on a host with few cores
    # unless XLA's CPU client has more threads (as tests/conftest.py sets).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

  if args.sanitize:
    tool, group = args.sanitize
    if tool not in TOOLS or group not in GROUPS:
      ap.error(f"--sanitize TOOL GROUP: TOOL in {TOOLS}, GROUP in {GROUPS}")
    # Stopped from outside (sanitize.sh's own time limit): stop the sanitizer
    # too, which runs in a process group of its own.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    passed, line = run_sanitizer(tool, group, args.log_dir, timeout=args.timeout)
    print(line, flush=True)
    return 0 if passed else 1
  if args.commands:
    sanitizer = find_sanitizer()
    print(f"# compute-sanitizer: {sanitizer or 'not found'}")
    for group in GROUPS:
      for tool in TOOLS:
        print(shlex.join(sanitizer_command(tool, group,
                                           sanitizer=sanitizer or "compute-sanitizer")))
    return 0
  cases = select(all_cases(), args.only)
  if args.list:
    for group in GROUPS:
      print(group)
      for c in cases:
        if c.group == group:
          print(f"  {c.full_name:<40} {c.describe()}")
    names = mosaic_kernel_names()
    try:
      names += triton_kernel_names()
    except ImportError:
      names.append("(Triton not importable)")
    print(f"kernels: {' '.join(names)}\nsanitizer filters: {' '.join(KERNEL_FILTERS)}")
    return 0
  return run_cases(cases, dry_run=args.dry_run, interpret=args.interpret)


if __name__ == "__main__":
  sys.exit(main())
