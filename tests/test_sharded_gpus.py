"""``fs.sample_sharded`` over the GPUs of one host (nvidia-h200-x2).

``tests/test_sharding.py`` runs the sharded paths on 8 CPU devices; this is
the same call with the kernels on each GPU: ``auto`` must pick each shard's
backend for the shard's part of the head (an 8-bit head of 192 rows suits
the mosaic kernel, its 96-row halves do not).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import flashsample_jax as fs


@pytest.mark.gpu
@pytest.mark.parametrize("rows,dim,batch,dtype", [(192, 256, 4, "int8"), (192, 256, 4, "fp8"),
                                                  (4096, 512, 16, "fp8"),
                                                  (4096, 512, 16, None)])
@pytest.mark.parametrize("controls", [{}, dict(top_k=20, top_p=0.9)], ids=["plain", "top_k_p"])
def test_gpu_shards_equal_reference(rows, dim, batch, dtype, controls):
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 GPUs")
  r = np.random.default_rng(rows + dim)
  w = jnp.asarray(r.integers(-3, 4, (rows, dim)), jnp.bfloat16)
  h = jnp.asarray(r.integers(-2, 3, (batch, dim)), jnp.bfloat16)
  scale = None
  if dtype:
    w, scale = fs.quantize_weight(w, dtype)
  key = jax.random.key(3)
  mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:2])
  got = fs.sample_sharded(h, w, key, mesh=mesh, vocab_axis="tp", weight_scale=scale,
                          **controls)
  np.testing.assert_array_equal(got, fs.reference.sample(h, w, key, weight_scale=scale,
                                                         **controls))
