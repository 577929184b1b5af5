"""The decoding example (examples/decode.py, examples/_model.py) and bench_e2e.

* Same keys, same tokens: decoding with the fused sampler and with
  materialized logits + ``jax.random.categorical`` gives identical token
  sequences (tied "vd" head and untied "dv" nnx.Linear head).
* The KV-cache decoder computes what a full forward pass computes.
* The CLI example and the benchmark's ``--smoke`` mode run as subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples import _model

ROOT = Path(__file__).resolve().parents[1]


def _cpu_env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


# The tied "tiny" config (layout "vd") is checked by test_decode_example_runs.
@pytest.mark.parametrize("config,batch,temperature", [("tiny-untied", 5, 0.5)])
def test_fused_and_xla_decode_the_same_tokens(config, batch, temperature):
  cfg = _model.CONFIGS[config]
  graphdef, state = _model.init(cfg, seed=1)
  got = {s: _model.generate(cfg, graphdef, state, batch=batch, tokens=10, prompt_len=6,
                            sampler=s, seed=3, temperature=temperature).tokens
         for s in _model.SAMPLERS}
  assert got["fused"].shape == (batch, 10)
  np.testing.assert_array_equal(got["fused"], got["xla"])
  # The keys matter: another seed draws other tokens.
  other = _model.generate(cfg, graphdef, state, batch=batch, tokens=10, prompt_len=6,
                          sampler="fused", seed=4, temperature=temperature).tokens
  assert (other != got["fused"]).any()


def test_kv_cache_matches_full_forward():
  # Prefill 6 tokens then decode 2 one at a time == one forward pass over 8.
  cfg = dataclasses.replace(_model.CONFIGS["tiny"], dtype="float32")
  graphdef, state = _model.init(cfg)
  fwd = jax.jit(lambda st, t, kc, vc, pos: nnx.merge(graphdef, st)(t, kc, vc, pos))
  tokens = jax.random.randint(jax.random.key(0), (3, 8), 0, cfg.vocab)
  full, _, _ = fwd(state, tokens, *_model.empty_cache(cfg, 3, 10), 0)
  h, kc, vc = fwd(state, tokens[:, :6], *_model.empty_cache(cfg, 3, 10), 0)
  steps = [h]
  for i in (6, 7):
    h, kc, vc = fwd(state, tokens[:, i:i + 1], kc, vc, i)
    steps.append(h)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)


def test_real_configs_have_the_real_sizes():
  # Parameter counts of Qwen3-1.7B and Qwen3-8B (Hugging Face model cards).
  assert round(_model.CONFIGS["qwen3-1.7b"].params / 1e9, 2) == 1.72
  assert round(_model.CONFIGS["qwen3-8b"].params / 1e9, 2) == 8.19


def test_decode_example_runs():
  # --sampler both exits non-zero unless the samplers decode the same tokens.
  out = subprocess.run(
      [sys.executable, "examples/decode.py", "--sampler", "both", "--batch", "3",
       "--tokens", "6", "--prompt-len", "4", "--temperature", "0.5"],
      cwd=ROOT, env=_cpu_env(), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "TPOT" in out.stdout and "tokens/s" in out.stdout
  assert "fused and xla tokens identical: True" in out.stdout


def test_bench_e2e_smoke(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_e2e", "--smoke", "--batches", "2",
       "--tokens", "2", "--repeats", "1", "--out", str(tmp_path), "--name", "test"],
      cwd=ROOT, env=_cpu_env(), capture_output=True, text=True, timeout=150)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads((tmp_path / "e2e_test.json").read_text())
  assert {"gpu", "jax_version", "date", "rows"} <= set(res)
  assert {(r["batch"], r["sampler"]) for r in res["rows"]} == {
      (b, s) for b in (2,) for s in ("fused", "xla")}
  assert all(r["tpot_ms"] > 0 and r["same_tokens_rows"] == 1.0 for r in res["rows"])
  assert (tmp_path / "e2e_test.md").exists() and (tmp_path / "e2e_test.png").exists()


def test_decode_example_greedy(capsys):
  # --temperature 0 is greedy (as in fs.sample); it used to be rejected.
  from examples import decode
  rc = decode.main(["--sampler", "both", "--batch", "3", "--tokens", "4",
                    "--prompt-len", "4", "--temperature", "0"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "fused and xla tokens identical: True" in out
  for bad in ("-0.5", "nan"):
    with pytest.raises(SystemExit):
      decode.parse_args(["--temperature", bad])
  assert "must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("sampler", _model.SAMPLERS)
def test_next_token_at_temperature_zero_is_the_argmax(sampler):
  from flashsample_jax import flax_heads
  cfg = dataclasses.replace(_model.CONFIGS["tiny-untied"], dtype="float32")
  graphdef, state = _model.init(cfg, seed=2)
  model = nnx.merge(graphdef, state)
  hidden = jax.random.normal(jax.random.key(2), (6, cfg.dim), jnp.float32)
  want = jnp.argmax(flax_heads.logits(model.head, hidden), axis=-1)
  for seed in (0, 1):  # greedy: the key does not matter
    got = _model.next_token(model, hidden, jax.random.key(seed), jnp.float32(0), sampler)
    np.testing.assert_array_equal(got, want)


# -- examples/demo.py: like-for-like baseline, temperature honoured ----------

@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 2.0])
def test_demo_baseline_is_the_reference_sampler(temperature):
  # The timed baseline must sample what fs.sample samples: same temperature,
  # greedy at 0. Exact inputs, so the tokens must be identical.
  from examples import demo
  import flashsample_jax as fs
  from tests import inputs
  h, w = inputs.exact_inputs(8, 64, 1000, seed=3)
  key = jax.random.key(3)
  got = demo.baseline_sampler(temperature)(key, h, w)
  np.testing.assert_array_equal(got, fs.reference.sample(h, w, key, temperature=temperature))
  if temperature == 0:
    np.testing.assert_array_equal(got, jnp.argmax(
        jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32).T), axis=-1))


def test_demo_runs_and_does_not_overclaim(capsys):
  from examples import demo
  rc = demo.main(["--config", "tiny", "--batch", "4", "--temperature", "0.7",
                  "--iters", "1"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "RANDOM weights" in out and "temperature=0.7" in out
  assert "exact inputs: 4/4 rows identical (PASS)" in out
  assert "speedup" not in out.lower()
  # On a CPU the kernel does not run, and the demo must say so.
  assert "no fused kernel on this device" in out
  assert len(out.splitlines()) <= 10
