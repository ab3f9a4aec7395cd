"""The soak's figures, computed from the ledger and the fault log, and printed as one table per
integration.

- **lost**: an operation whose balance is still 0 after the drain;
- **applied twice**: an operation whose balance is not its amount (more than one write added it);
- **handler re-runs**: every invocation of a key after its first, each attributed to a cause found
  in the fault log (the earlier invocation's process was SIGKILLed or SIGSTOPped after it began,
  Redis was restarted or unreachable between the two, or it lost its data in between), and listed
  with what its write did;
  one with no such fault is listed as ``unexplained``;
- **fenced**: writes refused by the fence (0 rows: a newer token had written);
- **already applied**: re-runs that found an earlier token's write committed (a crash
  window) and skipped it, as the handler's idempotent write does;
- **lease lost**: completions refused (the ``on_lease_lost`` hook's rows);
- **dead-lettered**: the ``on_dead_letter`` hook's rows, by reason.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from bench.charts import Chart

from .faults import Fault
from .ledger import Ledger

__all__ = ["Figures", "attribute", "charts", "collect", "format_report"]


@dataclass
class Figures:
    """One integration's figures."""

    integration: str
    operations: int = 0
    deliveries: int = 0
    applied: int = 0
    lost: list[str] = field(default_factory=list)
    applied_twice: list[str] = field(default_factory=list)
    reruns: list[tuple[str, str]] = field(default_factory=list)  # (key, cause)
    fenced: int = 0
    already_applied: int = 0
    lease_lost: int = 0
    dead_lettered: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    @property
    def unexplained(self) -> list[str]:
        return [key for key, cause in self.reruns if cause.startswith("unexplained")]

    def percentile(self, p: float) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def attribute(key_pid_at: tuple[int, float], next_at: float, faults: list[Fault], lease: float,
              lease_lost: bool = False) -> str:
    """The cause of a re-run: the fault between the earlier invocation (``pid`` began at ``at``)
    and the next one that explains it, else a lease the key lost, else ``"unexplained"``."""
    pid, at = key_pid_at
    for f in faults:
        if f.kind in ("sigkill", "sigstop") and pid in f.pids and at - 0.05 <= f.start <= next_at:
            return f"{f.kind} of pid {pid} ({f.target})" + (" mid-handler" if f.kind == "sigkill" else
                                                             ": zombie past its lease")
    for f in faults:
        if f.kind in ("redis_restart", "redis_unreachable") and at - lease <= f.start <= next_at:
            return f"{f.kind} between the handler and its completion"
    for f in faults:  # Redis forgot the key: any later delivery of it is claimed as new
        if f.kind == "redis_flush" and at <= f.start <= next_at:
            return "redis_flush: Redis lost the key's records"
    if lease_lost:
        return "lease expired while the handler ran (its completion was refused)"
    return "unexplained"


def collect(ledger: Ledger, integrations: list[str], faults: list[Fault], lease: float,
            sends: Counter[str]) -> dict[str, Figures]:
    figures = {i: Figures(i) for i in integrations}
    for name, fig in figures.items():
        fig.deliveries = sends[name]
        fig.faults = Counter(f.kind for f in faults if name in f.integrations)
    for op_id, integration, amount, balance, published, applied in ledger.rows(
            "SELECT id, integration, amount, balance, published_at, applied_at FROM {accounts}"):
        fig = figures[integration]
        fig.operations += 1
        if balance == 0:
            fig.lost.append(op_id)
        elif balance != amount:
            fig.applied_twice.append(op_id)
        else:
            fig.applied += 1
        if applied is not None and published is not None:
            fig.latencies.append(applied - published)
    integration_of = dict(ledger.rows("SELECT id, integration FROM {accounts}"))
    started: dict[str, list[tuple[int, float, int]]] = defaultdict(list)
    ended: dict[tuple[str, int], str] = {}
    for key, token, pid, at, phase in ledger.rows("SELECT key, token, pid, at, phase FROM {invocations} "
                                                  "ORDER BY seq"):
        fig = figures[integration_of[key]]
        if phase == "started":
            started[key].append((pid, at, token))
            continue
        ended[(key, token)] = phase
        if phase == "fenced":
            fig.fenced += 1
        elif phase == "already_applied":
            fig.already_applied += 1
    events = ledger.rows("SELECT kind, key, detail FROM {events}")
    lost_leases = {key for kind, key, _ in events if kind == "lease_lost"}
    for key, runs in started.items():
        runs.sort(key=lambda r: r[1])
        for earlier, later in itertools.pairwise(runs):
            cause = attribute((earlier[0], earlier[1]), later[1], faults, lease, key in lost_leases)
            outcome = ended.get((key, later[2]), "no write (killed or stopped)")
            figures[integration_of[key]].reruns.append((key, f"{cause} -> {outcome}"))
    for kind, key, detail in events:
        fig = figures[integration_of.get(key, integrations[0])] if key else figures[integrations[0]]
        if kind == "lease_lost":
            fig.lease_lost += 1
        else:
            fig.dead_lettered[detail.split()[0] if detail else "?"] += 1
    return figures


def format_report(figures: dict[str, Figures], seconds: float, details: bool = True) -> str:
    lines: list[str] = []
    for fig in figures.values():
        causes = Counter(cause.split(" of pid")[0].split(" (")[0].split(" ->")[0] for _, cause in fig.reruns)
        rows: list[tuple[str, Any]] = [
            ("operations", fig.operations),
            ("deliveries (copies sent)", fig.deliveries),
            ("faults", ", ".join(f"{k} {v}" for k, v in sorted(fig.faults.items())) or "none"),
            ("LOST", len(fig.lost)),
            ("APPLIED TWICE", len(fig.applied_twice)),
            ("UNEXPLAINED RE-RUNS", len(fig.unexplained)),
            ("handler re-runs", f"{len(fig.reruns)} ({', '.join(f'{k}: {v}' for k, v in sorted(causes.items()))})"
             if fig.reruns else 0),
            ("  of which found the effect committed", fig.already_applied),
            ("stale writes refused by the fence", fig.fenced),
            ("outcomes refused as lease lost", fig.lease_lost),
            ("dead-lettered", ", ".join(f"{k} {v}" for k, v in fig.dead_lettered.items()) or 0),
            ("throughput (applied/s)", f"{fig.applied / seconds:.1f}" if seconds else "-"),
            ("publish->apply p50 / p99", f"{fig.percentile(0.5) * 1000:.0f} ms / {fig.percentile(0.99) * 1000:.0f} ms"),
        ]
        width = max(len(r[0]) for r in rows)
        lines.append(f"== {fig.integration} ==")
        lines += [f"  {label:<{width}}  {value}" for label, value in rows]
        if details:
            lines += [f"    re-run {key}: {cause}" for key, cause in fig.reruns]
            lines += [f"    LOST {key}" for key in fig.lost[:50]]
            lines += [f"    APPLIED TWICE {key}" for key in fig.applied_twice[:50]]
    return "\n".join(lines)


def charts(figures: dict[str, Figures]) -> list[Chart]:
    """The report as two charts: what happened to the operations of each integration (LOST and
    APPLIED TWICE must be 0), and the publish->apply latency."""
    names = list(figures)
    counts = [("operations", lambda f: f.operations), ("deliveries (copies sent)", lambda f: f.deliveries),
              ("handler re-runs", lambda f: len(f.reruns)), ("re-runs that found the effect committed",
                                                              lambda f: f.already_applied),
              ("stale writes refused by the fence", lambda f: f.fenced),
              ("outcomes refused as lease lost", lambda f: f.lease_lost),
              ("dead-lettered", lambda f: sum(f.dead_lettered.values())),
              ("LOST", lambda f: len(f.lost)), ("APPLIED TWICE", lambda f: len(f.applied_twice)),
              ("UNEXPLAINED RE-RUNS", lambda f: len(f.unexplained))]
    outcome = Chart("soak: what happened to the operations", "count", names,
                    [(label, [float(count(figures[n])) for n in names]) for label, count in counts])
    latency = Chart("soak: publish -> apply latency", "ms", ["p50", "p99"],
                    [(n, [figures[n].percentile(0.5) * 1000, figures[n].percentile(0.99) * 1000]) for n in names])
    return [outcome, latency]
