"""The README's main job: examples/moe_layer.py runs and matches the dense layer.

It runs here the way it runs on 0, 1 and 2+ GPUs: on 8 CPU devices, on a
1-device mesh in one process (EP1, as on one GPU) and under jax_ep.launch with
one process per device; what its step lowers to on the CUDA backend (the HT
kernels for bf16 rows) is checked without a GPU.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _extension, launch
from jax_ep.backends import cuda as cuda_backend
from jax_ep.runtime import lowering_only

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, EXAMPLES)

import _devices  # noqa: E402
import moe_layer  # noqa: E402


def _run(command: list[str], cpu_devices: int | None) -> str:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["JAX_PLATFORMS"] = "cpu"
  if cpu_devices is not None:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cpu_devices}"
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.strip().endswith("OK"), result.stdout
  return result.stdout


def _example(name: str, args: list[str], cpu_devices: int | None = 8) -> str:
  return _run([sys.executable, os.path.join(EXAMPLES, name)] + args, cpu_devices)


@pytest.mark.parametrize("args", [[], ["--dtype=bfloat16", "--tokens_per_rank=32"]])
def test_moe_layer_example(args):
  out = _example("moe_layer.py", args)
  assert "jax_ep backend: xla; 8 ranks on cpu (1 process(es))" in out
  assert f"dtype={'bfloat16' if args else 'float32'}" in out
  assert "jax_ep custom calls in the compiled step: jax_ep_cpu_gather_reduce x3" in out


def test_moe_layer_example_on_one_device():
  """EP1 in one process, as on a machine with one GPU."""
  out = _example("moe_layer.py", ["--dtype=bfloat16"], cpu_devices=1)
  assert "jax_ep backend: xla; 1 ranks on cpu (1 process(es))" in out


def test_moe_layer_example_under_the_launcher():
  """One process per device, as on a machine with 2+ GPUs: every rank checks and says OK."""
  out = _run([sys.executable, "-m", "jax_ep.launch", "-n", "2",
              os.path.join(EXAMPLES, "moe_layer.py"), "--dtype=bfloat16"], cpu_devices=None)
  assert "[rank 0] jax_ep backend: xla; 2 ranks on cpu (2 process(es))" in out
  assert "[rank 0] OK" in out and "[rank 1] OK" in out


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_moe_layer_step_runs_on_the_ht_kernels_on_cuda(num_ranks):
  """The bf16 step of the example, lowered for the CUDA backend: dispatch, combine and
  their backward passes all on the kernels, for R <= K and R = 4 > K = 2 alike: the
  expert-major dispatch (forward, combine's backward), the expert-major combine
  (forward, dispatch's backward of the rows), and for dispatch's backward of
  topk_weights the per-slot values and the token-major combine; no portable
  exchange (fallback="error")."""
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])
  e, h, f, t, k = 4 * num_ranks, 128, 256, 64, 2
  config = jax_ep.EpConfig(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
                           fallback="error")

  def spec(shape, dtype, partition):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, partition))

  params = dict(router=spec((h, e), jnp.float32, P()), w1=spec((e, h, f), jnp.bfloat16, P("ep")),
                w2=spec((e, f, h), jnp.bfloat16, P("ep")))
  tokens = num_ranks * t
  args = (params, spec((tokens, h), jnp.bfloat16, P("ep")), spec((tokens, k), jnp.int32, P("ep")),
          spec((tokens, h), jnp.float32, P("ep")))
  with lowering_only(config, mesh, backend="cuda"), jax.set_mesh(mesh):
    step = moe_layer.make_train_step(config, mesh, 0.1, alignment=8)
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = moe_layer.jax_ep_custom_calls(text)
  assert calls == {"jax_ep_ht_dispatch_expert_major": 2, "jax_ep_ht_combine_expert_major": 2,
                   "jax_ep_ht_slot_values": 1, "jax_ep_ht_combine": 1}, calls
  assert "all_to_all" not in text
  assert set(moe_layer.HT_KERNELS) <= set(cuda_backend.lowering_check_targets())
  # What jax_ep_custom_calls leaves out is the check the backend emits (and the
  # lowered step has it).
  assert moe_layer.STATUS_CHECK == _extension.cuda_target("status_check")
  assert f"@{_extension.cuda_target('status_check')}(" in text


def test_moe_layer_picks_bf16_on_gpus():
  assert moe_layer.activation_dtype("auto", "gpu") == jnp.bfloat16
  assert moe_layer.activation_dtype("auto", "cpu") == jnp.float32
  assert moe_layer.activation_dtype("float32", "gpu") == jnp.float32


def test_examples_start_like_the_launcher_on_one_gpu(monkeypatch):
  assert _devices.LAUNCH_ENV_DEFAULTS == launch.CHILD_ENV_DEFAULTS
  for key in ("JAX_EP_LAUNCHED", "JAX_PLATFORMS", "XLA_FLAGS", *_devices.LAUNCH_ENV_DEFAULTS):
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setattr(_devices, "has_gpu", lambda: True)
  _devices.set_up()
  assert "JAX_PLATFORMS" not in os.environ
  assert all(os.environ[k] == v for k, v in _devices.LAUNCH_ENV_DEFAULTS.items())
  for key in _devices.LAUNCH_ENV_DEFAULTS:
    monkeypatch.delenv(key)
  monkeypatch.setattr(_devices, "has_gpu", lambda: False)
  _devices.set_up()
  assert os.environ["JAX_PLATFORMS"] == "cpu"
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
  assert not any(k in os.environ for k in _devices.LAUNCH_ENV_DEFAULTS)


@pytest.mark.parametrize("args", [[], ["--fp8"]])
def test_overlap_example(args):
  assert "max |diff| = 0.000e+00" in _example("ll_overlap.py", args)


def test_data_expert_mesh_example():
  """examples/data_expert_mesh.py: a (2, 4) mesh with EP over 'expert'; each data
  replica's output equals its EP group run alone, bit for bit."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "data_expert_mesh.py")],
                          env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "mesh {'data': 2, 'expert': 4}, EP over 'expert': 2 groups of 4" in result.stdout
  assert result.stdout.strip().endswith("OK: each data replica equals its EP group alone")
