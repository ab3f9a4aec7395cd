"""Printing of throughput samples as ratios to a baseline measured in the same run."""

from __future__ import annotations

import statistics


def print_ratios(label: str, rates: dict[str, list[float]], baseline: str, count: int) -> None:
    """One line per case: median msg/s of its samples and its ratio to ``baseline``'s median."""
    base = statistics.median(rates[baseline])
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"  {label} {name:<12} {rate:>9,.0f} msg/s  ratio {rate / base:.2f}"
              f"  ({count} messages, median of {len(values)})", flush=True)
