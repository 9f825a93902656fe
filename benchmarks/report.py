"""Turn a pytest-benchmark JSON file into a Markdown table: medians, ratios to the first row of each group, GB/s.

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
        baseline = benches[0]["stats"]["median"]
        lines += [f"**{group}**", "", "| implementation | median (ms) | IQR (ms) | speed-up vs first row | GB/s (counted) |", "|---|---:|---:|---:|---:|"]
        for bench in benches:
            stats = bench["stats"]
            name = bench["params"].get("implementation", bench["name"])
            lines.append(
                f"| {name} | {stats['median'] * 1e3:.2f} | {stats['iqr'] * 1e3:.2f} | "
                f"{baseline / stats['median']:.2f}x | {bench['extra_info'].get('GB/s', float('nan')):.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1]))
