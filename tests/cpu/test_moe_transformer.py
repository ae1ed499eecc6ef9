"""examples/moe_transformer.py: trains, learns, matches dense routing; its checks can
fail; its bfloat16 step lowers to jax_ep's HT kernels on the CUDA backend."""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import fallbacks
from jax_ep.runtime import lowering_only

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, EXAMPLES)

import markov_task  # noqa: E402
import moe_transformer  # noqa: E402
import moe_transformer_check  # noqa: E402
import moe_transformer_model as model  # noqa: E402
from moe_transformer_step import make_optimizer, make_train_step  # noqa: E402


def _run(args: list[str], cpu_devices: int = 8, cwd=None) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={cpu_devices}")
  return subprocess.run([sys.executable, os.path.abspath(os.path.join(EXAMPLES,
                                                                      "moe_transformer.py"))]
                        + args, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.parametrize("data", [1, 2])
def test_trains_learns_and_matches_dense_routing(tmp_path, data):
  png = tmp_path / "curves.png"
  result = _run(["--preset", "tiny", "--data", str(data), "--plot", str(png)])
  out = result.stdout
  assert result.returncode == 0, out + result.stderr
  assert out.strip().endswith("OK"), out
  groups = {1: "1 group(s) of 8", 2: "2 group(s) of 4"}[data]
  assert f"jax_ep backend: xla; 8 devices on cpu (1 process(es)); mesh {{'data': {data}, " \
         f"'expert': {8 // data}}}, EP over 'expert': {groups}" in out
  assert "bfloat16 compute" in out and "pairs per expert equal" in out
  assert "jax_ep_cpu_ht_route" in out   # the step ran jax_ep's portable exchange
  assert out.count("tokens/s  dropped 0  pairs per expert: ") == 6   # steps 10, 20, ..., 60
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_writes_no_file_unless_asked(tmp_path):
  """Without --plot the run leaves its working directory as it found it (it used to
  write moe_transformer.png there)."""
  result = _run(["--preset", "tiny"], cwd=tmp_path)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.strip().endswith("OK"), result.stdout
  assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)
  assert "wrote " not in result.stdout


def test_no_learning_fails():
  """Without steps of any size the loss stays near log V: NO LEARNING, exit 1 (the
  dense check still passes: nothing moves on either side)."""
  result = _run(["--preset", "tiny", "--learning_rate", "0", "--steps", "10", "--plot", ""])
  assert result.returncode == 1, result.stdout + result.stderr
  assert result.stdout.strip().endswith("NO LEARNING"), result.stdout
  assert "pairs per expert equal" in result.stdout


def _tiny(num_ranks: int, dtype: str = "float32"):
  mesh = jax.make_mesh((1, num_ranks), ("data", "expert"), devices=jax.devices()[:num_ranks])
  args = moe_transformer.parse_args(["--preset", "tiny", "--dtype", dtype], "cpu")
  config, ep_config = moe_transformer.build(args, mesh)
  return args, mesh, config, ep_config


def _scaled_gates_ffn(ep_config, alignment, scale):
  """moe_ffn_ep with every pair's gate times ``scale``."""
  def ffn(layer, x, idx, gate):
    d = jax_ep.dispatch(x, idx, gate, config=ep_config, layout="expert_major",
                        expert_alignment=alignment)
    y = model.expert_pairs(d.x, layer["w1"], layer["w2"], d.group_sizes, x.dtype)
    y = (y * (d.topk_weights * scale)[:, None]).astype(x.dtype)
    return (jax_ep.combine(y, d.handle, config=ep_config),
            dict(tokens_per_expert=d.tokens_per_expert, dropped=d.num_dropped))
  return ffn


@pytest.mark.parametrize("scale", [1.0, 1 + 1e-3])
def test_dense_check_fails_on_gates_off_by_a_thousandth(scale):
  """The dense check's bound is tight enough to see every gate 0.1% too large
  (the gradients move by about that much), and passes the unmodified layer."""
  args, mesh, config, ep_config = _tiny(8)
  jax_ep.initialize(ep_config, mesh)
  task = markov_task.make_task(args.vocab, args.successors, args.seed)
  batches = task.sample(np.random.default_rng(1), (args.check_steps, 16), args.seq_len + 1)
  with jax.set_mesh(mesh):
    result = moe_transformer_check.compare_with_dense(
        config, _scaled_gates_ffn(ep_config, args.expert_alignment, scale), mesh,
        model.init_params(config, args.seed), batches,
        make_optimizer(args.learning_rate, args.warmup, args.steps, args.weight_decay), 8)
  assert result.same_load
  assert result.ok == (scale == 1.0), result.worst()
  if scale == 1.0:
    assert max(result.worst().values()) < 0.1, result.worst()   # rounding alone: far inside


def test_learning_threshold_lies_between_the_entropies():
  task = markov_task.make_task(64, 4, 0)
  threshold = moe_transformer_check.learning_threshold(task)
  assert task.entropy_rate < threshold < task.unigram_entropy < np.log(64)
  # The chain's samples: their cross-entropy under the chain is its entropy
  # rate, within 5 standard errors of the mean of the per-token log-losses.
  seq = task.sample(np.random.default_rng(2), (400,), 101)
  logloss = -np.log(task.transitions[seq[:, :-1], seq[:, 1:]])
  assert abs(logloss.mean() - task.entropy_rate) < 5 * logloss.std() / np.sqrt(logloss.size)


@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (2, 4)])
def test_bf16_step_runs_on_the_ht_kernels_on_cuda(shape, caplog):
  """The training step (forward and backward of every MoE layer), lowered for the
  CUDA backend: each layer's dispatch on the expert-major dispatch kernel (and
  again for the combine's backward), its combine and the dispatch's backward of
  the rows on the expert-major combine kernel, the backward of the gates on the
  per-slot values kernel and the HT combine kernel; no portable all_to_all, and
  nothing announced (the kernels write and read the pair rows)."""
  num_data, num_expert = shape
  mesh = jax.make_mesh(shape, ("data", "expert"), devices=jax.devices()[:num_data * num_expert])
  args = moe_transformer.parse_args(
      ["--preset", "tiny", "--layers", "2", "--experts_per_rank", "4"], "gpu")
  config, ep_config = moe_transformer.build(args, mesh)
  host = model.init_params(config, 0)
  specs = model.param_specs(host, "expert")
  optimizer = make_optimizer(args.learning_rate, args.warmup, args.steps, args.weight_decay)

  def spec(a, partition):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, partition))

  params = jax.tree.map(spec, host, specs)
  tokens = jax.ShapeDtypeStruct((args.batch_per_rank * mesh.size, args.seq_len + 1), jnp.int32,
                                sharding=NamedSharding(mesh, P(("data", "expert"))))
  fallbacks.forget()
  with lowering_only(ep_config, mesh, backend="cuda"), jax.set_mesh(mesh), \
      caplog.at_level(logging.WARNING):
    opt_state = jax.eval_shape(optimizer.init, params)
    step = make_train_step(config, mesh, model.moe_ffn_ep(ep_config, args.expert_alignment, None),
                           specs, optimizer, experts_split=True)
    text = step.trace(params, opt_state, tokens).lower(lowering_platforms=("cuda",)).as_text()
  calls = moe_transformer.jax_ep_custom_calls(text)
  assert calls == {"jax_ep_ht_dispatch_expert_major": 2 * config.layers,
                   "jax_ep_ht_combine_expert_major": 2 * config.layers,
                   "jax_ep_ht_slot_values": config.layers,
                   "jax_ep_ht_combine": config.layers}, calls
  assert "all_to_all" not in text
  assert config.dtype == jnp.bfloat16
  announced = [r.getMessage() for r in caplog.records
               if r.levelno >= logging.WARNING and "jax_ep." in r.getMessage()]
  assert not announced, announced
