"""benchmarks/stamp_timing.py, the second harness: its stamps bracket the
timed call's work, its clock words join across the 32-bit carry, and its
GPU stamp kernel reads %globaltimer (compiled for sm90 here; it runs in a
device session)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from benchmarks import stamp_timing as st


def test_clock_words_join_across_the_carry():
  t0 = np.array([[2**32 - 10, 7]], np.uint32)       # 7 * 2**32 + 2**32 - 10
  t1 = np.array([[5, 8]], np.uint32)                 # 8 * 2**32 + 5
  np.testing.assert_array_equal(st.nanoseconds(t0, t1), [15])


def test_the_stamps_bracket_the_calls_work():
  # A call whose work is an ordered host callback that sleeps 20 ms: the
  # span between the stamps holds it (on a CPU the stamps are the host's
  # clock), so the stamps are ordered around the work, not beside it.
  def slow(x):
    def nap(y):
      time.sleep(0.02)
      return np.asarray(y)
    return io_callback(nap, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                        ordered=True) + 1
  t = st.device_us(slow, jnp.ones((4,), jnp.float32), calls=3, warmup=1)
  assert 20_000 <= t["min_us"] <= t["median_us"] < 1_000_000


def test_the_stamp_kernel_reads_the_gpu_clock():
  pytest.importorskip("triton")
  from pallas_kernels.triton_sampler import compile_for_inspection
  compiled = compile_for_inspection(st._timer_kernel(), {"dep_ptr": "*bf16", "out_ptr": "*u32"},
                                    {}, capability=(9, 0), num_warps=1, num_stages=1)
  ptx = compiled.asm["ptx"]
  assert "%globaltimer" in ptx
  assert ptx.count("st.global.b32") == 2
