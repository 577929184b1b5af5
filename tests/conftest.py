"""Shared pytest setup.

* 8 host CPU devices, so the sharding tests can build 1/2/4/8-way meshes
  (must be set before jax is imported; harmless for the other tests, which
  use the first device).
* GPU tests (marked ``gpu``) skip cleanly where there is no GPU; on the H100
  run them with ``pytest -m gpu``.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()


def _nvidia_gpu_present() -> bool:
  """Whether nvidia-smi lists a GPU (asked before jax starts its backends)."""
  import shutil
  import subprocess
  if not shutil.which("nvidia-smi"):
    return False
  try:
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


# On a CPU-only machine the suite's time is mostly XLA compiling thousands of
# small programs, not running them: LLVM at -O0 without its expensive passes
# compiles them much faster (README, "Install"). Both sides of every
# comparison (the kernels in interpret mode, the reference,
# jax.random.categorical) compile alike; the kernels' own arithmetic is the
# GPU's. Not on a GPU machine (the GPU backend reads the same flags), nor
# with FSJ_TEST_FULL_XLA_OPT=1 or a level the caller set.
if (os.environ.get("FSJ_TEST_FULL_XLA_OPT") != "1"
    and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]
    and not _nvidia_gpu_present()):
  os.environ["XLA_FLAGS"] += (" --xla_backend_optimization_level=0"
                              " --xla_llvm_disable_expensive_passes=true")

# One Triton cache per pytest-xdist worker, in a directory this process can
# write (workers compiling into one shared cache at once can fail). jax_triton
# empties TRITON_CACHE_DIR when it is imported; the inspection compiles
# (triton_sampler.compile_for_inspection) bring their own directory then.
_triton_cache = os.environ.get("TRITON_CACHE_DIR") or ""
if not (_triton_cache and os.access(_triton_cache, os.W_OK)):
  import tempfile
  _triton_cache = os.path.join(tempfile.gettempdir(), "fsj-triton")
os.environ["TRITON_CACHE_DIR"] = os.path.join(
    _triton_cache, os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.makedirs(os.environ["TRITON_CACHE_DIR"], exist_ok=True)

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def is_sm90() -> bool:
  if not has_gpu():
    return False
  return getattr(jax.devices("gpu")[0], "compute_capability", "") == "9.0"


_SESSION_CACHE = "FSJ_TEST_JAX_CACHE_DIR"


def pytest_configure(config):
  # On the CPU, a persistent compilation cache for this session: a new
  # directory, made by the first process (pytest-xdist's controller, whose
  # workers inherit the variable) and removed when it exits. Tests that
  # clear jax's caches (to retrace with a patched constant), interpret mode
  # (which traces a kernel's threads again on every trace of the kernel) and
  # the two workers, which run tests on the same shapes, compile programs
  # identical to ones compiled before; those come from the cache (the same
  # executable: the key is the program and the compile options). Without
  # jax's eviction the cache takes no lock: a read that races a write of the
  # same entry fails to decompress, warns and compiles. A cache directory of
  # the user's (JAX_COMPILATION_CACHE_DIR) is left alone.
  del config
  if jax.config.jax_compilation_cache_dir or has_gpu():
    return
  path = os.environ.get(_SESSION_CACHE)
  if not path:
    path = tempfile.mkdtemp(prefix="fsj-jax-cache-")
    os.environ[_SESSION_CACHE] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def session_cache_dir() -> str | None:
  """The session's compilation cache directory (None on a GPU, or where the
  user set their own): subprocesses that compile on the CPU share it."""
  return os.environ.get(_SESSION_CACHE)


# Tests out of ./run test for its 10 minutes alone, which CI runs (in both
# SLOW and CI_LONG; of those in :data:`CI_CASES` only the cases named
# there): traced values out of range under checkify, the exact path's
# redone rows and its fallback, the mosaic controls kernel's exact-input
# cases in interpret mode, its batch-invariant split, the list kernels
# under Triton's interpreter, the 8-bit controls kernel's CUDA lowering,
# the slot lists' route against the reference in interpret mode, the
# interpreter's scores of list and several-sample calls.
FOR_TEN_MINUTES = (
    "tests/test_checkify.py::test_traced_control_out_of_range_fails_a_checkify_check",
    "tests/test_exact_path.py::test_flagged_rows_and_only_they_are_redone",
    "tests/test_controls.py::test_fallback_path_is_exact",
    "tests/test_controls.py::test_a_top_k_past_the_default_lists_is_certified_on_longer_ones",
    "tests/test_mosaic.py::TestMosaicInterpret::test_control_matches_reference",
    "tests/test_mosaic.py::TestMosaicInterpret::test_top_p_near_one_with_a_nucleus_past_the_candidates",
    "tests/test_mosaic.py::test_float_outputs_take_one_split_for_every_batch",
    "tests/test_triton_lists.py::test_interpreter_suite",
    "tests/test_quantized_mosaic.py::test_controls_and_f16_lower_for_cuda",
    "tests/test_slot_lists.py::test_route_equals_reference",
    "tests/test_slot_lists.py::test_rows_the_entries_cannot_certify_take_the_exact_path",
    "tests/test_mosaic.py::TestMosaicInterpret::test_score_tokens_is_what_sample_with_lists_or_samples_returned",
)


# Of FOR_TEN_MINUTES' tests, the cases CI runs (the others are deep: ./run
# test-long runs them): one or two of each path, so that CI stays under 20
# minutes on a slow 2-core machine, where interpret mode's callbacks take
# 3-4x the time they take on a fast one (a route case 35-41 s).
CI_CASES = {
    "tests/test_checkify.py::test_traced_control_out_of_range_fails_a_checkify_check":
        ("top_k=-3", "temperature=nan", "repetition_penalty=-2.0"),
    "tests/test_exact_path.py::test_flagged_rows_and_only_they_are_redone":
        ("0-scalar-head-None", "23-per_row-logits-120040"),
    # Every rule, penalties with top-N under truncation, and top-N alone (the
    # early-exit top kernels' route).
    "tests/test_mosaic.py::TestMosaicInterpret::test_control_matches_reference":
        ("scalar-all", "per_row-penalties_all", "scalar-top_logprobs"),
    "tests/test_mosaic.py::TestMosaicInterpret::test_top_p_near_one_with_a_nucleus_past_the_candidates":
        ("1-1e-03",),
    "tests/test_mosaic.py::test_float_outputs_take_one_split_for_every_batch": ("top_k_top_p",),
    # The per-row k and min-p, and 1 / T that rounds (docs/design.md, "Division").
    "tests/test_slot_lists.py::test_route_equals_reference": ("k-rows-minp", "k-p-rounding-T"),
}


# The long CPU tests, marked ``slow`` here: ``./run test`` leaves them out,
# ``./run test-long`` runs them, and CI (.ci/run) runs both but the deep
# ones (all but :data:`CI_LONG`), so that the README's test command stays under 10
# minutes on a 2-core machine and CI under 20. Each entry is a test (every parametrization of
# it) or a file; their times (2 cores, shared) are what `--durations`
# showed. Chosen: tests of the tools around the package (benchmarks,
# notebooks, examples as programs, the README's snippets), the property
# tests, the sharded controls (8 host devices that rendezvous at every
# collective, slowest where the cores are shared; the plain sharded tests
# stay in the quick suite), and the interpret-mode cases that compile the
# largest programs (the others of their suites stay).
SLOW = (
    # Subprocesses running the benchmarks' smoke modes (~95 s).
    "tests/test_benchmarks_smoke.py",
    # Jupyter kernels executing the notebooks (~55 s).
    "tests/test_notebooks.py::test_notebook_runs",
    "tests/test_notebooks.py::test_performance_notebook_plots_results",
    # The Flax decoder example (~210 s).
    "tests/test_examples.py::test_vocab_sharded_head_decodes_the_same_tokens",
    "tests/test_examples.py::test_decode_example_runs",
    "tests/test_examples.py::test_decode_example_greedy",
    "tests/test_examples.py::test_kv_cache_matches_full_forward",
    "tests/test_examples.py::test_fused_and_xla_decode_the_same_tokens",
    "tests/test_examples.py::test_baseline_keeps_what_the_fused_sampler_keeps",
    # Triton's interpreter in a subprocess (~16 s).
    "tests/test_triton_kernels.py::test_interpreter_suite",
    # Sampling controls on vocabulary shards (~330 s).
    "tests/test_sharding.py::test_controls_same_on_1_2_4_8_shards",
    "tests/test_sharding.py::test_controls_on_dp_x_tp_mesh_and_fallback",
    "tests/test_sharding.py::test_top_p_boundary_rows_same_on_any_shard_count",
    "tests/test_sharding.py::test_mosaic_controls_on_shards_not_multiple_of_32",
    "tests/test_sharding.py::test_sample_sharded_passes_controls",
    "tests/test_sharding.py::test_two_processes_match_one_process",
    # Mosaic kernels in interpret mode, the largest programs (~250 s).
    "tests/test_mosaic.py::test_penalties_in_the_kernel_bit_for_bit",
    "tests/test_mosaic.py::test_samples_only_run_as_rows_of_the_plain_kernel",
    "tests/test_mosaic.py::TestMosaicInterpret::test_controls_with_samples_and_logprobs",
    "tests/test_mosaic.py::TestMosaicInterpret::test_penalties_edges",
    "tests/test_mosaic.py::TestMosaicInterpret::test_truncating_every_row_skips_the_noise",
    "tests/test_mosaic.py::TestMosaicInterpret::test_rows_with_nothing_to_sample_return_minus_one",
    "tests/test_mosaic.py::TestMosaicInterpret::test_several_samples_alone",
    # Flax heads with leading dimensions, every output option (~55 s).
    "tests/test_flax.py::test_leading_dimensions_for_every_argument_and_output",
    # Every README snippet run (~30 s).
    "tests/test_readme.py::test_readme_python_blocks_run",
    # Quantized heads and the RL outputs on vocabulary shards, and scoring
    # random inputs bit for bit (~100 s).
    "tests/test_quantized.py::test_sharded_quantized_head_on_1_2_4_8_shards",
    "tests/test_quantized.py::test_verify_drafts_with_a_quantized_head",
    "tests/test_rl.py::test_sharded_rl_outputs_on_1_2_8_shards",
    "tests/test_rl.py::test_score_tokens_in_shard_map",
    "tests/test_rl.py::test_score_tokens_is_bit_for_bit_what_sample_returned",
    # Raw top-N lists and kept sets at every edge on the streaming backend,
    # and the mosaic kernel's RL fields in interpret mode (~80 s).
    "tests/test_rl.py::test_raw_top_logprobs",
    "tests/test_rl.py::test_kept_sets_at_every_edge_and_overflow",
    "tests/test_mosaic.py::TestMosaicInterpret::test_rl_outputs",
    # Quantized heads with controls in Mosaic's interpret mode (~35 s).
    "tests/test_mosaic.py::TestMosaicInterpret::test_quantized_heads_with_controls",
    # Hypothesis's generated problems on the xla backend (~60 s).
    "tests/test_properties.py::test_sample_matches_reference",
    "tests/test_properties.py::test_controls_match_reference",
    # The keep mask against the argsort formulation on many rows (~18 s).
    "tests/test_controls.py::test_keep_mask_matches_the_argsort_formulation",
    # More Mosaic interpret-mode programs, and the CUDA lowering of every
    # N bucket (~150 s; ./run test-oldest-jax lowers them on the oldest jax).
    "tests/test_mosaic.py::TestMosaicInterpret::test_top_logprobs_edges",
    "tests/test_mosaic.py::TestMosaicInterpret::test_control_edge_cases",
    "tests/test_mosaic.py::TestMosaicInterpret::test_random_inputs_agree",
    "tests/test_mosaic.py::test_mosaic_overflowing_slot_lists_take_the_exact_path",
    "tests/test_mosaic.py::test_mosaic_more_samples_than_one_launch",
    "tests/test_mosaic.py::test_mosaic_launches_of_128_rows_without_truncation",
    "tests/test_mosaic.py::test_mosaic_wide_blocks_with_bias_mask_and_logprobs",
    "tests/test_mosaic.py::test_top_lists_kernel_equals_the_two_key_sort",
    "tests/test_mosaic.py::test_heuristic_configs_lower_for_cuda",
    "tests/test_mosaic.py::test_configs_match_xla_scores",
    # Every 8-bit config's scores in interpret mode (~17 s; the heuristic's
    # 8-bit steps stay in ./run test: tests/test_quantized_mosaic.py).
    "tests/test_quantized_mosaic.py::test_configs_match_xla_scores",
    # Out of ./run test and of CI (~30 s): the triton adapter's choice of
    # the batch-invariant configs for float outputs (its kernels are XLA
    # stand-ins here; the GPU suite runs them), the RL float outputs across
    # shard counts (./run test keeps the sharded tokens and the unsharded
    # RL outputs), the interpreter's scores of a single-sample call (those
    # of list and several-sample calls stay in CI).
    "tests/test_triton_adapter.py::test_calls_reporting_floats_run_the_batch_invariant_configs",
    "tests/test_rl.py::test_float_outputs_across_shard_counts_within_2_ulp",
    "tests/test_mosaic.py::TestMosaicInterpret::test_score_tokens_is_what_sample_returned",
    "tests/test_mosaic.py::test_batch_blocks_share_one_launch",
    "tests/test_mosaic.py::TestMosaicInterpret::test_traced_controls_under_jit",
    "tests/test_mosaic.py::TestMosaicInterpret::test_padded_vocab",
    "tests/test_mosaic.py::TestMosaicInterpret::test_rows_with_nothing_allowed_return_minus_one",
    # The xla backend's largest controls programs and its chunk sizes (~200
    # s; ./run test-oldest-jax runs TestXlaBackend on the oldest jax too).
    "tests/test_xla_backend.py::TestXlaBackend::test_controls_with_samples_and_logprobs",
    "tests/test_xla_backend.py::TestXlaBackend::test_truncating_every_row_skips_the_noise",
    "tests/test_xla_backend.py::test_chunk_size_does_not_change_tokens",
    "tests/test_xla_backend.py::test_dense_route_equals_reference",
    # The triton adapter's pairings on crowded rows (its kernels are XLA
    # stand-ins here; tests/test_triton_kernels.py checks the kernels).
    "tests/test_triton_adapter.py::test_truncation_with_pairings_equals_reference_on_crowded_rows",
    # Speculative verification beyond the xla backend's exact-input cases:
    # the dense and interpret-mode backends, shards, the exact path's
    # branches, the distributions over 20000 requests and the example (~130 s).
    "tests/test_speculative.py::test_mosaic_interpret_equals_reference",
    "tests/test_speculative.py::test_sharded_vocabulary_equals_unsharded",
    "tests/test_speculative.py::test_rows_on_the_exact_path_equal_reference",
    "tests/test_speculative.py::test_one_hot_emits_the_target_distribution",
    "tests/test_speculative.py::test_probabilistic_emits_the_target_distribution",
    "tests/test_speculative.py::test_example_runs_every_method",
    # SamplingParams through jit and scan, vLLM's order over 4000 draws (~20 s).
    "tests/test_params.py::test_params_under_jit_and_scan",
    "tests/test_params.py::test_vllm_order_on_a_known_row",
    # The backend suite on the triton adapter's XLA stand-ins for its
    # kernels (~330 s, all of it; CI leaves it to ./run test-long): stage 2
    # as TestXlaBackend runs it; the adapter's own wiring is in the file's
    # other tests, the kernels in tests/test_triton_kernels.py and the GPU
    # suite.
    "tests/test_triton_adapter.py::TestTritonAdapter",
    # More parametrizations of paths ./run test runs once (~140 s): rules
    # that also run with scalar keys (per-row keys stay with "all"; "top_k"
    # and "min_p" go below); the slot lists of the xla backend where the dense one
    # runs them, and back; the speculative methods with one heavy case each;
    # SamplingParams' cases that "all" holds; the 8-bit steps in the other
    # layout; top-N counts below the two largest; the interpreter's "dv"
    # layout with a scalar key (test_per_row_keys[dv] keeps it); the e5m2
    # Flax head (fp8 and int8 stay).
    *(f"tests/test_xla_backend.py::TestXlaBackend::test_control_matches_reference[per_row-{c}]"
      for c in ("penalties_all", "top_logprobs_truncated", "top_p", "p_minp_vllm")),
    *(f"tests/test_dense_lists.py::test_sample_with_slot_lists_equals_reference[{c}]"
      for c in ("exact-0-traced-xla", "ties-sampled-traced-xla", "random-0-traced-dense",
                "ties-sampled-concrete-dense")),
    "tests/test_speculative.py::test_xla_equals_reference[strict-per_request-top_k_top_p]",
    "tests/test_speculative.py::test_xla_equals_reference[one_hot-per_request-mask_penalties]",
    "tests/test_params.py::test_sample_logits_is_sample[penalties_all]",
    "tests/test_params.py::test_sample_logits_is_sample[p_minp_vllm]",
    "tests/test_params.py::test_params_are_the_keywords[p_minp_vllm]",
    "tests/test_params.py::test_params_are_the_keywords[k_p_minp]",
    "tests/test_quantized_mosaic.py::test_steps_that_do_not_divide_d[dv-batch_blocks]",
    "tests/test_quantized_mosaic.py::test_steps_that_do_not_divide_d[vd-wide]",
    *(f"tests/test_top_logprobs_lists.py::test_top_n_up_to_the_maximum_is_certified_on_the_lists"
      f"[{n}-{t}]" for n in (120, 121) for t in ("plain", "top_k_top_p")),
    "tests/test_mosaic.py::TestMosaicInterpret::test_scalar_key[dv]",
    "tests/test_flax.py::test_quantized_head_in_two_lines[float8_e5m2]",
    # More of them (~45 s): strict verification with per-request keys,
    # masks and penalties (the probabilistic method keeps that case); the
    # exact path's nested conditionals of top-k and the one of top-p
    # (./run test keeps top-k's one and top-p's nested); the 8-bit dense
    # GEMM's padding past 16 rows (1 and 5 rows stay); per-row keys with
    # top-k and min-p alone ("all" keeps them).
    "tests/test_speculative.py::test_xla_equals_reference[strict-per_request-mask_penalties]",
    "tests/test_exact_path.py::test_flagged_rows_of_one_and_nested_conditionals_equal_reference"
    "[top_k-20]",
    "tests/test_exact_path.py::test_flagged_rows_of_one_and_nested_conditionals_equal_reference"
    "[top_p-24]",
    "tests/test_quantized.py::test_dense_gemm_of_an_8bit_head_takes_at_least_16_rows_on_a_gpu"
    "[20-vd]",
    *(f"tests/test_xla_backend.py::TestXlaBackend::test_control_matches_reference[per_row-{c}]"
      for c in ("top_k", "min_p")),
    # And (~25 s): the slot lists of vocabulary shards on tied logits (exact
    # ones stay); traced controls under jit at 12 and 27 rows (6 stays,
    # and 24 rows' conditional without operands); top-p near one under a
    # top-k past the lists (60 stays); the RL outputs and the 8-bit head's
    # controls with "k_p_minp" and "all" (penalties_all stays, every rule);
    # per-row keys in the interpreter's "vd" layout (scalar keys keep it);
    # one-hot verification of per-request keys with top-k + top-p.
    "tests/test_dense_lists.py::test_slot_lists_of_vocabulary_shards_equal_reference[ties]",
    *(f"tests/test_exact_path.py::test_flagged_rows_under_jit_with_controls_given_as_numbers"
      f"[{rows}]" for rows in (12, 27)),
    "tests/test_controls.py::test_top_p_near_one_under_top_k_on_every_row[1000]",
    "tests/test_xla_backend.py::TestXlaBackend::test_rl_outputs[k_p_minp]",
    "tests/test_xla_backend.py::TestXlaBackend::test_quantized_heads_with_controls[all]",
    "tests/test_mosaic.py::TestMosaicInterpret::test_per_row_keys[vd]",
    "tests/test_speculative.py::test_xla_equals_reference[one_hot-per_request-top_k_top_p]",
) + FOR_TEN_MINUTES


# Of the long tests, those CI runs too (:func:`is_deep`: the others, marked
# ``deep``, run in ``./run test-long`` alone): what users read and run (the
# README's snippets, the notebooks, the examples), the statistical checks
# of distributions, every kernel in interpret mode, and FOR_TEN_MINUTES (of
# :data:`CI_CASES`' tests, the cases named there).
# The deep tests re-run, with more cases, shard counts, kernel programs and
# tools (the benchmarks' smoke modes, the Flax heads' every option), paths
# that ``./run test`` covers once on the CPU (and the GPU suite in full),
# so that CI (.ci/run) stays under 20 minutes on a 2-core machine: with
# them it took 24. Run ``./run test-long`` (all of them) before a change to
# the kernels, stage 2, sharding or the benchmarks lands.
CI_LONG = (
    # Every long test of these files.
    "tests/test_readme.py",
    "tests/test_notebooks.py",
    "tests/test_examples.py",
    "tests/test_speculative.py::test_example_runs_every_method",
    # Distributions over many keys (chi-square).
    "tests/test_speculative.py::test_one_hot_emits_the_target_distribution",
    "tests/test_speculative.py::test_probabilistic_emits_the_target_distribution",
    "tests/test_params.py::test_vllm_order_on_a_known_row",
    # Every kernel in interpret mode in CI: the Triton kernels under
    # Triton's interpreter, the mosaic top-lists kernel (the others' run in
    # ./run test).
    "tests/test_triton_kernels.py::test_interpreter_suite",
    "tests/test_mosaic.py::test_top_lists_kernel_equals_the_two_key_sort",
) + tuple(t for t in FOR_TEN_MINUTES if t not in CI_CASES) + tuple(
    f"{t}[{case}]" for t, kept in CI_CASES.items() for case in kept)


def _listed(nodeid: str, names) -> bool:
  return any(nodeid == s or nodeid.startswith(s + "[") or nodeid.startswith(s + "::")
             for s in names)


def is_slow(nodeid: str) -> bool:
  """Whether ``nodeid`` is one of :data:`SLOW`'s tests (or in its files)."""
  return _listed(nodeid, SLOW)


def is_deep(nodeid: str) -> bool:
  """Whether ``nodeid`` is a long test that CI leaves out (not in
  :data:`CI_LONG`)."""
  return is_slow(nodeid) and not _listed(nodeid, CI_LONG)


# First: the marks must be there when -m selects ("not slow", "slow").
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  del config
  slow, deep = pytest.mark.slow, pytest.mark.deep
  for item in items:
    if is_slow(item.nodeid):
      item.add_marker(slow)
      if is_deep(item.nodeid):
        item.add_marker(deep)
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marked gpu)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
