"""The Python examples of the README and of the documentation pages (``docs/**/*.md``), for the tests that run them.

A block whose first line is ``# needs: ...`` cannot run in ``test_readme.py`` (a GPU, a process group, an optional
package); the test named in ``test_readme.py`` finds it here by that line, wherever it lives.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
NEEDS = "# needs:"
_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)


def pages() -> list[Path]:
    """README.md, then every Markdown page under ``docs/`` in name order (the build output left out)."""
    docs = [p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts]
    return [README, *sorted(docs)]


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of ``page``, in order, each without its fences."""
    return _PYTHON_BLOCK.findall(page.read_text(encoding="utf-8"))


def name(page: Path) -> str:
    """``page`` relative to the repository, as tracebacks and test ids show it."""
    return page.relative_to(ROOT).as_posix()


def needs_blocks() -> list[tuple[str, str]]:
    """Every ``# needs:`` block of every page, as ``(code, page name)``."""
    return [(code, name(page)) for page in pages() for code in python_blocks(page) if code.startswith(NEEDS)]


def needs_block(first_line: str) -> tuple[str, str]:
    """The one block, on any page, whose first line starts with ``first_line``, as ``(code, page name)``."""
    found = [(code, where) for code, where in needs_blocks() if code.startswith(first_line)]
    assert len(found) == 1, f"{len(found)} blocks start with {first_line!r}: {[where for _, where in found]}"
    return found[0]
