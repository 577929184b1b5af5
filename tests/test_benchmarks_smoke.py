"""The end-to-end and sharded benchmarks run (``--smoke``: tiny shapes, CPU).

They run on the GPU only in a device session; these keep them from breaking
in between. Each runs as a subprocess with the CPU platform (and 4 host
devices standing in for GPUs where it shards), and its JSON is checked for
the fields the README and the performance notebook read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import session_cache_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compile_cache_dir(tmp_path_factory):
  """A persistent compilation cache for the benchmark processes: the test
  session's (tests/conftest.py), else a new directory. They compile many of
  the same programs (the suite runs bench_e2e twice with the same smoke
  shapes); a later one loads those executables instead of compiling them
  again (with a cache per worker: 157 -> 124 s for this file, two workers)."""
  return session_cache_dir() or str(tmp_path_factory.mktemp("jax-cache"))


@pytest.fixture(autouse=True)
def _benchmarks_share_compiles(compile_cache_dir, monkeypatch):
  # The processes inherit it (os.environ); this process's jax is configured already.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", compile_cache_dir)
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _run(args, tmp_path, devices=1, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  out = subprocess.run([sys.executable, "-m", *args, "--out", str(tmp_path)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  return out.stdout


@pytest.mark.parametrize("logit_std,share", [(None, 1.0), (4.0, 0.0)])
def test_bench_e2e_reports_the_exact_path(logit_std, share, tmp_path):
  # Random weights give logits of std ~1: top-p 0.9 alone keeps thousands of
  # ids, more than the candidate lists, so every row takes the exact path;
  # spread to std 4 the nucleus fits and none does.
  std = [] if logit_std is None else ["--logit-std", str(logit_std)]
  _run(["benchmarks.bench_e2e", "--smoke", "--generation-config", "llama3,plain",
        "--batches", "2", "--tokens", "1", "--name", "test", "--no-plot", *std], tmp_path)
  res = json.loads((tmp_path / "e2e_test.json").read_text())
  assert res["logit_std_target"] == logit_std
  fused = {r["generation"]: r for r in res["rows"] if r["sampler"] == "fused"}
  assert fused["llama3"]["exact_path_rows"] == share
  assert fused["plain"]["exact_path_rows"] == 0.0       # no candidate lists at all
  for r in fused.values():
    assert abs(r["logit_std"] - (logit_std or 1.0)) < 0.2
  assert f"| {100 * share:.0f}% |" in (tmp_path / "e2e_test.md").read_text()


def test_bench_sampler_quantized_heads(tmp_path):
  # --weight-dtype on a tiny head: every default provider (the backends that
  # run here, auto, XLA's dot + categorical, its top-k + top-p and the dot
  # alone) gets the 8-bit head with its scales. fp8_e5m2 and int8 take the
  # same path through the benchmark (only fs.quantize_weight's dtype differs;
  # int8 runs in test_bench_e2e_quantized_heads), so one dtype keeps it short.
  # --device-time: a CPU has no device events, so its columns are empty.
  _run(["benchmarks.bench_sampler", "--smoke", "--batches", "2", "--reps", "1",
        "--inner", "1", "--weight-dtype", "fp8", "--device-time"], tmp_path)
  d, v = 256, 4096                                  # bench_sampler.SHAPES["smoke"]
  res = json.loads((tmp_path / "sampler_cpu_fp8.json").read_text())
  assert res["weight_dtype"] == "fp8"
  assert {"gpu", "jax", "date", "read_bandwidth_Bps"} <= set(res)
  (r,) = res["rows"]
  assert (r["weight_dtype"], r["B"], r["weight_bytes"], r["scale_bytes"]) == ("fp8", 2, d * v,
                                                                             4 * v)
  # The floor: V x D x 1 byte at the measured bandwidth, half the bf16 head's.
  assert r["floor_us"] == pytest.approx(d * v / res["read_bandwidth_Bps"] * 1e6)
  assert r["bf16_floor_us"] == pytest.approx(2 * r["floor_us"])
  for prov in ("auto", "xla", "xla_baseline", "dot", "auto_topk_topp", "xla_topk_topp"):
    assert r[f"{prov}_us"] > 0, prov
  assert r["mosaic_us"] is None and r["mosaic_why"]       # no GPU here: check() refuses
  assert r["auto_backend"] in ("dense", "xla") and r["auto_to_floor"] > 0
  md = (tmp_path / "sampler_cpu_fp8.md").read_text()
  assert "float8_e4m3fn" in md and "| auto / floor |" in md and "| smoke | 2 |" in md
  assert res["device_read_bandwidth_Bps"] > 0 and r["device_floor_us"] > 0
  assert r["auto_device_us"] is None and "| auto / floor (device) |" in md
  assert (tmp_path / "sampler_cpu_fp8.png").exists()


def test_bench_e2e_quantized_heads(tmp_path):
  # --head-dtype: two quantized heads on one untied decoder (their models
  # share the graphdef, so each needs its own prefill), both samplers reading
  # the same 8-bit head with its scales: plain sampling agrees token for token.
  from examples import _model
  _run(["benchmarks.bench_e2e", "--smoke", "--head-dtype", "fp8,int8",
        "--generation-config", "plain", "--tokens", "1"], tmp_path)
  res = json.loads((tmp_path / "e2e_cpu_head-fp8-int8.json").read_text())
  assert res["complete"] and res["head_dtypes"] == ["fp8", "int8"]
  assert {(r["config"], r["head_dtype"], r["sampler"]) for r in res["rows"]} == {
      ("tiny-untied", hd, s) for hd in ("fp8", "int8") for s in ("fused", "xla")}
  cfg = _model.CONFIGS["tiny-untied"]
  head_bytes = cfg.vocab * cfg.dim + 4 * cfg.vocab   # 8-bit head + f32 scales
  step_bytes = cfg.step_weight_bytes() - 2 * cfg.vocab * cfg.dim + head_bytes
  for r in res["rows"]:
    assert r["floor_ms"] == pytest.approx(1e3 * step_bytes / res["read_bandwidth_Bps"])
    assert r["tpot_ms"] > 0 and r["same_tokens_rows"] == 1.0
    assert r["same_first_token_rows"] == 1.0
  md = (tmp_path / "e2e_cpu_head-fp8-int8.md").read_text()
  assert "| tiny-untied | plain | 2 | fp8 |" in md and "| tiny-untied | plain | 2 | int8 |" in md
  assert (tmp_path / "e2e_cpu_head-fp8-int8.png").exists()


def _check_e2e(tmp_path, name):
  res = json.loads((tmp_path / f"e2e_{name}.json").read_text())
  assert {"gpu", "jax_version", "date", "rows", "read_bandwidth_Bps"} <= set(res)
  assert res["complete"] and set(res["generation_configs"]) == {"plain", "qwen3"}
  assert {(r["generation"], r["batch"], r["sampler"]) for r in res["rows"]} == {
      (g, 2, s) for g in ("plain", "qwen3") for s in ("fused", "xla")}
  for r in res["rows"]:
    assert r["tpot_ms"] > 0 and r["floor_ms"] > 0 and r["tpot_over_floor"] > 0
    # Same keys, same kept set: the first token always agrees on these
    # inputs; whole decodes agree where the baseline draws the reference's
    # noise (plain), not where it draws over the top-k candidates.
    assert r["same_first_token_rows"] == 1.0
    if r["generation"] == "plain":
      assert r["same_tokens_rows"] == 1.0
  assert (tmp_path / f"e2e_{name}.png").exists()
  assert "| tiny | qwen3 | 2 |" in (tmp_path / f"e2e_{name}.md").read_text()


def _check_sharded(tmp_path):
  # 4 CPU devices stand in for 4 GPUs: TP 1, 2 and 4 inside one jitted loop.
  res = json.loads((tmp_path / "sharded_cpu-smoke_smoke_tp1-2-4.json").read_text())
  assert res["meta"]["steps"] == 2 and res["meta"]["device_count"] == 4
  assert res["meta"]["complete"]
  assert [(r["tp"], r["batch"]) for r in res["results"]] == [(1, 4), (2, 4), (4, 4)]
  for r in res["results"]:
    assert all(r[f"{s}_us"] > 0 for s in ("fused", "gather", "matmul", "exchange"))
    assert r["same_rows"] == 1.0 and r["goal_us"] > 0


def _check_tp_e2e(tmp_path):
  # The decoder with its head split over 4 CPU devices, qwen3 config.
  res = json.loads((tmp_path / "tp_e2e_cpu-smoke.json").read_text())
  assert res["complete"] and res["generation"] == "qwen3" and res["device_count"] == 4
  assert {(r["tp"], r["sampler"]) for r in res["rows"]} == {
      (n, s) for n in (1, 2, 4) for s in ("fused", "xla")}
  for r in res["rows"]:
    assert r["tpot_ms"] > 0 and r["floor_ms"] > 0
    assert r["same_first_token_rows"] == 1.0
  assert "| 4 | 2 |" in (tmp_path / "tp_e2e_cpu-smoke.md").read_text()


@pytest.mark.parametrize("mode", ["single", "tp"])
def test_e2e_suite_command_lines(mode, tmp_path):
  # The GPU suite's own command lines, with tiny shapes appended (SUITE_SMOKE):
  # a flag the scripts do not know would fail here, not on the GPU. The
  # results are checked for the fields the README and the performance
  # notebook read (the suite is the only place these benchmarks run on the CPU).
  env = dict(os.environ, SUITE_SMOKE="1", OUT=str(tmp_path), PY=sys.executable)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(["bash", "benchmarks/e2e_suite.sh", mode], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
  assert "rc=124" not in out.stdout
  if mode == "single":
    assert (tmp_path / "floor_cpu_qwen3-8b.json").exists()
    _check_e2e(tmp_path, "cpu_qwen3-1.7b")
    _check_e2e(tmp_path, "cpu_qwen3-8b")
  else:
    _check_sharded(tmp_path)
    _check_tp_e2e(tmp_path)


def test_batch_invariance_counts_rows_that_differ(tmp_path):
  # benchmarks/batch_invariance.py in process on a tiny head (xla backend,
  # plain with logprobs): the counts are of rows, and a row whose bits
  # differ in one field counts once.
  import numpy as np  # pylint: disable=import-outside-toplevel
  from benchmarks import batch_invariance as bi  # pylint: disable=import-outside-toplevel
  from flashsample_jax.controls import SampleOutput  # pylint: disable=import-outside-toplevel
  full = SampleOutput(tokens=np.arange(4), logprob=np.zeros(4, np.float32),
                      logprob_truncated=np.zeros(4, np.float32),
                      logsumexp=np.ones(4, np.float32))
  part = full._replace(tokens=np.asarray([0, 9, 2]),
                       logprob=np.asarray([0, 0, np.float32(1e-30)], np.float32),
                       logprob_truncated=np.asarray([0, 0, np.float32(1e-30)], np.float32),
                       logsumexp=np.ones(3, np.float32))
  got = bi.differing_rows(part, full, 3)
  assert got["token_rows"] == 1 and got["any_bit_rows"] == 1 and got["logprob_bit_rows"] == 1
  assert got["logsumexp_bit_rows"] == 0
  bi.main(["--smoke", "--backends", "xla", "--modes", "plain", "--batches", "1", "3",
           "--full", "4", "--out", str(tmp_path)])
  (res,) = tmp_path.glob("batch_invariance_*.json")
  rows = json.loads(res.read_text())["rows"]
  assert [(r["B"], r["token_rows"]) for r in rows] == [(1, 0), (3, 0)]
  # The schedule edges: 1..16, then both sides of each multiple of 32.
  assert bi.schedule_edges(70) == list(range(1, 17)) + [31, 32, 33, 63, 64, 65]
  # The rl mode compares every float field the call returns.
  bi.main(["--smoke", "--backends", "xla", "--modes", "rl", "--schedule-edges",
           "--full", "4", "--out", str(tmp_path)])
  rows = json.loads(res.read_text())["rows"]
  assert [r["B"] for r in rows] == [1, 2, 3]
  for name in ("logprob_raw", "entropy", "entropy_truncated", "top_logprobs"):
    assert name + "_bit_rows" in rows[0], name


def test_score_benchmark_baseline_matches_score_tokens(tmp_path):
  # benchmarks/bench_score.py: its XLA baseline computes the quantity the
  # fused call is timed against (the log-probability over the kept set, and
  # the kept set's entropy), and the run writes the fields the docs read.
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import flashsample_jax as fs  # pylint: disable=import-outside-toplevel
  from benchmarks import bench_score as bs  # pylint: disable=import-outside-toplevel
  h = jax.random.normal(jax.random.key(0), (6, 64), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (512, 64), jnp.float32) * 0.4).astype(jnp.bfloat16)
  for cfg in bs.CONFIGS.values():
    trunc = {k: cfg[k] for k in ("top_k", "top_p") if k in cfg}
    tok = fs.sample(h, w, jax.random.key(2), **cfg)
    got = fs.score_tokens(h, w, tok, **cfg)
    lp, ent = bs.xla_score(h, w, tok, temperature=cfg["temperature"], entropy=True, **trunc)
    np.testing.assert_allclose(lp, got.logprob_truncated, atol=2e-5)
    np.testing.assert_allclose(ent, got.entropy_truncated, atol=2e-5)
  bs.main(["--smoke", "--rows", "4", "--reps", "1", "--configs", "topk_topp", "--no-plot",
           "--providers", "fused", "xla", "dot", "--out", str(tmp_path)])
  # The files are named after the device (score_cpu, score_h200, ...).
  (res,) = tmp_path.glob("score_*.json")
  (point,) = json.loads(res.read_text())["points"]
  assert point["N"] == 4 and point["config"] == "topk_topp"
  assert {"fused_us", "xla_us", "dot_us", "fused_temp_mib", "xla_over_fused"} <= set(point)
  assert "| topk_topp | 4 |" in res.with_suffix(".md").read_text()


def test_stamp_timing_writes_its_table(tmp_path):
  # The second harness (benchmarks/stamp_timing.py) on the tiny head: the
  # floor, the dot, auto and top-k + top-p between stamps (the host's clock
  # on a CPU), their ratios in the JSON and the table.
  _run(["benchmarks.stamp_timing", "--smoke", "--providers", "auto", "auto_topk_topp",
        "--name", "test"], tmp_path)
  res = json.loads((tmp_path / "stamps_cpu_test.json").read_text())
  assert {"gpu", "jax", "date", "command", "read_tbs", "calls"} <= set(res)
  (r,) = res["rows"]
  for prov in ("dot", "auto", "auto_topk_topp"):
    assert 0 < r[f"{prov}_min_us"] <= r[f"{prov}_us"] <= r[f"{prov}_max_us"], prov
  assert r["auto_to_floor"] == pytest.approx(r["auto_us"] / r["floor_us"])
  assert r["auto_topk_topp_to_auto"] == pytest.approx(r["auto_topk_topp_us"] / r["auto_us"])
  md = (tmp_path / "stamps_cpu_test.md").read_text()
  assert "| auto_topk_topp / auto |" in md and "| smoke | 1 |" in md


def test_cta_spread_reads_profiler_cycles_as_microseconds():
  # exp_cta_spread's summary of a Mosaic GPU profiler trace (GPU only to
  # record): the stamps are SM cycles over 1000, so the times are scaled by
  # the clock that makes the last CTA end at the unprofiled kernel's time.
  from benchmarks.experiments.exp_cta_spread import summarize
  events = []
  for cta, (end, epi) in enumerate([(400.0, 6.0), (300.0, 4.0)]):  # kcycles
    tid = 1 + 3 * cta
    events += [dict(ph="B", tid=tid + 2, pid=7 + cta, name="stream", ts=0.0),
               dict(ph="E", tid=tid + 2, pid=7 + cta, name="stream", ts=end - epi)]
    for wg, (a, b) in enumerate([(2.0, end / 2), (end / 2, end - epi)]):
      events += [dict(ph="B", tid=tid + wg, pid=7 + cta, name="mma", ts=a),
                 dict(ph="E", tid=tid + wg, pid=7 + cta, name="mma", ts=b)]
    events += [dict(ph="B", tid=tid + 1, pid=7 + cta, name="epilogue", ts=end - epi),
               dict(ph="E", tid=tid + 1, pid=7 + cta, name="epilogue", ts=end)]
  s = summarize(events, kernel_time_us=200.0)  # 400 kcycles in 200 us: 2 GHz
  assert s["clock_ghz"] == 2.0 and s["ctas"] == 2 and s["tiles_per_cta"] == [2, 2]
  assert s["end_us"] == [150.0, 155.0, 175.0, 195.0, 200.0]
  assert s["tail_us"] == 25.0 and s["start_spread_us"] == 0.0
  assert s["last_epilogue_us"] == 2.5   # the median of 3 and 2 us
  assert s["latest_ctas"] == [0, 1] and s["latest_sms"] == [6, 7]


def test_small_b_kernel_variants_trace_their_own_programs():
  # exp_small_b_kernel's variants in interpret mode: each samples the
  # reference's tokens, and per_tile (a code path, not a config) gets a
  # program of its own: with an equal backend, fs.sample's inner jit would
  # reuse the base variant's trace and the A/B would time one program twice.
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from benchmarks.experiments import exp_small_b_kernel as e
  assert e.exact_check(["base", "per_tile", "epi8"], 3, dim=256, vocab=1000,
                       interpret=True) == {"base": True, "per_tile": True, "epi8": True}
  h = jnp.ones((3, 256), jnp.bfloat16)
  w = jnp.ones((1500, 256), jnp.bfloat16)
  key = jax.random.key(0)
  texts = {v: e.compiled(v, h, w, key, interpret=True).lower(h, w, key).as_text()
           for v in ("base", "per_tile")}
  # One candidate per warpgroup (2 x 4 CTAs in interpret mode) against one
  # per tile (12 tiles of 128 ids), for each of the launch's 8 rows.
  for v, n_out in (("base", 8), ("per_tile", 12)):
    assert f"-> tensor<8x{n_out}xf32>" in texts[v], v
  assert "-> tensor<8x12xf32>" not in texts["base"]


def test_large_b_noise_ablations_run_their_own_kernels():
  # exp_large_b_noise in interpret mode: the base variant samples the
  # reference's tokens, and each ablation (no logs, no noise) runs a kernel
  # of its own: traced with the base's stand-in for the noise, it would
  # sample the base's tokens and the A/B would time one program twice.
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from benchmarks import shapes  # pylint: disable=import-outside-toplevel
  from benchmarks.experiments import exp_large_b_noise as e
  from flashsample_jax import reference  # pylint: disable=import-outside-toplevel
  w = shapes.random_weight(256, 1024, 1.3)
  h = jax.random.normal(jax.random.key(1), (16, 256), jnp.bfloat16)
  key = jax.random.key(0)
  toks = {v: e.compiled(v, h, w, key, interpret=True)(h, w, key)
          for v in ("base", "no_logs", "no_noise")}
  assert bool(jnp.all(toks["base"] == reference.sample(h, w, key, temperature=0.7)))
  for v in ("no_logs", "no_noise"):
    assert float(jnp.mean(toks[v] == toks["base"])) < 0.5, v


def test_large_b_noise_ablations_on_a_named_config():
  # "ablation@config": the blocked config exp_blocks names (Dt = 64, a wgmma
  # in flight) runs for every launch, the base on it still samples the
  # reference's tokens and the ablation on it its own kernel; a config that
  # does not apply to the problem is skipped (None), an unknown ablation is
  # an error.
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import pytest  # pylint: disable=import-outside-toplevel
  from benchmarks import shapes  # pylint: disable=import-outside-toplevel
  from benchmarks.experiments import exp_large_b_noise as e
  from flashsample_jax import reference  # pylint: disable=import-outside-toplevel
  w = shapes.random_weight(256, 512, 1.3)
  h = jax.random.normal(jax.random.key(2), (8, 256), jnp.bfloat16)
  key = jax.random.key(0)
  assert e.split_variant("no_noise@d64_f1") == ("no_noise", "d64_f1")
  assert e.split_variant("base") == ("base", None)
  with pytest.raises(ValueError, match="no_nois"):
    e.split_variant("no_nois@d64_f1")
  assert e.compiled("base@d96", h, w, key, interpret=True) is None
  base = e.compiled("base@d64_f1", h, w, key, interpret=True)(h, w, key)
  assert bool(jnp.all(base == reference.sample(h, w, key, temperature=0.7)))
  ablated = e.compiled("no_noise@d64_f1", h, w, key, interpret=True)(h, w, key)
  assert float(jnp.mean(ablated == base)) < 0.5


def test_log_skip_bound_and_scopes():
  # exp_log_skip: the cheap bound lies at or above the noise for every one of
  # its 2**23 uniforms, and a quad's running best (the row's over its four
  # threads) skips at least the iterations a thread's own best skips, since
  # each is the exact maximum of what it has seen.
  import numpy as np  # pylint: disable=import-outside-toplevel
  from benchmarks.experiments import exp_log_skip as e
  u = np.maximum(np.arange(1 << 23, dtype=np.float32) * np.float32(2.0 ** -23), e._TINY)
  assert (e.gumbel_bound(u) >= e.gumbel(u)).all()
  for seed in range(3):
    fr = {scope: e.skipped_fraction(np.random.default_rng(seed), tiles=3, std=1.3,
                                    temperature=0.7, scope=scope)
          for scope in ("thread", "quad")}
    assert 0.0 <= fr["thread"] <= fr["quad"] < 1.0, fr
  import pytest  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="scope"):
    e.skipped_fraction(np.random.default_rng(0), tiles=1, std=1.3, temperature=0.7,
                       scope="warp")



def test_zero_rows_variants_and_their_exact_rows():
  # exp_zero_rows on a tiny head: with the rules per row (noise in the
  # pass) a zero hidden row is decided on the pass; as stage 2 was before
  # (_before) or with the rules as numbers (no noise) it takes the exact
  # path. The tokens are the same either way.
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from benchmarks import shapes  # pylint: disable=import-outside-toplevel
  from benchmarks.experiments import exp_zero_rows as e
  w = shapes.random_weight(128, 2048, 1.3)
  h = jax.random.normal(jax.random.key(1), (4, 128), jnp.bfloat16)
  key = jax.random.key(0)
  inputs = e._inputs(h, 1)
  rows = {name: e._exact_rows(w, None, key, *x, before=name.endswith("_before"))
          for name, x in inputs.items()}
  assert rows == dict(per_row=0, per_row_zero=0, numbers=0, numbers_zero=1,
                      per_row_before=0, per_row_zero_before=1, numbers_before=0,
                      numbers_zero_before=1, per_row_zero_greedy=0)
  for name in ("per_row_zero", "numbers_zero"):
    np.testing.assert_array_equal(
        e._compiled(name, w, None, key, *inputs[name])(key),
        e._compiled(f"{name}_before", w, None, key, *inputs[f"{name}_before"])(key))
