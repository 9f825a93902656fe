"""Turn a pytest-benchmark JSON file into Markdown tables: medians, speed-up over the first row of each group and over
the ``torch`` backend, GB/s.

    python benchmarks/report.py benchmarks/results/<name>.json > benchmarks/results/<name>.md
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def report(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    machine = data["machine_info"]
    where = machine.get("gpu") or f"CPU ({machine.get('cpu', {}).get('brand_raw', machine.get('processor', '?'))}, {machine.get('cpu_count')} cores)"
    lines = [
        f"Measured {machine.get('date', data.get('datetime', '?')[:10])} on {where}; torch {machine.get('torch')}, "
        f"triton {machine.get('triton')}, {machine.get('platform')}. Source: `{path}`.",
        "",
    ]
    groups = defaultdict(list)
    for bench in data["benchmarks"]:
        groups[bench["group"]].append(bench)
    for group, benches in groups.items():
        first = benches[0]["params"].get("implementation", benches[0]["name"])
        baseline = benches[0]["stats"]["median"]
        torch_rows = [b["stats"]["median"] for b in benches if b["params"].get("implementation") == "torch"]
        lines += [
            f"**{group}**", "",
            f"| implementation | median (ms) | IQR (ms) | speed-up vs {first} | speed-up vs torch | GB/s (counted) |",
            "|---|---:|---:|---:|---:|---:|",
        ]  # fmt: skip
        for bench in benches:
            stats = bench["stats"]
            name = bench["params"].get("implementation", bench["name"])
            versus_torch = f"{torch_rows[0] / stats['median']:.2f}x" if torch_rows else "-"
            lines.append(
                f"| {name} | {stats['median'] * 1e3:.2f} | {stats['iqr'] * 1e3:.2f} | "
                f"{baseline / stats['median']:.2f}x | {versus_torch} | {bench['extra_info'].get('GB/s', float('nan')):.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1]))
