"""Sphinx configuration: the user guide and the API reference of jax_ep.

Build (warnings are errors, as in CI: tests/cpu/test_docs_build.py):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The API reference is autodoc of the installed (or in-place) jax_ep package;
importing it needs no GPU.
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

project = "jax_ep"
author = "the jax_ep authors"
copyright = "the jax_ep authors"  # noqa: A001 (Sphinx's name)
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' Google style (Args:, Returns:, Attributes:)
]

# Only the reStructuredText pages are sources; the Markdown notes beside them
# (benchmarks.md, design.md, ...) are read on the repository, not built here.
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "results", "images", "*.md"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = False  # Attributes: as attribute entries (the classes list no :members:)
napoleon_use_rtype = False

html_theme = "alabaster"
html_static_path = []
html_title = "jax_ep"
