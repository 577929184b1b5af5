"""End-to-end decode benchmark: time per output token, fused sampler vs XLA baselines.

For each model config, generation config and batch size B, decodes N tokens
with the Qwen3-style model of examples/_model.py (random bf16 weights made on
the device) once per sampler and repeat, in the same process:

* ``fused``: ``flashsample_jax.sample`` (backend "auto") from the LM head as
  stored, with the generation config's controls; no ``[B, V]`` logits;
* ``xla``: f32 logits ``hidden @ W.T`` then the generation config written the
  way JAX codebases write it (``examples/_model.baseline_tokens``):

  ========  ==============================  ======================================
  name      settings                        baseline
  ========  ==============================  ======================================
  plain     T 1                             ``jax.random.categorical``
  greedy    T 0                             ``jnp.argmax``
  qwen3     T 0.6, top-k 20, top-p 0.95     ``lax.top_k``, top-p on the k,
                                            categorical over the k (MaxText, T5X)
  llama3    T 0.6, top-p 0.9                full sort for the cutoff, mask,
                                            categorical (MaxText's nucleus)
  min-p     T 1, min-p 0.1                  mask ``exp(t - max t) < 0.1``,
                                            categorical
  ========  ==============================  ======================================

TPOT = wall time of N back-to-back decode steps / N (the whole batch gets one
token per step), median over repeats, samplers interleaved. Beside it, the
step's weight-read floor: the bytes of the weights a step reads
(``Config.step_weight_bytes``) at the device's read bandwidth, measured in the
same run (a large ``jnp.sum``).

Token agreement, reported, not asserted (near-ties can flip, and each baseline
has its own tie rules):

* ``same tokens``: share of rows whose N decoded tokens are identical (same
  keys). The top-k baselines draw their noise over the k candidates, not over
  the vocabulary, so for them this is expected to be low.
* ``same first token``: the first sampled token, from the same prompt; for the
  top-k baselines with the kept set the baseline computes but the noise of
  ``jax.random.categorical`` on the full ``[B, V]`` (what the fused sampler
  matches): do both keep the same candidates?

Beside them, from the first step (un-timed): the logits' spread over the
vocabulary, and the share of rows the fused sampler decides on its exact
materialized path (a kept set its candidate lists cannot hold). Random
weights give logits of std ~1, flat enough that top-p alone and min-p keep
thousands of ids and every row takes that path; ``--logit-std`` sets the
final norm's gain for a wider spread (e.g. 4), where the nucleus fits the lists.

``--head-dtype`` (docs/design.md, "Quantized heads"): the LM head as
stored, ``bf16`` (the default), or quantized per vocabulary row to ``fp8``
(float8_e4m3fn), ``fp8_e5m2`` or ``int8`` with
:func:`flashsample_jax.flax_heads.quantize_head` (absmax scales, f32 ``[V]``);
the rest of the decoder stays bf16. Both samplers read the same quantized
head: ``fused`` passes its scales as ``weight_scale``, ``xla`` materializes
``f32(h @ W8.astype(bf16).T) * scale``. Several head dtypes (``bf16,fp8``)
share the decoder's weights and run interleaved, like the samplers; every
row says its head dtype, and the floor counts the head at its dtype (plus its
4V bytes of scales). A quantized head needs an untied model (``qwen3-8b``,
the default then; ``tiny-untied`` with ``--smoke``): a tied head is the input
embedding, which stays bf16. The exact-path share is not reported for
quantized heads (benchmarks/_fallback.py takes no ``weight_scale``).

Writes ``benchmarks/results/e2e_<gpu>.{json,md,png}`` (``e2e_<gpu>_head-<dtypes>``
with a quantized head; ``e2e_<name>`` with ``--name``; rewritten after every
point, so a run stopped by a time limit keeps what it measured) with the GPU
name, jax version and date.

  python3 -m benchmarks.bench_e2e --generation-config plain,qwen3     # GPU
  python3 -m benchmarks.bench_e2e --generation-config all --configs qwen3-1.7b
  python3 -m benchmarks.bench_e2e --head-dtype bf16,fp8 --configs qwen3-8b
  python3 -m benchmarks.bench_e2e --smoke                             # CPU, seconds
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks import _timing  # noqa: E402
from benchmarks._fallback import exact_path_rows  # noqa: E402
from examples import _model  # noqa: E402
import flashsample_jax as fs  # noqa: E402
from flashsample_jax import flax_heads  # noqa: E402

BATCHES = (1, 16, 64, 128, 256)
GPU_CONFIGS = ("qwen3-1.7b", "qwen3-8b")
# Headline configs first: a run cut short by its time limit keeps them.
GENERATIONS = ("plain", "qwen3", "greedy", "llama3", "min-p")
# --head-dtype name -> the dtype flax_heads.quantize_head takes (None: as stored).
HEAD_DTYPES = {"bf16": None, "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
               "int8": "int8"}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny config, few tokens: a CPU check that the script works")
  p.add_argument("--configs", default=None,
                 help=f"model configs, comma-separated, from {sorted(_model.CONFIGS)}; "
                 f"default {','.join(GPU_CONFIGS)} (--smoke: tiny)")
  p.add_argument("--generation-config", default="plain",
                 help=f"comma-separated names from {list(GENERATIONS)}, or 'all'")
  p.add_argument("--batches", default=None,
                 help=f"default {','.join(map(str, BATCHES))} (--smoke: 2)")
  p.add_argument("--head-dtype", default="bf16",
                 help=f"the LM head's dtype, comma-separated from {list(HEAD_DTYPES)}: "
                 "bf16 as stored, or quantized per row (fp8 = float8_e4m3fn); the rest "
                 "of the decoder stays bf16. A quantized head needs an untied config "
                 "(default then qwen3-8b; --smoke: tiny-untied)")
  add_decode_args(p, point="batch size")
  a = p.parse_args(argv)
  a.head_dtypes = list(dict.fromkeys(a.head_dtype.split(",")))
  for hd in a.head_dtypes:
    if hd not in HEAD_DTYPES:
      p.error(f"unknown head dtype {hd!r}; choose from {list(HEAD_DTYPES)}")
  quantized = any(HEAD_DTYPES[hd] for hd in a.head_dtypes)
  default = (("tiny-untied" if a.smoke else "qwen3-8b") if quantized else
             ("tiny" if a.smoke else ",".join(GPU_CONFIGS)))
  a.configs = (a.configs or default).split(",")
  for c in a.configs:
    if c not in _model.CONFIGS:
      p.error(f"unknown config {c!r}; choose from {sorted(_model.CONFIGS)}")
    if quantized and _model.CONFIGS[c].tied:
      untied = sorted(k for k, v in _model.CONFIGS.items() if not v.tied)
      p.error(f"config {c!r} has a tied LM head (the input embedding, which stays bf16): "
              f"--head-dtype {a.head_dtype} needs an untied one, from {untied}")
  gens = GENERATIONS if a.generation_config == "all" else a.generation_config.split(",")
  for g in gens:
    if g not in _model.GENERATION_CONFIGS:
      p.error(f"unknown generation config {g!r}; choose from {list(GENERATIONS)} or 'all'")
  a.generations = list(dict.fromkeys(gens))
  a.batches = [int(b) for b in (a.batches or ("2" if a.smoke else
                                              ",".join(map(str, BATCHES)))).split(",")]
  if min(a.batches) < 1:
    p.error(f"--batches={a.batches}: every B must be >= 1")
  check_decode_args(p, a, smoke_tokens=4, smoke_prompt_len=8, gpu_compile_threads=4)
  return a


def add_decode_args(p: argparse.ArgumentParser, *, point: str) -> None:
  """The arguments of the decode runs, shared by the end-to-end benchmarks
  (``point``: what a time budget stops starting, for the help text)."""
  p.add_argument("--tokens", type=int, default=None, help="N per run (default 32)")
  p.add_argument("--prompt-len", type=int, default=None, help="default 64")
  p.add_argument("--repeats", type=int, default=None, help="runs per sampler (default 3; smoke 1)")
  p.add_argument("--backend", default="auto",
                 help="flashsample_jax backend of the fused sampler (auto, mosaic, triton, xla)")
  p.add_argument("--logit-std", type=float, default=None,
                 help="spread of the logits over the vocabulary (the final norm's gain is "
                 "set for it; default: the random weights' own, about 1, far flatter "
                 "than a trained model's)")
  p.add_argument("--attention", default="xla", choices=_model.ATTENTIONS,
                 help="the decoder's attention (jax.nn.dot_product_attention implementation)")
  p.add_argument("--compile-threads", type=int, default=None,
                 help="step programs compiled at once (default: a few on a GPU, 1 on a CPU)")
  p.add_argument("--bandwidth", type=float, default=None,
                 help="read bandwidth in bytes/s for the floor (default: measured)")
  p.add_argument("--budget-s", type=float, default=None,
                 help=f"start no new {point} after this many seconds (results so far are kept)")
  p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
  p.add_argument("--name", default=None, help="file stem suffix (default: the device)")
  p.add_argument("--no-plot", action="store_true")


def check_decode_args(p: argparse.ArgumentParser, a, *, smoke_tokens: int,
                      smoke_prompt_len: int, gpu_compile_threads: int) -> None:
  """Fills in the defaults of :func:`add_decode_args`' arguments (smaller
  ones with ``--smoke``) and rejects bad values through ``p.error``."""
  a.tokens = a.tokens or (smoke_tokens if a.smoke else 32)
  a.prompt_len = a.prompt_len or (smoke_prompt_len if a.smoke else 64)
  a.repeats = a.repeats or (1 if a.smoke else 3)
  for name in ("tokens", "prompt_len", "repeats"):
    if getattr(a, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
  if a.logit_std is not None and not a.logit_std > 0:
    p.error(f"--logit-std={a.logit_std} must be > 0")
  if a.compile_threads is None:
    a.compile_threads = 1 if jax.default_backend() == "cpu" else gpu_compile_threads


device_name = _timing.device_name
slug = _timing.slug


def measure_bandwidth() -> float:
  """Read bandwidth in bytes/s (a few GiB on a GPU; a token amount on a CPU)."""
  if jax.default_backend() == "cpu":
    return _timing.read_bandwidth(gib=1 / 16, reps=3)
  return _timing.read_bandwidth()


def with_head_dtype(graphdef, state, head_dtype: str):
  """``(graphdef, state)`` of the decoder with its LM head in ``head_dtype``:
  as it is for bf16; else the ``nnx.Linear`` head replaced by its
  :class:`flashsample_jax.flax_heads.QuantizedHead` (which
  ``flax_heads.sample_from_head`` and ``flax_heads.logits``, hence both
  samplers, read with its scales). The other weights are the same arrays."""
  if HEAD_DTYPES[head_dtype] is None:
    return graphdef, state
  model = nnx.merge(graphdef, state)
  model.lm_head = flax_heads.quantize_head(model.lm_head, HEAD_DTYPES[head_dtype])
  return nnx.split(model)


def head_arrays(graphdef, state):
  """``(weight, weight_layout, weight_scale or None)`` of the model's LM head."""
  head = nnx.merge(graphdef, state).head
  w, layout = flax_heads.head_weight(head)
  return w, layout, getattr(head, "scale", None)


def step_weight_bytes(cfg, graphdef, state) -> int:
  """:meth:`Config.step_weight_bytes` with the LM head (and its scales) at
  the bytes it is stored in."""
  w, _, scale = head_arrays(graphdef, state)
  as_bf16 = cfg.vocab * cfg.dim * jax.numpy.dtype(cfg.dtype).itemsize
  stored = w.size * w.dtype.itemsize + (0 if scale is None else scale.size * 4)
  return cfg.step_weight_bytes() - as_bf16 + stored


def fused_backend(cfg, graphdef, state, batch: int, backend: str, gen) -> str:
  """The backend ``backend`` resolves to for the model's LM head as stored
  (:func:`examples._model.fused_backend`, with the scales of a quantized head)."""
  w, layout, scale = head_arrays(graphdef, state)
  if scale is None:
    return _model.fused_backend(cfg, batch, backend, generation=gen)
  picked = []

  def probe(h, w, s):
    picked.append(fs.which_backend(h, w, jax.random.key(0), backend=backend,
                                   weight_layout=layout, weight_scale=s,
                                   **gen.fused_kwargs()))
    return h

  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  jax.eval_shape(probe, jax.ShapeDtypeStruct((batch, cfg.dim), jax.numpy.dtype(cfg.dtype)),
                 sds(w), sds(scale))
  return picked[0]


@functools.lru_cache(maxsize=None)
def _reference_noise_fn(graphdef, gen):
  """The baseline's kept set sampled with the reference's noise (un-timed)."""
  @jax.jit
  def f(state, hidden, key):
    logits = flax_heads.logits(nnx.merge(graphdef, state).head, hidden)
    return _model.baseline_tokens(logits, key, gen, noise="reference")
  return f


def first_step_logits(graphdef, state, hidden):
  """The f32 logits of the first decode step (un-timed; for diagnostics)."""
  h = jax.device_put(hidden, jax.tree.leaves(state)[0].sharding)
  return _logits_fn(graphdef)(state, h)


@functools.lru_cache(maxsize=None)
def _logits_fn(graphdef):
  return jax.jit(lambda state, h: flax_heads.logits(nnx.merge(graphdef, state).head, h))


def exact_path_share(graphdef, state, gen, hidden, key, backend) -> float | None:
  """Share of the first step's rows whose controls the fused sampler decides
  on the exact materialized path (a kept set larger than its candidate
  lists: top-p alone or min-p on flat logits)."""
  kw = gen.fused_kwargs()
  if len(kw) == 1:           # temperature alone: no candidate lists
    return 0.0
  w, layout, scale = head_arrays(graphdef, state)
  h = jax.device_put(hidden, jax.tree.leaves(state)[0].sharding)
  return exact_path_rows(h, w, key, weight_layout=layout, backend=backend,
                         weight_scale=scale, **kw) / h.shape[0]


def first_token_agreement(runs, graphdef, state, gen, prompt_len) -> float:
  """Share of rows whose first token agrees (see the module docstring)."""
  same = []
  for seed, (f, x) in enumerate(zip(runs["fused"], runs["xla"])):
    if gen.baseline_noise_is_reference:
      ref = x.tokens[:, 0]
    else:
      # On the devices of state: the hidden states may be replicated over a mesh.
      h = jax.device_put(x.hidden0, jax.tree.leaves(state)[0].sharding)
      ref = np.asarray(_reference_noise_fn(graphdef, gen)(
          state, h, _model.step_key(seed, prompt_len)))
    same.append(np.mean(f.tokens[:, 0] == ref))
  return float(np.mean(same))


def compile_all(decs: list, threads: int) -> None:
  """Compiles the first program alone (it fills XLA's autotuning cache for
  this batch size's matmuls, so that the others reuse its choices instead of
  autotuning at the same time), then the rest ``threads`` at a time; then
  runs each briefly, untimed (:meth:`Decoding.warm_up`)."""
  if not decs:
    return
  decs[0].compile()
  if threads <= 1:
    for d in decs[1:]:
      d.compile()
  else:
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      list(pool.map(lambda d: d.compile(), decs[1:]))
  for d in decs:
    d.warm_up()


def bench(args, on_point=None) -> dict:
  t_start = time.perf_counter()
  gpu = device_name()
  bandwidth = args.bandwidth or measure_bandwidth()
  res = dict(
      benchmark="e2e_decode", gpu=gpu, device_count=jax.device_count(),
      jax_version=jax.__version__, backend=jax.default_backend(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      tokens=args.tokens, prompt_len=args.prompt_len, repeats=args.repeats,
      dtype="bfloat16", head_dtypes=list(args.head_dtypes),
      samplers=list(_model.SAMPLERS), attention=args.attention,
      requested_backend=args.backend, read_bandwidth_Bps=bandwidth,
      generation_configs={g: {**dataclasses.asdict(_model.GENERATION_CONFIGS[g]),
                              "baseline": _model.GENERATION_CONFIGS[g].describe_baseline()}
                          for g in args.generations},
      logit_std_target=args.logit_std, smoke=args.smoke, complete=False, rows=[])
  total = len(args.configs) * len(args.batches) * len(args.generations)
  bar = tqdm(total=total, desc="e2e", unit="point")
  stopped = False
  for cfg_name in args.configs:
    cfg = _model.CONFIGS[cfg_name]
    bar.set_postfix_str(f"{cfg_name}: init")
    graphdef, state = _model.init(cfg, logit_std=args.logit_std)
    # One model per head dtype, sharing every weight but the head.
    models = {hd: with_head_dtype(graphdef, state, hd) for hd in args.head_dtypes}
    del graphdef, state
    jax.block_until_ready([st for _, st in models.values()])
    floors = {hd: 1e3 * step_weight_bytes(cfg, *m) / bandwidth for hd, m in models.items()}
    for b in args.batches:
      if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
        print(f"time budget of {args.budget_s:.0f} s spent: skipping {cfg_name} B={b} and later")
        stopped = True
        break
      bar.set_postfix_str(f"{cfg_name} B={b}: compile")
      decs = {}
      for hd in args.head_dtypes:
        decs.update({(g, hd, s): _model.Decoding(
            cfg, *models[hd], batch=b, tokens=args.tokens, prompt_len=args.prompt_len,
            sampler=s, generation=g, backend=args.backend, attention=args.attention)
                     for g in args.generations for s in _model.SAMPLERS[::-1]})
      compile_all(list(decs.values()), args.compile_threads)
      for g in args.generations:
        gen = _model.GENERATION_CONFIGS[g]
        runs = {(hd, s): [] for hd in args.head_dtypes for s in _model.SAMPLERS}
        for r in range(args.repeats):
          for hd, s in runs:  # interleaved, so drift hits all alike
            bar.set_postfix_str(f"{cfg_name} B={b} {g} {hd}: {s} #{r}")
            runs[(hd, s)].append(decs[(g, hd, s)].run(seed=r))
        for hd in args.head_dtypes:
          graphdef, state = models[hd]
          mine = {s: runs[(hd, s)] for s in _model.SAMPLERS}
          floor_ms = floors[hd]
          same_rows = float(np.mean([np.all(f.tokens == x.tokens, axis=1).mean()
                                     for f, x in zip(mine["fused"], mine["xla"])]))
          same_first = first_token_agreement(mine, graphdef, state, gen, args.prompt_len)
          h0 = mine["fused"][0].hidden0
          logits0 = first_step_logits(graphdef, state, h0)
          logit_std = float(np.mean(np.asarray(jax.numpy.std(logits0, axis=1))))
          del logits0
          exact_share = exact_path_share(graphdef, state, gen, h0,
                                         _model.step_key(0, args.prompt_len), args.backend)
          for s in _model.SAMPLERS:
            tpots = [r.tpot_ms for r in mine[s]]
            tpot = statistics.median(tpots)
            res["rows"].append(dict(
                config=cfg_name, generation=g, params=cfg.params, dim=cfg.dim,
                vocab=cfg.vocab, layers=cfg.layers, tied=cfg.tied, head_dtype=hd,
                batch=b, sampler=s,
                baseline=gen.describe_baseline() if s == "xla" else None,
                fused_backend=(fused_backend(cfg, graphdef, state, b, args.backend, gen)
                               if s == "fused" else None),
                tpot_ms=tpot, tpot_ms_runs=tpots, tokens_per_s=b / (tpot / 1e3),
                floor_ms=floor_ms, tpot_over_floor=tpot / floor_ms,
                prefill_ms=statistics.median(1e3 * r.prefill_s for r in mine[s]),
                compile_s=decs[(g, hd, s)].compile_s, same_tokens_rows=same_rows,
                same_first_token_rows=same_first, logit_std=logit_std,
                exact_path_rows=exact_share if s == "fused" else None))
          f, x = res["rows"][-2:]
          exact = "-" if exact_share is None else f"{100 * exact_share:.0f}%"
          print(f"{cfg_name} {g} B={b} head {hd}: fused {f['tpot_ms']:.3f} ms, xla "
                f"{x['tpot_ms']:.3f} ms ({x['tpot_ms'] / f['tpot_ms']:.3f}x), floor "
                f"{floor_ms:.3f} ms, same tokens {100 * same_rows:.1f}%, same first token "
                f"{100 * same_first:.1f}%, logit std {logit_std:.2f}, exact-path rows "
                f"{exact}", flush=True)
        bar.update()
        if on_point:
          on_point(res)
      del decs
    _model.forget_programs()
    del models
    if stopped:
      break
  bar.close()
  res["complete"] = not stopped
  res["wall_s"] = time.perf_counter() - t_start
  return res


def _head(r: dict) -> str:
  return r.get("head_dtype", "bf16")       # results from before --head-dtype: bf16


def _pairs(res: dict):
  """``(fused row, xla row)`` per (config, generation, head dtype, batch),
  sorted by config, generation and head dtype as run, then by B (the suite
  may run B out of order)."""
  by = {(r["config"], r["generation"], _head(r), r["batch"], r["sampler"]): r
        for r in res["rows"]}
  configs = list(dict.fromkeys(r["config"] for r in res["rows"]))
  gens = list(res["generation_configs"])
  heads = list(res.get("head_dtypes", ["bf16"]))
  keys = sorted((k[:4] for k in by if k[4] == "fused" and (*k[:4], "xla") in by),
                key=lambda k: (configs.index(k[0]), gens.index(k[1]), heads.index(k[2]), k[3]))
  for k in keys:
    yield by[(*k, "fused")], by[(*k, "xla")]


def markdown(res: dict) -> str:
  lines = [
      "# End-to-end decode: time per output token (TPOT)",
      "",
      f"{res['gpu']}, jax {res['jax_version']}, {res['date']}. Random bf16 weights"
      + (f" (final norm set for a logit std of {res['logit_std_target']:g})"
         if res.get("logit_std_target") else " (logit std about 1: flat distributions)")
      + (", the LM head quantized per row where the head column says so (fp8 = "
         "float8_e4m3fn; absmax f32 scales [V]; both samplers read the quantized head, "
         "the floor counts it at its bytes)"
         if set(res.get("head_dtypes", ["bf16"])) != {"bf16"} else "")
      + ", "
      f"prompt {res['prompt_len']}, N={res['tokens']} tokens, median of "
      f"{res['repeats']} runs, attention {res['attention']}. fused = "
      "flashsample_jax.sample (auto) with the generation config's controls; xla = f32 "
      "logits + the baseline below. Floor: the step's weights read once at "
      f"{res['read_bandwidth_Bps'] / 1e12:.2f} TB/s (measured)."
      + ("" if res.get("complete", True) else " **Stopped early by its time budget.**"),
      "",
  ]
  for g, gc in res["generation_configs"].items():
    lines.append(f"* `{g}`: T {gc['temperature']}"
                 + (f", top-k {gc['top_k']}" if gc["top_k"] else "")
                 + (f", top-p {gc['top_p']}" if gc["top_p"] < 1 else "")
                 + (f", min-p {gc['min_p']}" if gc["min_p"] > 0 else "")
                 + f". Baseline: {gc['baseline']}.")
  lines += [
      "",
      "Same tokens: rows whose whole decode is identical (low by design where the "
      "baseline draws its noise over the top-k candidates); same first token: the first "
      "token, top-k baselines re-drawn with the noise of jax.random.categorical over "
      "[B, V] (do both keep the same candidates?). Exact path: the share of the first "
      "step's rows that the fused sampler decides from materialized logits (its candidate "
      "lists cannot hold the kept set); logit std: of the first step's logits over the "
      "vocabulary, mean over rows.",
      "",
      "| config | generation | B | head | fused backend | fused TPOT ms | xla TPOT ms | "
      "speedup | floor ms | fused / floor | xla / floor | same tokens | same first token | "
      "exact path | logit std |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for f, x in _pairs(res):
    exact = ("-" if f.get("exact_path_rows") is None
             else f"{100 * f['exact_path_rows']:.0f}%")
    lines.append(
        f"| {f['config']} | {f['generation']} | {f['batch']} | {_head(f)} | "
        f"{f['fused_backend']} | "
        f"{f['tpot_ms']:.3f} | {x['tpot_ms']:.3f} | {x['tpot_ms'] / f['tpot_ms']:.3f}x | "
        f"{f['floor_ms']:.3f} | {f['tpot_over_floor']:.2f} | {x['tpot_over_floor']:.2f} | "
        f"{100 * f['same_tokens_rows']:.1f}% | {100 * f['same_first_token_rows']:.1f}% | "
        f"{exact} | " + (f"{f['logit_std']:.2f} |" if f.get("logit_std") is not None
                         else "- |"))
  return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  configs = list(dict.fromkeys(r["config"] for r in res["rows"]))
  if not configs:
    return
  gens = list(res["generation_configs"])
  heads = list(res.get("head_dtypes", ["bf16"]))
  series = [(g, hd) for g in gens for hd in heads]
  colors = dict(zip(series, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
  name = lambda g, hd: g if heads == ["bf16"] else f"{g} {hd} head"
  fig, axes = plt.subplots(2, len(configs), figsize=(5.5 * len(configs), 7.5), squeeze=False)
  pairs = list(_pairs(res))
  for col, cfg in enumerate(configs):
    top, bottom = axes[0][col], axes[1][col]
    for g, hd in series:
      ps = sorted(((f, x) for f, x in pairs if f["config"] == cfg and f["generation"] == g
                   and _head(f) == hd), key=lambda p: p[0]["batch"])
      if not ps:
        continue
      bs = [f["batch"] for f, _ in ps]
      c = colors[(g, hd)]
      top.plot(bs, [f["tpot_ms"] for f, _ in ps], "o-", color=c, label=f"{name(g, hd)}: fused")
      top.plot(bs, [x["tpot_ms"] for _, x in ps], "s--", color=c, label=f"{name(g, hd)}: xla")
      bottom.plot(bs, [x["tpot_ms"] / f["tpot_ms"] for f, x in ps], "o-", color=c,
                  label=name(g, hd))
    fl = [r for r in res["rows"] if r["config"] == cfg]
    floors = {}                                   # floor ms -> head dtypes (fp8 = int8)
    for hd in heads:
      floor = next((r["floor_ms"] for r in fl if _head(r) == hd), None)
      if floor is not None:
        floors.setdefault(floor, []).append(hd)
    for i, (floor, hds) in enumerate(floors.items()):
      top.axhline(floor, color="k", lw=1, ls=(":", "-.", "--", "-")[i % 4],
                  label="weight-read floor" + ("" if heads == ["bf16"]
                                               else f" ({', '.join(hds)} head)"))
    bottom.axhline(1.0, color="k", lw=1)
    bs = sorted({r["batch"] for r in fl})
    _timing.pow2_axis(top, bs, "batch B", "time per output token (ms)", cfg)
    _timing.pow2_axis(bottom, bs, "batch B")
    bottom.set_ylabel("speedup of the step (xla / fused)")
    for ax in (top, bottom):
      ax.legend(fontsize=7)
  fig.suptitle(f"End-to-end decode TPOT, {res['gpu']}, jax {res['jax_version']}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  args = parse_args(argv)
  heads = "" if args.head_dtypes == ["bf16"] else "_head-" + "-".join(args.head_dtypes)
  stem = f"e2e_{args.name}" if args.name else f"e2e_{slug(device_name())}{heads}"
  _timing.run_and_write(bench, args, stem, markdown=markdown, plot=plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())
