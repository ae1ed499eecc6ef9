"""nvshmem4py starts NVSHMEM; jax_ep.initialize joins that runtime instead of
bootstrapping a second one, its kernels give the contract's results, and the EP
group's PEs (CudaRuntime.group_pes) address the same peers from nvshmem4py."""

import jax
import numpy as np

import jax_ep
import host_reference as hr
from gpu_testing import (assert_bitwise, global_routing, mine, num_ranks, rank, rng, rows, run,
                         setup)


def _start_nvshmem4py():
  import nvshmem.core as nvshmem  # pylint: disable=import-outside-toplevel
  from cuda.core import Device  # pylint: disable=import-outside-toplevel
  from jax._src import distributed  # pylint: disable=import-outside-toplevel

  jax.devices()  # JAX's GPU client first: it owns the CUDA primary context
  device = Device(jax.local_devices()[0].local_hardware_id)
  device.set_current()
  client = distributed.global_state.client
  uid = nvshmem.get_unique_id(empty=rank() != 0)
  if rank() == 0:
    client.key_value_set_bytes("test/nvshmem4py_uid", uid._data.tobytes())
  else:
    raw = client.blocking_key_value_get_bytes("test/nvshmem4py_uid", 60_000)
    uid._data[:] = np.frombuffer(raw, dtype=uid._data.dtype)
  nvshmem.init(device=device, uid=uid, rank=rank(), nranks=num_ranks(), initializer_method="uid")
  return nvshmem, device


def test_jax_ep_joins_nvshmem4py_and_its_group_is_usable_from_it():
  nvshmem, device = _start_nvshmem4py()
  e, k, t, h = 4 * num_ranks(), 4, 16, 256
  config, mesh = setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
                       enable_high_throughput=False)
  cuda = jax_ep.runtime_state().cuda
  assert cuda.joined, "jax_ep bootstrapped its own NVSHMEM instead of joining"
  assert cuda.group_pes == tuple(range(num_ranks()))  # nvshmem4py's ranks are the processes'

  gen = rng(4000)
  x = rows(gen, (num_ranks(), t, h))
  idx = global_routing(gen, (num_ranks(),), t, k, e)
  d = run(lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config), mesh, x, idx)
  want = mine(hr.ll_dispatch(x, idx, config))
  assert_bitwise(d.count, want.count, "count")

  # The EP group from nvshmem4py: each rank puts its EP rank into the next rank's array.
  buf = nvshmem.array((4,), dtype="float32")
  buf[:] = -1
  src = nvshmem.array((4,), dtype="float32")
  src[:] = cuda.rank
  stream = device.create_stream()
  nvshmem.barrier_all(stream=stream)
  nvshmem.put(buf, src, remote_pe=cuda.group_pes[(cuda.rank + 1) % cuda.num_ranks], stream=stream)
  nvshmem.barrier_all(stream=stream)
  stream.sync()
  assert np.all(np.asarray(buf.get()) == (cuda.rank - 1) % cuda.num_ranks)
  nvshmem.free_array(buf)
  nvshmem.free_array(src)

  jax_ep.finalize()  # leaves NVSHMEM up: nvshmem4py started it
  nvshmem.finalize()
