"""EpGroup, the settings one EP group shares, and EpConfig.group: the group's
validation, EpConfig's read-through properties, the one rule between the
configs of one process (the same EpGroup) and its message, and that configs
with a group stay hashable static arguments of jit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from jax_ep.buffers import sizing_config
from ep_testing import bits, make_mesh, random_rows, ranks_routing, run_per_shard

R = 4
SIZES = dict(num_experts=8, hidden=16, max_tokens_per_rank=4, num_topk=2)
GROUP = jax_ep.EpGroup(axis_name="ep", timeout_s=5.0, mask_on_timeout=True, num_sms=8)


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("inf"), float("nan"), 86400.5, True, "30"])
def test_timeout_must_be_bounded(timeout_s):
  with pytest.raises(jax_ep.EpConfigError,
                     match=r"EpGroup.timeout_s must be a number of seconds in"):
    jax_ep.EpGroup(timeout_s=timeout_s)


def test_timeout_bounds_are_inclusive_above():
  assert jax_ep.EpGroup(timeout_s=86400).timeout_s == 86400
  assert jax_ep.EpGroup(timeout_s=1e-3).timeout_s == 1e-3


@pytest.mark.parametrize("axis_name", ["", (), ("ep", "ep"), ("ep", 3), 7])
def test_axis_name_must_be_an_axis_or_a_tuple_of_distinct_axes(axis_name):
  with pytest.raises(jax_ep.EpConfigError, match="EpGroup.axis_name must be a mesh axis name"):
    jax_ep.EpGroup(axis_name=axis_name)


def test_axis_name_tuple_of_one_is_the_axis():
  one = jax_ep.EpGroup(axis_name=("ep",))
  assert one == jax_ep.EpGroup(axis_name="ep") and one.axis_names == ("ep",)
  both = jax_ep.EpGroup(axis_name=["context", "expert"])
  assert both.axis_name == ("context", "expert") and hash(both)
  assert both.axis_names == ("context", "expert")


@pytest.mark.parametrize("num_sms", [0, -2, 2.0, True, "8"])
def test_num_sms_must_be_none_or_a_positive_int(num_sms):
  with pytest.raises(jax_ep.EpConfigError, match="EpGroup.num_sms must be None or a positive"):
    jax_ep.EpGroup(num_sms=num_sms)


def test_the_config_needs_an_ep_group():
  with pytest.raises(jax_ep.EpConfigError, match="EpConfig.group must be a jax_ep.EpGroup"):
    jax_ep.EpConfig(**SIZES, group="ep")


def test_the_config_reads_its_groups_fields():
  config = jax_ep.EpConfig(**SIZES, group=GROUP)
  assert (config.axis_name, config.axis_names, config.timeout_s, config.mask_on_timeout,
          config.num_sms) == ("ep", ("ep",), 5.0, True, 8)
  default = jax_ep.EpConfig(**SIZES)
  assert default.group == jax_ep.EpGroup()
  assert (default.axis_name, default.timeout_s, default.mask_on_timeout,
          default.num_sms) == ("ep", 30.0, False, None)
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.group = jax_ep.EpGroup()
  with pytest.raises(AttributeError):
    config.timeout_s = 1.0  # a read-only property: the group holds it


@pytest.mark.parametrize("field,value", [("axis_name", "expert"), ("timeout_s", 5.0),
                                         ("mask_on_timeout", True), ("num_sms", 8)])
def test_the_groups_fields_are_not_config_keywords(field, value):
  with pytest.raises(TypeError, match=field):
    jax_ep.EpConfig(**SIZES, **{field: value})


def test_two_sizes_sharing_one_group_initialize_and_run_together():
  group = jax_ep.EpGroup(axis_name="ep", timeout_s=10.0)
  small = jax_ep.EpConfig(**SIZES, group=group)
  large = jax_ep.EpConfig(num_experts=16, hidden=32, max_tokens_per_rank=8, num_topk=4,
                          group=group, enable_low_latency=False)
  mesh = make_mesh(R)
  jax_ep.initialize((small, large), mesh)
  assert jax_ep.runtime_state().configs == (small, large)
  sizing = sizing_config((small, large))
  assert sizing.group == group
  assert (sizing.num_experts, sizing.hidden, sizing.max_tokens_per_rank,
          sizing.num_topk) == (16, 32, 8, 4)

  rng = np.random.default_rng(0)

  def round_trip(config):
    """dispatch + combine with ``config``, bit for bit against jax_ep.reference."""
    t, k = config.max_tokens_per_rank, config.num_topk
    x = random_rows(rng, (R * t, config.hidden), jnp.bfloat16)
    idx = ranks_routing(rng, R, t, k, config.num_experts, skew=1.0)
    w = rng.random((R * t, k), np.float32)

    def fn(x, idx, w):
      d = jax_ep.dispatch(x, idx, w, config=config)
      ref = jax_ep.reference.dispatch(x, idx, w, config=config)
      return (jax_ep.combine(d.x, d.handle, config=config),
              jax_ep.reference.combine(ref["x"], idx, config=config))

    out, want = run_per_shard(fn, mesh, x, idx, w)
    assert out.shape == (R, t, config.hidden)
    np.testing.assert_array_equal(bits(out), bits(want))

  round_trip(small)
  round_trip(large)


@pytest.mark.parametrize("field,value", [("axis_name", "data"), ("timeout_s", 5.0),
                                         ("mask_on_timeout", True), ("num_sms", 8)])
def test_configs_with_different_groups_are_refused_naming_both(field, value):
  first = jax_ep.EpConfig(**SIZES)
  other_group = dataclasses.replace(jax_ep.EpGroup(), **{field: value})
  other = jax_ep.EpConfig(num_experts=16, hidden=32, max_tokens_per_rank=8, num_topk=4,
                          group=other_group)
  with pytest.raises(jax_ep.EpConfigError) as error:
    jax_ep.initialize((first, other), make_mesh(R))
  assert str(error.value) == (
      f"jax_ep.initialize: configs[1].group is {other_group!r} but configs[0].group is "
      f"{jax_ep.EpGroup()!r}: one process has one EP group; build every layer's EpConfig "
      "with the same EpGroup")
  assert jax_ep.runtime_state() is None
  with pytest.raises(jax_ep.EpConfigError, match=r"configs\[1\]\.group is EpGroup\("):
    sizing_config((first, other))


def test_a_config_with_a_group_is_a_hashable_static_argument_of_jit():
  a = jax_ep.EpConfig(**SIZES, group=jax_ep.EpGroup(axis_name=("ep",), num_sms=8))
  b = jax_ep.EpConfig(**SIZES, group=jax_ep.EpGroup(axis_name="ep", num_sms=8))
  assert a == b and hash(a) == hash(b) and a is not b
  assert a != dataclasses.replace(b, group=jax_ep.EpGroup(num_sms=16))
  traces = []

  def fn(x, config):
    traces.append(config)
    return x * config.num_sms

  jitted = jax.jit(fn, static_argnums=1)
  assert int(jitted(jnp.int32(2), a)) == 16
  assert int(jitted(jnp.int32(3), b)) == 24  # equal by value: the same trace
  assert len(traces) == 1
  bigger = dataclasses.replace(b, group=jax_ep.EpGroup(num_sms=16))
  assert int(jitted(jnp.int32(1), bigger)) == 16
  assert len(traces) == 2
