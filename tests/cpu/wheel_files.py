"""The files of the tree that the wheel takes: what scikit-build-core's wheel build
copies from ``wheel.packages`` (pyproject.toml), every file there that neither git
nor ``wheel.exclude`` / ``sdist.exclude`` leaves out, by their paths in the wheel."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wheel_files() -> dict[str, str]:
  """{path in the wheel ("jax_ep/ops.py"): its source path in the tree (absolute)}.
  Skips the calling test where scikit-build-core is not installed."""
  settings_reader = pytest.importorskip("scikit_build_core.settings.skbuild_read_settings")
  pathutil = pytest.importorskip("scikit_build_core.build._pathutil")
  settings = settings_reader.SettingsReader.from_file(
      os.path.join(ROOT, "pyproject.toml"), state="wheel").settings
  cwd = os.getcwd()
  os.chdir(ROOT)   # scikit-build-core walks the tree from the project root
  try:
    # The arguments scikit-build-core's wheel build passes (build/wheel.py).
    return {str(target): os.path.join(ROOT, source) for source, target in
            pathutil.iter_package_files(
                packages={name: name for name in settings.wheel.packages},
                include=list(settings.sdist.include), src_exclude=list(settings.sdist.exclude),
                target_exclude=list(settings.wheel.exclude), build_dir=settings.build_dir,
                mode=settings.sdist.inclusion_mode or "default")}
  finally:
    os.chdir(cwd)
