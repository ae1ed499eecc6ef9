"""The baselines time what they claim (jax_ep/bench/ragged.py, ll.py, ht.py, bare.py):
the ragged combine without its dispatch, FP8 baselines that move FP8 rows and
their scales, whole results kept by the timing loop."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import jax_ep
from jax_ep.bench import bare, ht, ll, ragged, timing

R, T, H, E, K = 8, 4, 384, 16, 2   # H / 128 = 3 scale columns, distinct from K


def _mesh():
  return jax.make_mesh((jax.device_count(),), ("ep",))


def _spec(mesh, shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, jax.P("ep")))


def _config():
  return jax_ep.EpConfig(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K)


def _timed_loop_hlo(op, *args) -> str:
  """Optimized HLO of the executable the bench times (two dependent calls)."""
  return timing.executable(op, _mesh(), 2).lower(*args).compile().as_text()


def _exchanged(hlo: str) -> set[tuple[str, str]]:
  """(element type, last dimension) of every array produced by an all_to_all."""
  out = set()
  for line in hlo.splitlines():
    if 'all_to_all"' in line:
      m = re.search(r"= (\w+)\[([\d,]*)\]", line)
      if m:
        out.add((m.group(1), m.group(2).split(",")[-1]))
  return out


def test_ragged_combine_is_timed_alone():
  """One ragged_all_to_all (the way back) and no sort (the dispatch's) per call."""
  mesh = _mesh()
  layout = [_spec(mesh, (R * R,), jnp.int32)] * 4 + [_spec(mesh, (R * R * T,), jnp.int32)]
  fn = jax.jit(jax.shard_map(ragged.combine_op("ep"), mesh=mesh, in_specs=jax.P("ep"),
                             out_specs=jax.P("ep")))
  text = fn.lower(_spec(mesh, (R * R * T, H), jnp.bfloat16), *layout).as_text()
  assert text.count("ragged_all_to_all") == 1
  assert "stablehlo.sort" not in text and "all_gather" not in text
  # Its inputs come from the dispatch plus the reverse layout, made once beforehand.
  prep = jax.jit(jax.shard_map(ragged.prepare_op(_config()), mesh=mesh, in_specs=jax.P("ep"),
                               out_specs=jax.P("ep")))
  outs = jax.eval_shape(prep, _spec(mesh, (R * T, H), jnp.bfloat16),
                        _spec(mesh, (R * T, K), jnp.int32))
  assert [o.shape for o in outs] == [(R * R * T, H)] + [(R * R,)] * 4 + [(R * R * T,)]


def test_ll_fp8_baseline_exchanges_rows_and_scales():
  """The portable FP8 LL dispatch's whole result is kept, its scales included
  (returning only the rows let XLA drop the scales' exchange)."""
  mesh = _mesh()
  hlo = _timed_loop_hlo(ll.portable_dispatch_op(_config(), fp8=True),
                        _spec(mesh, (R * T, H), jnp.bfloat16), _spec(mesh, (R * T, K), jnp.int32))
  exchanged = _exchanged(hlo)
  assert ("f32", str(H // 128)) in exchanged   # the scales
  assert any(last == str(H) for _, last in exchanged)  # the rows


def test_ht_fp8_baseline_exchanges_fp8_rows_and_scales():
  mesh = _mesh()
  op = ht.portable_ops(_config(), R * T)["dispatch FP8"]
  hlo = _timed_loop_hlo(op, _spec(mesh, (R * T, H), jnp.float8_e4m3fn),
                        _spec(mesh, (R * T, H // 128), jnp.float32),
                        _spec(mesh, (R * T, K), jnp.int32), _spec(mesh, (R * T, K), jnp.float32))
  exchanged = _exchanged(hlo)
  assert ("f32", str(H // 128)) in exchanged
  rows = {dtype for dtype, last in exchanged if last == str(H)}
  assert rows and "bf16" not in rows  # FP8 rows (XLA:CPU carries f8 collectives as f16)


def test_bare_fp8_exchange_moves_rows_and_scales():
  x = np.asarray(jnp.ones((T, H), jnp.bfloat16))
  q, scales = bare.inputs(x, R, fp8=True)
  assert (q.shape, q.dtype, scales.shape) == ((R * T, H), jnp.float8_e4m3fn, (R * T, H // 128))
  mesh = _mesh()  # one process holds all R shards here
  every = [timing.global_array(mesh, np.tile(a, (R, 1))) for a in (q, scales)]
  out = jax.jit(jax.shard_map(lambda a, b: bare.exchange(a, b, num_ranks=R), mesh=mesh,
                              in_specs=jax.P("ep"), out_specs=jax.P("ep")))(*every)
  assert [o.shape for o in out] == [(R * R, T, H), (R * R, T, H // 128)]
