"""The documentation's shape, fast (CI builds the site itself, with warnings as errors): every page the toctree lists
exists and every page is listed; the README stays short and keeps the four commands CI runs."""

import re

from doc_blocks import DOCS, README, ROOT

CI_COMMANDS = ["demo", "test", "lint", "docs"]


def toctree() -> list[str]:
    """The entries of ``docs/index.md``'s toctree, in order."""
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    (body,) = re.findall(r"```\{toctree\}\n(.*?)```", index, flags=re.S)
    return [line.strip() for line in body.splitlines() if line.strip() and not line.startswith(":")]


def test_every_page_of_the_toctree_exists_and_every_page_is_in_it():
    entries = toctree()
    assert len(entries) == len(set(entries)) >= 10, entries
    missing = [e for e in entries if not (DOCS / f"{e}.md").is_file() and not (DOCS / f"{e}.rst").is_file()]
    assert not missing, missing
    pages = {p.stem for p in DOCS.glob("*.md")} | {p.stem for p in DOCS.glob("*.rst")}
    assert pages - {"index"} == set(entries)


def test_the_readme_is_short_and_has_the_four_ci_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert re.findall(r"<!-- ci:(\w+) -->", text) == CI_COMMANDS
    assert re.findall(r"<!-- /ci:(\w+) -->", text) == CI_COMMANDS
    for name in CI_COMMANDS:
        (block,) = re.findall(rf"<!-- ci:{name} -->\n```bash\n(.*?)\n```\n<!-- /ci:{name} -->", text, flags=re.S)
        assert block and "\n" not in block, (name, block)  # one shell line, as .ci/run reads it
    assert "`.ci/run` runs exactly these four commands." in text
    assert "for name in demo test lint docs; do" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_the_readme_links_every_page():
    text = README.read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(docs/(\w+)\.md[)#]", text))
    assert linked >= {*toctree(), "index"}, {*toctree(), "index"} - linked
