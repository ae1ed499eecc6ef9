"""Trace-time checks of op arguments: shapes, dtypes, the mesh axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import expert_major
from jax_ep import fp8 as fp8_lib
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError
from jax_ep.runtime import RuntimeState

ROW_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
INDEX_DTYPES = (jnp.int32, jnp.int64)
LAYOUTS = ("token_major", "expert_major")  # of an HT dispatch


def _dtype_names(dtypes) -> str:
  return ", ".join(np.dtype(d).name for d in dtypes)


def axis_size(config: EpConfig, state: RuntimeState, op: str) -> int:
  """R, checked: we are inside shard_map over the axis, and it matches initialize()."""
  try:
    num_ranks = jax.lax.axis_size(config.axis_name)
  except NameError:
    raise EpConfigError(
        f"jax_ep.{op} must be called inside jax.shard_map over mesh axis "
        f"{config.axis_name!r} (per-shard arrays); no such axis is bound here") from None
  if num_ranks != state.num_ranks:
    raise EpConfigError(
        f"jax_ep.{op}: mesh axis {config.axis_name!r} has {num_ranks} ranks here but "
        f"{state.num_ranks} at initialize()")
  return num_ranks


def tokens(x: jax.Array, config: EpConfig, op: str, name: str = "x",
           dtypes=ROW_DTYPES, width: int | None = None, low_latency: bool = False) -> int:
  """Checks x is [T_local, width] with T_local <= T (T_ll for the low-latency ops);
  returns T_local."""
  width = config.hidden if width is None else width
  if x.ndim != 2 or x.shape[1] != width:
    raise EpConfigError(f"jax_ep.{op}: {name} must be [tokens, {width}], got shape {x.shape}")
  limit, field = ((config.ll_max_tokens, "low_latency_max_tokens_per_rank") if low_latency
                  else (config.max_tokens_per_rank, "max_tokens_per_rank"))
  if x.shape[0] > limit:
    raise EpConfigError(
        f"jax_ep.{op}: {name} has {x.shape[0]} tokens but EpConfig.{field} is {limit}; raise "
        f"{field} (and call initialize again)")
  if not any(x.dtype == jnp.dtype(d) for d in dtypes):
    raise EpConfigError(
        f"jax_ep.{op}: {name} dtype {x.dtype} is not supported; use one of {_dtype_names(dtypes)}")
  return x.shape[0]


def topk_indices(topk_idx: jax.Array, num_tokens: int, config: EpConfig, op: str) -> jax.Array:
  """Checks [T_local, K] integer indices; returns them as int32 with values that
  do not fit int32 mapped to E (so they stay invalid and are counted)."""
  if topk_idx.ndim != 2 or topk_idx.shape != (num_tokens, config.num_topk):
    raise EpConfigError(
        f"jax_ep.{op}: topk_idx must be [{num_tokens}, {config.num_topk}] (tokens, num_topk), "
        f"got {topk_idx.shape}")
  if not any(topk_idx.dtype == jnp.dtype(d) for d in INDEX_DTYPES):
    raise EpConfigError(
        f"jax_ep.{op}: topk_idx dtype {topk_idx.dtype} is not supported; use int32 or int64")
  if topk_idx.dtype == jnp.int32:
    return topk_idx
  if not jax.config.jax_enable_x64:
    return _int64_without_x64(topk_idx, op)
  in_range = (topk_idx >= -1) & (topk_idx < config.num_experts)
  return jnp.where(in_range, topk_idx, config.num_experts).astype(jnp.int32)


def _int64_without_x64(topk_idx, op: str) -> np.ndarray:
  """int64 ids while jax_enable_x64 is off: JAX truncates them to int32 (2**32 + 3
  becomes 3). Arrays passed into jit/shard_map are truncated before jax_ep sees
  them; what still arrives as int64 is a concrete array closed over by the
  traced function (or an int64 value made under jax.enable_x64): checked here on
  the host, and returned as int32 when every value fits."""
  fix = ("pass int32 ids (values in [-1, E)) or enable x64 "
         "(jax.config.update('jax_enable_x64', True))")
  if isinstance(topk_idx, jax.core.Tracer):
    raise EpConfigError(f"jax_ep.{op}: topk_idx is int64 but jax_enable_x64 is off, so JAX "
                        f"truncates it to int32; {fix}")
  values = np.asarray(topk_idx)
  info = np.iinfo(np.int32)
  wrong = (values < info.min) | (values > info.max)
  if np.any(wrong):
    t, k = (int(i) for i in np.argwhere(wrong)[0])
    raise EpConfigError(
        f"jax_ep.{op}: topk_idx[{t}][{k}] = {int(values[t, k])} does not fit int32, and with "
        f"jax_enable_x64 off JAX would truncate it to {int(values[t, k].astype(np.int32))}; {fix}")
  return values.astype(np.int32)


def result_weights_shapes(num_topk: int) -> str:
  """The two layouts' DispatchResult.topk_weights shapes, for error messages."""
  return (f"DispatchResult.topk_weights is float32[C, {num_topk}] in the token-major layout "
          "(per received row and top-k entry) and float32[M] in the expert-major one (one "
          "weight per pair row)")


def topk_weights(weights: jax.Array, num_tokens: int, config: EpConfig, op: str) -> jax.Array:
  """Checks float [T_local, K] weights; returns them as float32."""
  if weights.shape != (num_tokens, config.num_topk):
    # The likely mix-up: a dispatch's result's weights, whose shape depends on
    # the layout, where this rank's routing weights belong.
    raise EpConfigError(
        f"jax_ep.{op}: topk_weights must be [{num_tokens}, {config.num_topk}] (tokens, "
        f"num_topk), this rank's routing weights, one per topk_idx entry; got "
        f"{weights.shape}. A dispatch's result holds other shapes, which do not apply here: "
        f"{result_weights_shapes(config.num_topk)}")
  if not jnp.issubdtype(weights.dtype, jnp.floating):
    raise EpConfigError(f"jax_ep.{op}: topk_weights must be floating, got {weights.dtype}")
  return weights.astype(jnp.float32)


def combine_rows(y: jax.Array, rows: int, expert_major_layout: bool, config: EpConfig,
                 op: str) -> None:
  """Checks an HT combine's y: [C, H] (token-major) or [M, H] (expert-major), rows =
  the handle's. y holds weighted rows, so a wrong shape often comes from weighting
  with the other layout's topk_weights: the message says which shape applies."""
  if y.ndim == 2 and y.shape == (rows, config.hidden):
    return
  if expert_major_layout:
    which = (f"this handle is expert-major: y is [M, H] = [{rows}, {config.hidden}], one row "
             f"per pair row, and d.topk_weights is float32[M] = [{rows}] "
             "(weight with y * d.topk_weights[:, None])")
  else:
    which = (f"this handle is token-major: y is [C, H] = [{rows}, {config.hidden}], one row "
             f"per received row, and d.topk_weights is float32[C, K] = [{rows}, "
             f"{config.num_topk}] (weight each local expert's output by its k entry and sum "
             "over k into the row)")
  raise EpConfigError(
      f"jax_ep.{op}: y must be [{rows}, {config.hidden}] (the dispatch's rows), got {y.shape}; "
      f"{which}. {result_weights_shapes(config.num_topk)}")


def fp8_pair(x, config: EpConfig, op: str) -> int:
  """Checks (float8_e4m3fn[T_local, H], scales[T_local, H/128]); returns T_local."""
  if len(x) != 2:
    raise EpConfigError(f"jax_ep.{op}: an FP8 input is a pair (x_fp8, scales), got {len(x)} items")
  x_fp8, scales = x
  if config.hidden % fp8_lib.GROUP:
    raise EpConfigError(
        f"jax_ep.{op}: FP8 needs hidden to be a multiple of {fp8_lib.GROUP}, got {config.hidden}")
  num_tokens = tokens(x_fp8, config, op, "x_fp8", dtypes=(fp8_lib.FP8_DTYPE,))
  if scales.shape != (num_tokens, config.hidden // fp8_lib.GROUP):
    raise EpConfigError(
        f"jax_ep.{op}: scales must be [{num_tokens}, {config.hidden // fp8_lib.GROUP}] "
        f"(one per 128 channels), got {scales.shape}")
  if scales.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e8m0fnu)):
    raise EpConfigError(
        f"jax_ep.{op}: scales must be float32 or float8_e8m0fnu, got {scales.dtype}")
  return num_tokens


def capacity(value: int | None, config: EpConfig, num_ranks: int, op: str) -> int:
  default = config.capacity(num_ranks)
  if value is None:
    return default
  if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= default:
    raise EpConfigError(
        f"jax_ep.{op}: capacity must be an int in [1, {default}] (R * max_tokens_per_rank), "
        f"got {value!r}")
  return value


def expert_alignment(layout: str, alignment, op: str) -> int:
  """Checks layout= and expert_alignment= of a dispatch; returns A."""
  if layout not in LAYOUTS:
    raise EpConfigError(f"jax_ep.{op}: layout must be one of {LAYOUTS}, got {layout!r}")
  if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
    raise EpConfigError(f"jax_ep.{op}: expert_alignment must be an int >= 1, got {alignment!r}")
  if layout == "token_major" and alignment != 1:
    raise EpConfigError(
        f"jax_ep.{op}: expert_alignment={alignment} applies to layout='expert_major' (token-major "
        "rows are not grouped by expert); pass layout='expert_major' or drop expert_alignment")
  return alignment


def pair_rows(value: int | None, alignment: int, config: EpConfig, num_ranks: int,
              op: str) -> int:
  """M of an expert-major dispatch: capacity= (a multiple of A, at most the
  worst case) or the worst case."""
  default = expert_major.default_rows(num_ranks, config.max_tokens_per_rank, config.num_topk,
                                      config.experts_per_rank(num_ranks), alignment)
  if value is None:
    return default
  if (not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= default
      or value % alignment):
    raise EpConfigError(
        f"jax_ep.{op}: with layout='expert_major', capacity is the number of pair rows M: a "
        f"multiple of expert_alignment={alignment} in [{alignment}, {default}] (the worst case "
        f"R*T*min(K, E_local) + E_local*(A-1), rounded up to A), got {value!r}")
  return value
