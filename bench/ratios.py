"""Printing of throughput samples as ratios to a baseline measured in the same run."""

from __future__ import annotations

import statistics


def print_ratios(label: str, rates: dict[str, list[float]], baseline: str, count: int,
                 cpu: dict[str, list[float]] | None = None) -> None:
    """One line per case: median msg/s of its samples and its ratio to ``baseline``'s median;
    with ``cpu`` (client CPU µs per message, ``time.process_time``), its median beside the
    baseline's."""
    base = statistics.median(rates[baseline])
    for name, values in rates.items():
        rate = statistics.median(values)
        line = f"  {label} {name:<12} {rate:>9,.0f} msg/s  ratio {rate / base:.2f}"
        if cpu is not None:
            line += (f"  client CPU {statistics.median(cpu[name]):6.1f} µs/msg"
                     f" ({baseline} {statistics.median(cpu[baseline]):.1f})")
        print(f"{line}  ({count} messages, median of {len(values)})", flush=True)
