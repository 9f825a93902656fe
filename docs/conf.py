"""Sphinx configuration of the documentation site: Markdown pages (MyST), the API reference from the docstrings.

Build it from the repository root with ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # the source checkout's package, whether or not it is installed (an editable install is)

from gearsam_fused import __version__  # noqa: E402

project = "gearsam_fused"
author = "the gearsam_fused authors"
copyright = "the gearsam_fused authors"
release = __version__
version = __version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# docs/studies/ holds the application's outputs that the pages quote (their study.md and summary.md among them): files
# the pages link and show, not pages of their own.
exclude_patterns = ["_build", "studies/**"]

# MyST: ```{eval-rst} blocks for autodoc, headings anchored so that pages can link to each other's sections.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# autodoc: members in source order, signatures with their annotations as written.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
# The docstrings are Google style ("Args:", "Returns:", "Raises:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"gearsam_fused {release}"
