"""EpConfig from one flat set of keywords, as the tests' setup helpers take them
(tests/cpu/ep_testing.py, tests/gpu/gpu_testing.py): EpGroup's fields go into
the config's group, the rest to EpConfig."""

from __future__ import annotations

import dataclasses

import jax_ep

GROUP_FIELDS = frozenset(f.name for f in dataclasses.fields(jax_ep.EpGroup))


def ep_config(**kwargs) -> jax_ep.EpConfig:
  """An EpConfig whose group takes the keywords naming EpGroup fields (axis_name,
  timeout_s, mask_on_timeout, num_sms) and which takes the rest."""
  group = jax_ep.EpGroup(**{k: v for k, v in kwargs.items() if k in GROUP_FIELDS})
  return jax_ep.EpConfig(**{k: v for k, v in kwargs.items() if k not in GROUP_FIELDS},
                         group=group)
