"""The suite's two tiers (tests/tiers.py): the default tier's pairwise covering subset holds every value and every pair
of values of each parametrised test, the same cases every time, the regression cases always; ``heavy`` tests keep one
case and ``full`` tests none; the regression list names cases that exist."""

import collections
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from tiers import default_tier, pairs, pairwise_cover, read_regressions

ROOT = Path(__file__).resolve().parents[2]


def product(*sizes: int) -> list[list[tuple[str, int]]]:
    axes = [[(f"axis{a}", v) for v in range(n)] for a, n in enumerate(sizes)]
    return [list(case) for case in itertools.product(*axes)]


@pytest.mark.parametrize("sizes", [(2, 2), (3, 3, 3), (6, 4, 2, 2), (2, 5, 3, 4, 2), (7,)], ids=str)
def test_the_cover_holds_every_pair_of_the_product_and_is_smaller(sizes):
    cases = product(*sizes)
    picked = pairwise_cover(cases)
    assert set().union(*(pairs(cases[i]) for i in picked)) == set().union(*(pairs(c) for c in cases))
    if len(sizes) > 2:  # smaller than the product, and no smaller than the pairs of the two largest axes need
        first, second = sorted(sizes)[-2:]
        assert first * second <= len(picked) < len(cases)


def test_the_cover_of_a_sparse_set_holds_only_the_pairs_some_case_has():
    cases = [[("a", 0), ("b", 0)], [("a", 1), ("b", 1)], [("a", 0), ("b", 1)]]  # (1, 0) is no case
    assert pairwise_cover(cases) == [0, 1, 2]


def test_a_test_without_parameters_is_its_own_cover():
    assert pairwise_cover([[]]) == [0]


def test_the_cover_is_the_same_every_time_and_keeps_the_chosen():
    cases = product(4, 3, 3)
    assert pairwise_cover(cases) == pairwise_cover([list(c) for c in cases])
    assert 35 in pairwise_cover(cases, chosen=[35])


class Item:
    """What ``default_tier`` reads of a pytest item."""

    def __init__(self, nodeid, params=None, marks=()):
        self.nodeid, self.marks = nodeid, set(marks)
        if params is not None:
            self.callspec = type("CallSpec", (), {"params": params})()

    def get_closest_marker(self, name):
        return name if name in self.marks else None

    def iter_markers(self, name=None):
        return iter(())


def test_the_fields_of_a_named_tuple_are_parameters_of_their_own():
    config = collections.namedtuple("Config", "driver zeros")
    items = [Item(f"t.py::test_ddp[{d}-{z}]", {"config": config(d, z)}) for d in "abc" for z in (True, False)]
    kept = [item.nodeid for item in default_tier(items, regressions=set())]
    assert len(kept) == 3 * 2  # every (driver, zeros) pair: here, all of them
    items = [Item(f"t.py::test_ddp[{d}-{z}-{b}]", {"config": config(d, z), "backend": b}) for d in "abc"
             for z in (True, False) for b in "xyz"]  # fmt: skip
    kept = default_tier(items, regressions=set())
    assert 9 <= len(kept) < len(items)


def test_the_default_tier_keeps_plain_tests_one_heavy_case_and_no_full_test():
    items = [Item("t.py::test_plain")]
    items += [Item(f"t.py::test_grid[{a}-{b}]", {"a": a, "b": b}) for a in range(3) for b in range(3)]
    items += [Item(f"t.py::test_heavy[{a}]", {"a": a}, ["heavy"]) for a in range(4)]
    items += [Item(f"t.py::test_full[{a}]", {"a": a}, ["full"]) for a in range(2)]
    kept = [item.nodeid for item in default_tier(items, regressions={"t.py::test_heavy[2]"})]
    assert "t.py::test_plain" in kept
    assert sum(n.startswith("t.py::test_grid") for n in kept) == 9  # two axes of three: every pair is a case
    assert [n for n in kept if n.startswith("t.py::test_heavy")] == ["t.py::test_heavy[2]"]
    assert not [n for n in kept if n.startswith("t.py::test_full")]


def test_the_regression_list_names_cases_the_full_tier_collects():
    files = sorted({case.split("::")[0] for case in read_regressions()})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "--full", "-p", "no:cacheprovider", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = set(done.stdout.splitlines())
    missing = [case for case in read_regressions() if case not in collected]
    assert not missing, f"tests/regressions.txt names cases that do not exist: {missing}"
