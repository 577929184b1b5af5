"""End-to-end decoding with a Qwen3-style model: fused sampler vs materialized logits.

Builds a randomly initialised Llama/Qwen3-style decoder (examples/_model.py)
at a real model's size, prefills a random prompt, decodes ``--tokens`` tokens
for ``--batch`` rows with a jitted decode step, and prints tokens/s and the
time per output token (TPOT). ``--sampler fused`` samples with
``flashsample_jax.sample`` (backend "auto") straight from the LM head;
``--sampler xla`` materializes the ``[B, V]`` f32 logits and calls
``jax.random.categorical``. Both draw the same tokens for the same ``--seed``.

  python examples/decode.py                                   # tiny, CPU, seconds
  python examples/decode.py --sampler xla
  python examples/decode.py --config qwen3-8b --batch 16 --tokens 128   # GPU
  python examples/decode.py --sampler both                    # both, same tokens?
  python examples/decode.py --temperature 0                   # greedy
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Runnable as `python examples/decode.py` from a checkout without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from examples import _model  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="tiny", choices=sorted(_model.CONFIGS))
  p.add_argument("--sampler", default="fused", choices=[*_model.SAMPLERS, "both"])
  p.add_argument("--batch", type=int, default=4, help="B, rows decoded together")
  p.add_argument("--tokens", type=int, default=32, help="N, tokens decoded per row")
  p.add_argument("--prompt-len", type=int, default=16, help="random prompt length")
  p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--backend", default="auto",
                 help="flashsample_jax backend of the fused sampler (auto, mosaic, xla)")
  p.add_argument("--show", type=int, default=2, help="rows of tokens to print")
  args = p.parse_args(argv)
  for name in ("batch", "tokens", "prompt_len"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  if not args.temperature >= 0:  # also rejects NaN
    p.error(f"--temperature={args.temperature} must be >= 0 (0 means greedy)")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  cfg = _model.CONFIGS[args.config]
  dev = jax.devices()[0]
  print(f"{cfg.name}: {cfg.params / 1e9:.3f}B params, D={cfg.dim} V={cfg.vocab} "
        f"L={cfg.layers} heads={cfg.heads}/{cfg.kv_heads} F={cfg.ffn} {cfg.dtype}, "
        f"{'tied' if cfg.tied else 'untied'} head; device {dev.device_kind}")
  graphdef, state = _model.init(cfg, seed=args.seed)
  samplers = _model.SAMPLERS if args.sampler == "both" else (args.sampler,)
  results = {}
  for name in samplers:
    dec = _model.Decoding(cfg, graphdef, state, batch=args.batch, tokens=args.tokens,
                          prompt_len=args.prompt_len, sampler=name, backend=args.backend)
    r = dec.run(seed=args.seed, temperature=args.temperature)
    results[name] = r
    tag = f"{name}: {_model.fused_backend(cfg, args.batch, args.backend)}" if name == "fused" else name
    print(f"[{tag}] B={args.batch} N={args.tokens} prompt={args.prompt_len}: "
          f"TPOT {r.tpot_ms:.3f} ms, {r.tokens_per_s:,.0f} tokens/s "
          f"(compile {dec.compile_s:.1f} s, prefill {1e3 * r.prefill_s:.1f} ms)")
    for b in range(min(args.show, args.batch)):
      print(f"  row {b}: {r.tokens[b].tolist()}")
  if len(results) == 2:
    same = np.array_equal(results["fused"].tokens, results["xla"].tokens)
    print(f"fused and xla tokens identical: {same}")
    return 0 if same else 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
