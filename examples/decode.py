"""End-to-end decoding with a Qwen3-style model: fused sampler vs materialized logits.

Builds a randomly initialised Llama/Qwen3-style decoder (examples/_model.py)
at a real model's size, prefills a random prompt, decodes ``--tokens`` tokens
for ``--batch`` rows with a jitted decode step, and prints tokens/s and the
time per output token (TPOT). ``--sampler fused`` samples with
``flashsample_jax.sample`` (backend "auto") straight from the LM head;
``--sampler xla`` materializes the ``[B, V]`` f32 logits and samples from them
the way JAX codebases do (``_model.baseline_tokens``). Both draw the same
tokens for the same ``--seed``, except that a top-k baseline draws its noise
over the k candidates only.

``--floor`` also prints the step's weight-read floor (the bytes of weights a
step reads, at the device's read bandwidth, measured) and TPOT / floor: how
close the decoder itself is to what the hardware allows.

  python examples/decode.py                                   # tiny, CPU, seconds
  python examples/decode.py --sampler both                    # both, same tokens?
  python examples/decode.py --generation-config qwen3         # T 0.6, top-k 20, top-p 0.95
  python examples/decode.py --temperature 0                   # greedy
  python examples/decode.py --config qwen3-8b --batch 1 --tokens 64 --floor   # GPU
  python examples/decode.py --config qwen3-8b --batch 1 --floor --attention xla,cudnn
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

# Runnable as `python examples/decode.py` from a checkout without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from examples import _model  # noqa: E402
from flashsample_jax.backends import BACKENDS  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="tiny", choices=sorted(_model.CONFIGS))
  p.add_argument("--sampler", default="fused", choices=[*_model.SAMPLERS, "both"])
  p.add_argument("--batch", type=int, default=4, help="B, rows decoded together")
  p.add_argument("--tokens", type=int, default=32, help="N, tokens decoded per row")
  p.add_argument("--prompt-len", type=int, default=16, help="random prompt length")
  p.add_argument("--generation-config", default="plain",
                 choices=sorted(_model.GENERATION_CONFIGS),
                 help="named sampling settings (the flags below override them)")
  p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=None, help="0 = off")
  p.add_argument("--top-p", type=float, default=None, help="1 = off")
  p.add_argument("--min-p", type=float, default=None, help="0 = off")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--backend", default="auto", choices=("auto", *BACKENDS),
                 help="flashsample_jax backend of the fused sampler (default: auto, the "
                 "package's pick for each call)")
  p.add_argument("--attention", default="xla",
                 help=f"comma-separated, from {list(_model.ATTENTIONS)}: one run each")
  p.add_argument("--floor", action="store_true",
                 help="print the weight-read floor and TPOT / floor")
  p.add_argument("--bandwidth", type=float, default=None,
                 help="read bandwidth in bytes/s for --floor (default: measured)")
  p.add_argument("--json", type=Path, default=None, help="also write the results here")
  p.add_argument("--show", type=int, default=2, help="rows of tokens to print")
  args = p.parse_args(argv)
  for name in ("batch", "tokens", "prompt_len"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  if args.temperature is not None and not args.temperature >= 0:  # also rejects NaN
    p.error(f"--temperature={args.temperature} must be >= 0 (0 means greedy)")
  args.attention = args.attention.split(",")
  for a in args.attention:
    if a not in _model.ATTENTIONS:
      p.error(f"--attention {a!r} must be one of {list(_model.ATTENTIONS)}")
  base = _model.GENERATION_CONFIGS[args.generation_config]
  over = {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k),
                            ("top_p", args.top_p), ("min_p", args.min_p)) if v is not None}
  try:
    args.generation = (dataclasses.replace(base, name="custom", **over) if over else base)
  except ValueError as e:
    p.error(str(e))
  return args


def describe(gen: _model.GenerationConfig) -> str:
  parts = [f"T {gen.temperature:g}"]
  if gen.top_k:
    parts.append(f"top-k {gen.top_k}")
  if gen.top_p < 1:
    parts.append(f"top-p {gen.top_p:g}")
  if gen.min_p > 0:
    parts.append(f"min-p {gen.min_p:g}")
  return f"{gen.name} ({', '.join(parts)})"


def _refuse(msg: str) -> None:
  """One line on stderr for a run this machine cannot do (not a bug: no traceback)."""
  print(f"decode.py: error: {msg}", file=sys.stderr, flush=True)


def _cannot_run_here(e: Exception, attention: str) -> bool:
  """Whether ``e`` says that this machine cannot run the call (a sampler
  backend or cuDNN declining it), as opposed to a bug."""
  return isinstance(e, NotImplementedError) or (
      attention == "cudnn" and isinstance(e, RuntimeError) and "cudnn" in str(e).lower())


def main(argv=None) -> int:
  args = parse_args(argv)
  cfg, gen = _model.CONFIGS[args.config], args.generation
  samplers = _model.SAMPLERS if args.sampler == "both" else (args.sampler,)
  picked = None
  if "fused" in samplers:
    try:
      picked = _model.fused_backend(cfg, args.batch, args.backend, generation=gen)
    except NotImplementedError as e:
      _refuse(f"--backend {args.backend} cannot run this call here: {e}")
      return 2
  failed = False
  results, records, attentions = {}, [], []
  for attention in args.attention:
    try:
      _model.check_attention(attention)
      attentions.append(attention)
    except NotImplementedError as e:
      _refuse(f"--attention {attention} cannot run here: {e}")
      failed = True
      records.append(dict(config=cfg.name, attention=attention, error=f"{e}"))
  if not attentions:
    return 2
  dev = jax.devices()[0]
  print(f"{cfg.name}: {cfg.params / 1e9:.3f}B params, D={cfg.dim} V={cfg.vocab} "
        f"L={cfg.layers} heads={cfg.heads}/{cfg.kv_heads} F={cfg.ffn} {cfg.dtype}, "
        f"{'tied' if cfg.tied else 'untied'} head; device {dev.device_kind}; "
        f"generation {describe(gen)}")
  floor_ms = None
  if args.floor:
    from benchmarks import _timing
    bw = args.bandwidth or (_timing.read_bandwidth(gib=1 / 16, reps=3)
                            if dev.platform == "cpu" else _timing.read_bandwidth())
    floor_ms = _model.weight_read_floor_ms(cfg, bw)
    print(f"weight-read floor: {cfg.step_weight_bytes() / 1e9:.3f} GB of weights per step "
          f"at {bw / 1e12:.2f} TB/s = {floor_ms:.3f} ms")
  graphdef, state = _model.init(cfg, seed=args.seed)

  def dump():  # after every run, so that a time limit keeps what ran
    if args.json:
      args.json.parent.mkdir(parents=True, exist_ok=True)
      args.json.write_text(json.dumps({"rows": records}, indent=1) + "\n")

  for attention in attentions:
    for name in samplers:
      try:
        dec = _model.Decoding(cfg, graphdef, state, batch=args.batch, tokens=args.tokens,
                              prompt_len=args.prompt_len, sampler=name, generation=gen,
                              backend=args.backend, attention=attention)
        dec.warm_up()  # first-execution work stays out of the timed run
        r = dec.run(seed=args.seed)
      except Exception as e:  # noqa: BLE001  e.g. cuDNN declining a shape: report, go on
        expected = _cannot_run_here(e, attention)
        if len(args.attention) == 1 and not expected:
          raise
        failed = True
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if expected:
          _refuse(f"[{name}, attention {attention}] cannot run here: {msg[:300]}")
        else:
          print(f"[{name}, attention {attention}] failed: {type(e).__name__}: {msg[:300]}")
        records.append(dict(config=cfg.name, attention=attention, sampler=name,
                            error=f"{type(e).__name__}: {msg[:1000]}"))
        dump()
        continue
      results[(attention, name)] = r
      tag = f"{name}: {picked}" if name == "fused" else name
      ratio = f", {r.tpot_ms / floor_ms:.2f}x the floor" if floor_ms else ""
      print(f"[{tag}, attention {attention}] B={args.batch} N={args.tokens} "
            f"prompt={args.prompt_len}: TPOT {r.tpot_ms:.3f} ms{ratio}, "
            f"{r.tokens_per_s:,.0f} tokens/s (compile {dec.compile_s:.1f} s, "
            f"prefill {1e3 * r.prefill_s:.1f} ms)", flush=True)
      for b in range(min(args.show, args.batch)):
        print(f"  row {b}: {r.tokens[b].tolist()}")
      records.append(dict(config=cfg.name, generation=gen.name, attention=attention,
                          sampler=name, batch=args.batch, tokens=args.tokens,
                          tpot_ms=r.tpot_ms, floor_ms=floor_ms,
                          tpot_over_floor=r.tpot_ms / floor_ms if floor_ms else None,
                          compile_s=dec.compile_s, device=dev.device_kind,
                          jax_version=jax.__version__))
      dump()
  rc = 2 if failed else 0
  for attention in attentions:
    if len(samplers) < 2 or (attention, "fused") not in results or (
        attention, "xla") not in results:
      continue
    same = np.array_equal(results[(attention, "fused")].tokens,
                          results[(attention, "xla")].tokens)
    if gen.baseline_noise_is_reference:
      print(f"fused and xla tokens identical: {same}")
      rc |= 0 if same else 1
    else:
      print(f"fused and xla tokens identical: {same} (expected to differ: the top-k "
            "baseline draws its noise over the k candidates only)")
  return rc


if __name__ == "__main__":
  sys.exit(main())
