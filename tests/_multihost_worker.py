"""One process of the 2-process ``jax.distributed`` test (tests/test_sharding.py).

Run as ``python -m tests._multihost_worker PROCESS_ID NUM_PROCESSES PORT OUT``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and
``JAX_PLATFORMS=cpu``: each process brings 4 CPU devices to one global mesh
of 8, builds the same global inputs from :func:`cases`, samples with
:func:`flashsample_jax.sample_sharded` and process 0 writes the tokens of
every case to ``OUT`` as JSON. The test process compares them with the
reference it computes itself on one device.

Importing this module has no side effects (the test imports :func:`cases`).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def cases():
  """Named multi-host cases: numpy inputs plus the mesh and sampler options.

  ``devices`` gives the mesh's device order as indices into the global
  device list (process 0 owns 0-3, process 1 owns 4-7), chosen so the
  vocabulary axis spans both processes: the all-gather crosses hosts.
  """
  from tests import inputs
  out = []
  # TP=8 over both processes, scalar key, padded vocabulary, greedy mix.
  b, d, v = 10, 64, 1024
  h, w = inputs.exact_inputs(b, d, v, seed=40)
  out.append(dict(
      name="tp8_scalar_key_padded", hidden=np.asarray(h), weight=np.asarray(w),
      key_seed=7, per_row=False,
      temperature=np.asarray(inputs.pow2_temperatures(b, greedy_every=4, seed=1)),
      layout="vd", vocab_size=1000, mesh_shape=(1, 8),
      devices=list(range(8))))
  # DP=2 x TP=4, each TP group spanning both processes; per-row keys, "dv".
  b, d, v = 12, 64, 768
  h, w = inputs.exact_inputs(b, d, v, layout="dv", seed=41)
  out.append(dict(
      name="dp2_tp4_row_keys_dv", hidden=np.asarray(h), weight=np.asarray(w),
      key_seed=8, per_row=True,
      temperature=np.asarray(inputs.pow2_temperatures(b, greedy_every=3, seed=2)),
      layout="dv", vocab_size=None, mesh_shape=(2, 4),
      devices=list(np.arange(8).reshape(4, 2).T.reshape(-1))))
  # DP=2 x TP=4 with the scalar key: global row ids across processes.
  b, d, v = 8, 64, 512
  h, w = inputs.exact_inputs(b, d, v, seed=42)
  out.append(dict(
      name="dp2_tp4_scalar_key", hidden=np.asarray(h), weight=np.asarray(w),
      key_seed=9, per_row=False, temperature=np.float32(2.0), layout="vd",
      vocab_size=None, mesh_shape=(2, 4),
      devices=list(np.arange(8).reshape(4, 2).T.reshape(-1))))
  return out


def key_data(case):
  """Raw uint32 key data for a case: ``[2]`` or ``[B, 2]``."""
  import jax
  from tests import inputs
  if case["per_row"]:
    keys = inputs.row_keys(case["hidden"].shape[0], seed=case["key_seed"])
  else:
    keys = jax.random.key(case["key_seed"])
  return np.asarray(jax.random.key_data(keys))


def _run(process_id: int, num_processes: int, port: int, out_path: str) -> None:
  import jax
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
      process_id=process_id, initialization_timeout=60,
      heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import flashsample_jax as fs

  devices = jax.devices()
  assert len(devices) == 4 * num_processes, devices
  result = {}
  for case in cases():
    mesh = Mesh(np.array([devices[i] for i in case["devices"]]).reshape(
        case["mesh_shape"]), ("dp", "tp"))
    batch_axis = "dp" if case["mesh_shape"][0] > 1 else None
    w_spec = P("tp", None) if case["layout"] == "vd" else P(None, "tp")
    kd = key_data(case)
    temp = np.asarray(case["temperature"], np.float32)

    def glob(x, spec):
      return jax.make_array_from_callback(
          x.shape, NamedSharding(mesh, spec), lambda idx, x=x: x[idx])

    args = (glob(case["hidden"], P(batch_axis, None)),
            glob(case["weight"], w_spec),
            glob(kd, P(batch_axis, None) if case["per_row"] else P()),
            glob(temp, P(batch_axis) if temp.ndim else P()))

    @jax.jit
    def run(h, w, kd, t, case=case, mesh=mesh, batch_axis=batch_axis):
      return fs.sample_sharded(
          h, w, jax.random.wrap_key_data(kd), mesh=mesh, vocab_axis="tp",
          batch_axis=batch_axis, temperature=t, weight_layout=case["layout"],
          vocab_size=case["vocab_size"])

    tokens = multihost_utils.process_allgather(run(*args), tiled=True)
    result[case["name"]] = np.asarray(tokens).tolist()
  if process_id == 0:
    with open(out_path, "w") as f:
      json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  _run(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
