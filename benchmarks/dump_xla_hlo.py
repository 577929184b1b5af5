"""Dump the optimized HLO of the xla backend for one (B, chunk) on this device.

Used to see which [B, chunk] intermediates XLA materializes (fusion count and
temp bytes). ``python benchmarks/dump_xla_hlo.py OUT_DIR [B] [CHUNK]``.
"""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from flashsample_jax import _validate, xla_backend  # noqa: E402

out = sys.argv[1]
b = int(sys.argv[2]) if len(sys.argv) > 2 else 256
chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 16384
h = jax.ShapeDtypeStruct((b, 4096), jnp.bfloat16)
w = jax.ShapeDtypeStruct((151936, 4096), jnp.bfloat16)
key = jax.random.key(0)
f = jax.jit(lambda h, w: xla_backend.candidates(_validate.prepare(h, w, key), chunk=chunk)[1])
c = f.lower(h, w).compile()
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"xla_backend_B{b}_c{chunk}.hlo.txt"), "w") as fh:
  fh.write(c.as_text())
print("temp MiB", c.memory_analysis().temp_size_in_bytes / 2**20)
