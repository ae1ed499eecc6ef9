"""jax_ep.fallbacks: the one policy and the one record of slower paths told."""

import importlib
import logging

import pytest

from jax_ep import fallbacks
from jax_ep.errors import EpConfigError


def test_each_key_warns_once_errors_always_allow_says_nothing(caplog):
  fallbacks.forget()
  with caplog.at_level(logging.WARNING):
    for _ in range(3):
      fallbacks.slower_path("warn", ("a", 1), "path A is slower.", "SomeConfig", "runs it")
      fallbacks.slower_path("warn", ("b", 1), "path B is slower.", "SomeConfig", "runs it")
      fallbacks.slower_path("allow", ("c", 1), "path C is slower.", "SomeConfig", "runs it")
  told = [r.getMessage() for r in caplog.records if "slower" in r.getMessage()]
  assert len(told) == 2 and "shown once" in told[0]
  assert "SomeConfig(fallback='error') makes it an error" in told[0]
  with pytest.raises(EpConfigError, match=r"path A is slower\. \(SomeConfig\(fallback='warn'\) "
                     r"runs it\.\)"):
    fallbacks.slower_path("error", ("a", 1), "path A is slower.", "SomeConfig", "runs it")
  fallbacks.forget()
  with caplog.at_level(logging.WARNING):
    fallbacks.slower_path("warn", ("a", 1), "path A is slower.", "SomeConfig", "runs it")
  assert len([r for r in caplog.records if "path A" in r.getMessage()]) == 2


def test_the_configs_take_the_same_policies():
  from jax_ep.config import FALLBACK_POLICIES  # pylint: disable=import-outside-toplevel
  # the module, not the function jax_ep.moe exports under the same name
  grouped_matmul = importlib.import_module("jax_ep.moe.grouped_matmul")
  assert FALLBACK_POLICIES == grouped_matmul.FALLBACK_POLICIES == fallbacks.POLICIES
