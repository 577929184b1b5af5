"""Plain FP8 vs bf16 sampling (mosaic) on S and L heads, the FP8 read floor, top-k+top-p."""
import json, os, sys, time, datetime
import jax, jax.numpy as jnp, numpy as np
import flashsample_jax as fs
from benchmarks import _timing

out = os.environ.get("OUT", "/tmp")
res = dict(gpu=jax.devices()[0].device_kind, jax=jax.__version__,
           date=datetime.datetime.now().isoformat(), rows=[])
bw = _timing.read_bandwidth(gib=4.0)
res["read_bw_GBps"] = bw / 1e9
def dump():
  with open(os.path.join(out, "bench_quant.json"), "w") as f:
    json.dump(res, f, indent=1)
dump()
SHAPES = {"S": (4096, 151936), "L": (8192, 128256)}
batches = [int(x) for x in os.environ.get("BATCHES", "1,16,64").split(",")]
for name, (d, v) in SHAPES.items():
  r = np.random.default_rng(0)
  wb = (jax.random.normal(jax.random.key(1), (v, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
  scale = (jnp.max(jnp.abs(wb.astype(jnp.float32)), axis=1) / 448.0).astype(jnp.float32)
  w8 = (wb.astype(jnp.float32) / scale[:, None]).astype(jnp.float8_e4m3fn)
  jax.block_until_ready(w8)
  floor8 = v * d / bw * 1e6
  for b in batches:
    h = jax.random.normal(jax.random.key(b), (b, d), jnp.bfloat16)
    key = jax.random.key(0)
    fb = jax.jit(lambda h, w, k: fs.sample(h, w, k, temperature=0.7, backend="mosaic"))
    f8 = jax.jit(lambda h, w, s, k: fs.sample(h, w, k, temperature=0.7, weight_scale=s, backend="mosaic"))
    f8c = jax.jit(lambda h, w, s, k: fs.sample(h, w, k, temperature=0.7, weight_scale=s, top_k=50, top_p=0.9, backend="mosaic"))
    row = dict(shape=name, B=b, floor_fp8_us=floor8, floor_bf16_us=2 * floor8)
    t0 = time.time()
    try:
      row["fp8_us"] = _timing.median_us(f8, h, w8, scale, key, reps=11, inner=20)[0]
      row["bf16_us"] = _timing.median_us(fb, h, wb, key, reps=11, inner=20)[0]
      if b <= 16:
        row["fp8_topk_topp_us"] = _timing.median_us(f8c, h, w8, scale, key, reps=7, inner=10)[0]
      row["fp8_vs_floor"] = row["fp8_us"] / floor8
      row["fp8_vs_bf16"] = row["fp8_us"] / row["bf16_us"]
    except Exception as e:  # keep going: the rest still measures
      row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    row["wall_s"] = time.time() - t0
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
    dump()
  del wb, w8
