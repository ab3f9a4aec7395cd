"""``make bench``: every benchmark, each against a baseline (and the peers) measured in the same run.

    python -m bench [--pin same|split|both|none] [--only MODULE ...] [--seconds S] [--charts DIR]
                    [--baseline [REF] [--rounds N] [--baseline-env NAME=VALUE ...]]

Where Redis and the client run changes a round trip 3x on a small machine, so every run says
where they ran and only numbers from one placement are compared with each other:

* ``same``: a private ``redis-server`` started for the run, pinned with ``taskset`` to the first
  allowed vCPU, and every bench client pinned to that same vCPU;
* ``split``: the private Redis on the first vCPU, the clients on the second;
* ``both`` (the default): ``bench.core`` and ``bench.held_connection`` once with each placement,
  the other benches ``split``;
* ``none``: no pinning, against ``DEDUPE_REDIS_URL`` (default the local 6379).

Each bench's output is echoed as it comes and, at the end, drawn as SVG bar charts under
``docs/img/`` (``--charts DIR`` elsewhere, ``--charts ''`` none; :mod:`bench.charts`), stamped with
the date and the machine. A private server is used for pinned runs so that the shared Redis other
processes use is never re-pinned. Without ``taskset``, ``redis-server`` or a second vCPU the run falls back to ``none``
and says so.

With ``--baseline REF`` (``make bench BASELINE=REF``) each bench runs ``--rounds`` times against the
current code and as often against ``REF``'s, taking turns, and each figure is printed for both
with their ratio (:mod:`bench.baseline`); the charts then show the current code's first round.
``--baseline .`` is the current code again, which with ``--baseline-env DEDUPE_PURE_PYTHON=1``
measures the accelerators on against off.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import baseline
from .charts import bench_charts, stamp

BENCHES = ("bench.core", "bench.held_connection", "bench.lua_cost", "bench.asyncio_paths", "bench.celery_tasks",
           "bench.celery_send", "bench.rabbitmq_consumer", "bench.kafka_consumer", "bench.kafka_cpu",
           "bench.frameworks", "bench.single_cpu", "bench.replay", "bench.settle", "bench.durability",
           "bench.http_middleware", "bench.sql_outcomes", "bench.sql_store", "bench.compression", "bench.packing")
#: The benches whose Redis is chosen by ``--redis-url`` (the others use the shared one).
TAKES_REDIS_URL = ("bench.core", "bench.held_connection", "bench.lua_cost", "bench.asyncio_paths",
                   "bench.celery_tasks", "bench.celery_send", "bench.rabbitmq_consumer", "bench.kafka_consumer",
                   "bench.kafka_cpu",
                   "bench.frameworks", "bench.single_cpu", "bench.replay", "bench.settle", "bench.http_middleware",
                   "bench.sql_outcomes", "bench.sql_store", "bench.compression")
#: The benches that print a ``--label`` (where they ran).
TAKES_LABEL = ("bench.core", "bench.held_connection", "bench.asyncio_paths", "bench.rabbitmq_consumer",
               "bench.kafka_consumer", "bench.frameworks", "bench.settle", "bench.durability", "bench.http_middleware",
               "bench.sql_outcomes", "bench.sql_store")
#: Run with each placement under ``--pin both``: the per-message paths, where placement matters most.
BOTH_PLACEMENTS = ("bench.core", "bench.held_connection")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(cpu: int) -> tuple[subprocess.Popen[bytes], str]:
    """A private ``redis-server`` pinned to ``cpu``, its URL. Configured as docs/guarantees.md asks of
    production (``appendonly yes``, ``appendfsync everysec``), so every write pays for the AOF."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="dedupe-bench-redis-")
    proc = subprocess.Popen(
        ["taskset", "-c", str(cpu), "redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "yes", "--appendfsync", "everysec", "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the private redis-server did not start")


#: Where the charts go unless ``--charts`` says otherwise.
CHARTS = Path(__file__).resolve().parent.parent / "docs" / "img"


def echoed(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd``, echoing its output as it comes; its exit status and its output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=cwd,
                            env={**os.environ, **env} if env else None)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    return proc.wait(), "".join(lines)


def run(module: str, *, cpu: int | None, label: str, redis_url: str | None, extra: list[str],
        outputs: list[tuple[str, str, str]] | None = None, python: str = sys.executable,
        cwd: Path | None = None, env: dict[str, str] | None = None) -> int:
    """Run one bench with ``python`` in ``cwd`` (and ``env`` added to the environment); its output
    is appended to ``outputs`` as ``(module, placement, output)``."""
    if module == "bench.single_cpu" and not shutil.which("valgrind"):
        print(f"\n{module} skipped: it counts instructions with valgrind, which is not installed", flush=True)
        return 0
    cmd = [python, "-m", module, *extra]
    if label and module in TAKES_LABEL:
        cmd += ["--label", label]
    if redis_url and module in TAKES_REDIS_URL:
        cmd += ["--redis-url", redis_url]
    if module == "bench.kafka_consumer":  # Redis CPU per message on a cluster too (its nodes unpinned)
        cmd += ["--cluster", "3"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    print(f"\n$ {' '.join(cmd)}\n  placement: {label}", flush=True)
    code, text = echoed(cmd, cwd, env)
    if module == "bench.kafka_cpu" and shutil.which("valgrind"):  # and its instructions: no neighbour disturbs them
        print(f"\n$ {' '.join(cmd)} --callgrind", flush=True)
        more, extra_text = echoed([*cmd, "--callgrind"], cwd, env)
        code, text = code or more, text + extra_text
    if outputs is not None:
        outputs.append((module, label, text))
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", choices=("same", "split", "both", "none"),
                        default=os.environ.get("PIN") or "both")
    parser.add_argument("--only", nargs="*", choices=BENCHES, help="run only these benches")
    parser.add_argument("--seconds", type=float, help="bench.core: seconds per case")
    parser.add_argument("--charts", default=str(CHARTS), metavar="DIR",
                        help="write SVG charts of the figures here ('' for none; default docs/img)")
    parser.add_argument("--baseline", nargs="?", const=baseline.RELEASE_BEFORE, metavar="REF",
                        help="also run every bench against this git ref's code, taking turns "
                             f"(without REF: {baseline.RELEASE_BEFORE}, this release's main before its changes)")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: runs of each side per bench")
    parser.add_argument("--baseline-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="with --baseline: set in the baseline side's environment (--baseline . "
                             "--baseline-env DEDUPE_PURE_PYTHON=1: the accelerators on against off)")
    args = parser.parse_args(argv)
    outputs: list[tuple[str, str, str]] = []
    try:
        return _run_all(args, outputs)
    finally:
        if args.charts and outputs:
            written = bench_charts(outputs, Path(args.charts), stamp())
            print(f"\ncharts: {len(written)} written to {args.charts}", flush=True)


def compared(args: argparse.Namespace, module: str, *, outputs: list[tuple[str, str, str]],
             **how: Any) -> int:
    """Run one bench (:func:`run`); with ``--baseline``, ``--rounds`` times against each side taking
    turns, then print the figures side by side. The number of runs that failed."""
    if not args.baseline:
        return int(run(module, outputs=outputs, **how) != 0)
    python = sys.executable if args.baseline == "." else str(baseline.baseline_python(args.baseline))
    env = dict(pair.split("=", 1) for pair in args.baseline_env)
    texts: dict[str, list[str]] = {"current": [], "baseline": []}
    failures = 0
    with tempfile.TemporaryDirectory(prefix="dedupe-bench-code-") as tmp:
        cwd = baseline.link_bench(Path(tmp))
        for n in range(args.rounds):
            for side, exe, side_env in (("current", sys.executable, None), ("baseline", python, env)):
                print(f"\n--- {module}: {side} ({args.baseline if side == 'baseline' else 'this tree'}), "
                      f"round {n + 1} of {args.rounds}", flush=True)
                side_outputs: list[tuple[str, str, str]] = []
                failures += run(module, outputs=side_outputs, python=exe, cwd=cwd, env=side_env, **how) != 0
                texts[side] += [text for _, _, text in side_outputs]
                if side == "current" and n == 0:
                    outputs += side_outputs
    name = " ".join([args.baseline, *args.baseline_env])
    print(baseline.report(module, name, texts["current"], texts["baseline"]), flush=True)
    return failures


def _run_all(args: argparse.Namespace, outputs: list[tuple[str, str, str]]) -> int:
    benches = args.only or list(BENCHES)
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin
    if pin != "none" and not (shutil.which("taskset") and shutil.which("redis-server") and len(cpus) >= 2):
        print(f"--pin {pin} needs taskset, redis-server and two vCPUs: running unpinned", flush=True)
        pin = "none"
    core_extra = ["--seconds", str(args.seconds)] if args.seconds else []
    failures = 0
    if pin == "none":
        for module in benches:
            if module == "bench.lua_cost":  # it resets the server's statistics: private servers only
                print("\nbench.lua_cost skipped: it runs only on the private redis-server of a pinned run")
                continue
            failures += compared(args, module, cpu=None, label="unpinned, shared Redis", redis_url=None,
                                 extra=core_extra if module == "bench.core" else [], outputs=outputs)
        return 1 if failures else 0
    redis_cpu, other_cpu = cpus[0], cpus[1]
    placements = {"same": (redis_cpu, f"Redis and client on vCPU {redis_cpu} (taskset)"),
                  "split": (other_cpu, f"Redis on vCPU {redis_cpu}, client on vCPU {other_cpu} (taskset)")}
    server, url = start_redis(redis_cpu)
    try:
        for module in benches:
            chosen = ("same", "split") if pin == "both" and module in BOTH_PLACEMENTS else \
                ("split",) if pin == "both" else (pin,)
            for name in chosen:
                cpu, label = placements[name]
                failures += compared(args, module, cpu=cpu, label=label, redis_url=url,
                                     extra=core_extra if module == "bench.core" else [], outputs=outputs)
    finally:
        server.kill()
        server.wait(10)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
