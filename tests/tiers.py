"""The two tiers of the suite, as a pytest plugin (loaded by ``tests/conftest.py``).

* The **full tier** (``pytest --full``, or ``GEARSAM_TESTS=full``) runs every collected case.
* The **default tier** runs, of each parametrised test, a covering subset of its cases: one in which every value of
  every parameter, and every pair of values of two parameters, appears in at least one case that runs on this
  machine (pairwise selection). Cases listed in ``tests/regressions.txt`` (each caught a bug once) always run.
  A test marked ``heavy`` (several processes, a trainer's whole loop, a build, a benchmark's run) keeps one case:
  a regression case where it has one, else its first that runs here. A test marked ``full`` runs in the full tier
  only.

The selection is a function of the collected cases and of which of them the skip marks leave to run, so the same
checkout on the same kind of machine runs the same cases every time. It is made before ``-k``, ``-m`` and
``--part`` select from it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

REGRESSIONS = Path(__file__).with_name("regressions.txt")
ENV = "GEARSAM_TESTS"
#: whether this run is the full tier: known once pytest is configured, before any test module is imported, for what a
#: module settles as it is imported (how many examples a property-based test draws)
FULL = False


def pytest_addoption(parser):
    parser.addoption(
        "--full", action="store_true", default=False,
        help=f"run every parametrised case (the full tier); the default runs a pairwise covering subset. "
             f"{ENV}=full does the same",
    )  # fmt: skip


def pytest_configure(config):
    global FULL
    FULL = full_tier(config)
    config.addinivalue_line(
        "markers", "heavy: a slow test (processes, trainers, builds): the default tier runs one case"
    )
    config.addinivalue_line("markers", "full: runs in the full tier only")


def full_tier(config) -> bool:
    value = os.environ.get(ENV, "default").strip().lower()
    if value not in ("default", "full"):
        raise pytest.UsageError(f"{ENV} must be 'default' or 'full', got {value!r}")
    return config.getoption("--full") or value == "full"


def read_regressions(path: Path = REGRESSIONS) -> list[str]:
    """The node ids in ``path``: one a line, ``#`` starts a comment."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def pairs(values: Sequence) -> set:
    """Every value of ``values`` (a case's (parameter, value) items) and every pair of two of them."""
    return set(values) | set(itertools.combinations(sorted(values), 2))


def pairwise_cover(cases: Sequence[Sequence], chosen: Iterable[int] = ()) -> list[int]:
    """Indices into ``cases`` (each a list of (parameter, value) items) of a subset that holds every value and every
    pair of values that some case holds, ``chosen`` included. Greedy: each step takes the case holding the most
    pairs not yet held, the first in order among equals, so the same cases give the same subset."""
    held = [pairs(case) for case in cases]
    picked = list(dict.fromkeys(chosen))
    missing = set().union(*held) if held else set()
    for i in picked:
        missing -= held[i]
    while missing:
        best = max(range(len(cases)), key=lambda i: (len(held[i] & missing), -i))
        picked.append(best)
        missing -= held[best]
    if cases and not picked:  # cases without parameters: one of them holds everything there is
        picked.append(0)
    return sorted(picked)


def _runs_here(item) -> bool:
    """Whether no skip mark skips ``item`` on this machine (a skip inside the test body is not seen)."""
    from _pytest.skipping import evaluate_skip_marks

    return evaluate_skip_marks(item) is None


def _values(item) -> list[tuple[str, str]]:
    """A case's (parameter, value) items, the value as its repr, which tells apart the values of one parameter. A
    named tuple's fields count as parameters of their own: a test over a list of configurations is a product too."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return []
    out = []
    for name, value in callspec.params.items():
        fields = getattr(value, "_fields", None) if isinstance(value, tuple) else None
        out += [(f"{name}.{f}", repr(getattr(value, f))) for f in fields] if fields else [(name, repr(value))]
    return sorted(out)


def default_tier(items: Sequence, regressions: set[str]) -> list:
    """The items of the default tier, in collection order."""
    tests: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        tests.setdefault(item.nodeid.split("[", 1)[0], []).append(i)
    kept = set()
    for indices in tests.values():
        first = items[indices[0]]
        if first.get_closest_marker("full") is not None:
            continue
        here = [i for i in indices if _runs_here(items[i])]
        must = [k for k, i in enumerate(here) if items[i].nodeid in regressions]
        if first.get_closest_marker("heavy") is not None:
            kept.update(here[k] for k in (must or range(min(1, len(here)))))
        else:
            kept.update(here[k] for k in pairwise_cover([_values(items[i]) for i in here], must))
    return [item for i, item in enumerate(items) if i in kept]


@pytest.hookimpl(tryfirst=True)  # before -k, -m and --part select from the tier
def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    kept = default_tier(items, set(read_regressions()))
    kept_ids = {id(item) for item in kept}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
    items[:] = kept


def pytest_report_header(config):
    if FULL:
        return "tier: full (every case)"
    return f"tier: default (a pairwise covering subset; --full or {ENV}=full runs every case)"
