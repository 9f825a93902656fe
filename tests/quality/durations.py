"""Where a tier's time goes: a pytest JUnit XML report summed per folder and per test function.

    python -m pytest -q -n auto --dist loadfile tests --junitxml=run.xml
    python tests/quality/durations.py run.xml "the default tier, fresh clone" > tests/quality/durations.md

The times are pytest's per test (set-up, call and tear-down), summed over the workers where several shared the
cores; the run's own duration (collection included) is the report's.
"""

from __future__ import annotations

import platform
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TOP = 30


def cases(report: Path) -> list[tuple[str, float, str]]:
    """(test function's node id without its parameters, seconds, outcome) of every case in ``report``."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        out.append((f"{module}.py::{case.get('name', '').split('[', 1)[0]}", float(case.get("time", 0)), outcome))
    return out


def render(report: Path, what: str) -> str:
    rows = cases(report)
    total = sum(seconds for _, seconds, _ in rows)
    took = sum(float(suite.get("time", 0)) for suite in ET.parse(report).getroot().iter("testsuite"))
    folders, functions, counts = Counter(), Counter(), Counter()
    for name, seconds, _ in rows:
        folders["/".join(name.split("/")[:2])] += seconds
        functions[name] += seconds
        counts[name] += 1
    outcomes = Counter(outcome for _, _, outcome in rows)
    lines = [
        f"# Where the time goes: {what}",
        "",
        f"{platform.machine()}, Python {platform.python_version()}; {len(rows)} cases "
        f"({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))}): the run took {took / 60:.1f} minutes, "
        f"{total / 60:.1f} minutes of test time summed over its workers "
        f"(`python tests/quality/durations.py` over the run's JUnit report).",
        "",
        "| folder | minutes | share |",
        "|---|---:|---:|",
        *(f"| `{k}` | {v / 60:.1f} | {100 * v / total:.0f}% |" for k, v in folders.most_common()),
        "",
        f"The {TOP} slowest test functions, all their cases together:",
        "",
        "| test | cases | seconds |",
        "|---|---:|---:|",
        *(f"| `{k}` | {counts[k]} | {v:.0f} |" for k, v in functions.most_common(TOP)),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(render(Path(sys.argv[1]), sys.argv[2]))
