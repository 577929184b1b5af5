"""The decoding example (examples/decode.py, examples/_model.py).

* Same keys, same tokens: decoding with the fused sampler and with
  materialized logits + the baseline sampler gives identical token sequences
  (tied "vd" head and untied "dv" nnx.Linear head), for every generation
  config whose baseline draws the reference's noise.
* The baselines keep what the fused sampler keeps: with the noise of
  ``jax.random.categorical`` on ``[B, V]`` they return its tokens.
* The KV-cache decoder computes what a full forward pass computes, and a
  vocabulary-sharded head decodes the same tokens as an unsharded one.
* The CLI example runs. The benchmarks' smoke modes: tests/test_benchmarks_smoke.py.
"""

from __future__ import annotations

import dataclasses
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


@pytest.mark.parametrize("config,batch,generation", [
    ("tiny-untied", 5, _model.GenerationConfig("t05", temperature=0.5)),
    ("tiny", 4, "llama3")])
def test_fused_and_xla_decode_the_same_tokens(config, batch, generation):
  cfg = _model.CONFIGS[config]
  graphdef, state = _model.init(cfg, seed=1)
  got = {s: _model.generate(cfg, graphdef, state, batch=batch, tokens=10, prompt_len=6,
                            sampler=s, seed=3, generation=generation).tokens
         for s in _model.SAMPLERS}
  assert got["fused"].shape == (batch, 10)
  np.testing.assert_array_equal(got["fused"], got["xla"])
  # The keys matter: another seed draws other tokens.
  other = _model.generate(cfg, graphdef, state, batch=batch, tokens=10, prompt_len=6,
                          sampler="fused", seed=4, generation=generation).tokens
  assert (other != got["fused"]).any()


@pytest.mark.parametrize("name", sorted(_model.GENERATION_CONFIGS))
def test_baseline_keeps_what_the_fused_sampler_keeps(name):
  # Logits from a real (tiny) head: with the reference's noise, every
  # baseline (top-k ones included) gives fs.sample's tokens; the timed top-k
  # baseline draws its noise over the k candidates, so only its distribution
  # is the same, and it must stay inside the kept set.
  from flashsample_jax import flax_heads
  gen = _model.GENERATION_CONFIGS[name]
  cfg = _model.CONFIGS["tiny-untied"]
  graphdef, state = _model.init(cfg, seed=5)
  head = nnx.merge(graphdef, state).head
  hidden = 3 * jax.random.normal(jax.random.key(1), (64, cfg.dim), jnp.float32)
  logits = flax_heads.logits(head, hidden)
  for seed in range(3):
    key = jax.random.key(seed)
    want = flax_heads.sample_from_head(head, hidden, key, backend="xla", **gen.fused_kwargs())
    ref = _model.baseline_tokens(logits, key, gen, noise="reference")
    np.testing.assert_array_equal(ref, want)
    timed = _model.baseline_tokens(logits, key, gen)
    if gen.baseline_noise_is_reference:
      np.testing.assert_array_equal(timed, want)
    else:
      top = jax.lax.top_k(logits, gen.top_k)[1]
      assert (np.asarray(top) == np.asarray(timed)[:, None]).any(axis=1).all()
  with pytest.raises(ValueError, match="noise"):
    _model.baseline_tokens(logits, jax.random.key(0), gen, noise="other")


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p")])
def test_generation_config_rejects_bad_values(bad, match):
  with pytest.raises(ValueError, match=match):
    _model.GenerationConfig("bad", **bad)
  with pytest.raises(ValueError, match="generation config"):
    _model.generation_config("nucleus")


def test_kv_cache_matches_full_forward():
  # Prefill 6 tokens then decode 2 one at a time == one forward pass over 8.
  cfg = dataclasses.replace(_model.CONFIGS["tiny"], dtype="float32")
  graphdef, state = _model.init(cfg)
  fwd = jax.jit(lambda st, t, cache, pos: nnx.merge(graphdef, st)(t, cache, pos))
  tokens = jax.random.randint(jax.random.key(0), (3, 8), 0, cfg.vocab)
  full, _ = fwd(state, tokens, _model.empty_cache(cfg, 3, 10), 0)
  h, cache = fwd(state, tokens[:, :6], _model.empty_cache(cfg, 3, 10), 0)
  steps = [h]
  for i in (6, 7):
    h, cache = fwd(state, tokens[:, i:i + 1], cache, i)
    steps.append(h)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)


def test_vocab_sharded_head_decodes_the_same_tokens(generation="qwen3"):
  # The head split over 4 (CPU) devices, the rest replicated: both samplers
  # decode what they decode on one device.
  from jax.sharding import AxisType
  cfg = _model.CONFIGS["tiny-tp"]
  graphdef, state = _model.init(cfg, seed=2)
  mesh = jax.make_mesh((4,), (_model.VOCAB_AXIS,), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:4])
  placed = _model.place_state(cfg, state, mesh)
  for s in _model.SAMPLERS:
    kw = dict(batch=3, tokens=4, prompt_len=4, sampler=s, generation=generation)
    one = _model.Decoding(cfg, graphdef, state, **kw).run(seed=1).tokens
    tp = _model.Decoding(cfg, graphdef, placed, mesh=mesh, **kw).run(seed=1).tokens
    np.testing.assert_array_equal(tp, one)
  with pytest.raises(ValueError, match="tied"):
    _model.head_sharded_specs(_model.CONFIGS["tiny"], state)


def test_step_weight_bytes_and_floor():
  # Untied: the input embedding is gathered, not streamed; the head is split
  # over vocabulary shards.
  cfg = _model.CONFIGS["qwen3-8b"]
  streamed = cfg.params - cfg.vocab * cfg.dim
  assert cfg.step_weight_bytes() == 2 * streamed
  assert cfg.step_weight_bytes(4) == 2 * (streamed - cfg.vocab * cfg.dim * 3 // 4)
  tied = _model.CONFIGS["qwen3-1.7b"]
  assert tied.step_weight_bytes() == 2 * tied.params
  assert _model.weight_read_floor_ms(cfg, 2 * streamed / 1e-3) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="vocab_shards"):
    cfg.step_weight_bytes(3)
  with pytest.raises(ValueError, match="bandwidth"):
    _model.weight_read_floor_ms(cfg, 0.0)


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
def test_next_token_greedy_is_the_argmax(sampler):
  from flashsample_jax import flax_heads
  cfg = dataclasses.replace(_model.CONFIGS["tiny-untied"], dtype="float32")
  graphdef, state = _model.init(cfg, seed=2)
  model = nnx.merge(graphdef, state)
  hidden = jax.random.normal(jax.random.key(2), (6, cfg.dim), jnp.float32)
  want = jnp.argmax(flax_heads.logits(model.head, hidden), axis=-1)
  for seed in (0, 1):  # greedy: the key does not matter
    got = _model.next_token(model, hidden, jax.random.key(seed), "greedy", sampler)
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


@pytest.mark.parametrize("backend", ["dense", "xla"])
def test_demo_says_what_the_user_chose(backend, capsys):
  # A backend the user named is not "the portable fallback" nor auto's pick.
  from examples import demo
  rc = demo.main(["--config", "tiny", "--batch", "2", "--iters", "1", "--backend", backend])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert f"backend={backend}" in out
  assert f"you chose {backend!r}" in out
  assert "fallback" not in out and "auto" not in out


def test_demo_route_note_is_true_for_each_route():
  from examples import demo
  assert demo.route_note("auto", "mosaic", ["mosaic"]) is None
  assert demo.route_note("triton", "triton", ["triton"]) is None
  assert "no fused kernel on this device" in demo.route_note("auto", "dense", [])
  # On a GPU where auto takes the dense route for a call (large batches): a
  # kernel could run, so the note must not say that none can.
  note = demo.route_note("auto", "dense", ["mosaic", "triton"])
  assert "no fused kernel" not in note and "measured faster" in note


# -- the examples refuse what cannot run here: one line on stderr, exit 2 ----

@pytest.mark.parametrize("argv,says", [
    (["examples/demo.py", "--backend", "mosaic", "--config", "tiny", "--iters", "1"],
     "--backend mosaic cannot run here: the mosaic backend needs an sm90"),
    (["examples/decode.py", "--backend", "mosaic"],
     "--backend mosaic cannot run this call here: the mosaic backend needs an sm90"),
    (["examples/decode.py", "--attention", "cudnn"],
     "--attention cudnn cannot run here: cuDNN attention needs an NVIDIA GPU"),
    (["examples/decode.py", "--backend", "bogus"], "invalid choice: 'bogus'"),
])
def test_examples_refuse_in_one_line(argv, says):
  # The CPU cannot run the Hopper kernel nor cuDNN: expected conditions, so a
  # one-line message and a nonzero exit, not a traceback. Tiny shapes, and
  # each refusal comes before any model is built.
  out = subprocess.run([sys.executable, *argv, "--batch", "1"], cwd=ROOT, env=_cpu_env(),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-3000:])
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  errors = [l for l in out.stderr.splitlines() if ": error: " in l]
  prog = Path(argv[0]).name
  assert errors == [out.stderr.strip().splitlines()[-1]], out.stderr[-3000:]
  assert errors[0].startswith(f"{prog}: error: ") and says in errors[0], errors


def test_decode_help_lists_every_backend(capsys):
  # --backend's choices are the package's own list (fs.BACKENDS), dense included.
  from examples import decode
  import flashsample_jax as fs
  with pytest.raises(SystemExit):
    decode.parse_args(["--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert "{" + ",".join(("auto", *fs.BACKENDS)) + "}" in out
