"""What packing one script call costs: the compiled ``dedupe_worker._resp`` against hiredis, no Redis.

    python -m bench.packing [--calls N] [--repeat R] [--callgrind]

The command is the one a batch claim of 32 keys sends: ``FCALL`` of ``claim`` with 96 keys and 66
arguments (165 in all), built by the library's own ``StoreCalls.claim_calls`` and key layout. Both
packers must give the same bytes (checked first). Printed: µs per call and per argument, the
median of R timeit repeats of N calls, the packers taking turns so a noisy neighbour hits both.

``--callgrind``: instructions instead of time, which a shared machine does not disturb. Each
packer runs under ``valgrind --tool=callgrind`` twice, N and 2N calls, and the difference of the
totals over N is one call's cost (start-up and imports cancel); the same for a loop calling
``len`` (``loop``), whose cost is the Python loop and call around a packer, subtracted.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Callable
from typing import Any

import hiredis

from dedupe_worker._protocol.calls import StoreCalls
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker.keys import bytes_fingerprint

PACKERS: dict[str, Callable[[tuple[Any, ...]], Any]] = {"hiredis": hiredis.pack_command, "loop": len}
try:
    from dedupe_worker._resp import pack_command as compiled
except ImportError:  # not compiled here: hiredis only
    pass
else:
    PACKERS = {"compiled": compiled, **PACKERS}


class _Standalone:
    is_cluster = False


def claim_command(keys: int = 32) -> tuple[Any, ...]:
    """The ``FCALL`` a claim of ``keys`` keys sends on a standalone Redis (record format 1)."""
    calls = StoreCalls()
    calls.scripts = _Standalone()
    layout = KeyLayout("dedupe")
    items = []
    for i in range(keys):
        original = f"order-{1_000_000 + i}"
        stem = layout.stem(layout.stored_key(original)[0])
        items.append((stem, bytes_fingerprint(f'{{"order": {i}, "amount": 12.5}}'.encode()), original))
    ((name, key_names, args),) = calls.claim_calls(items, 30_000, 86_400_000)
    return ("FCALL", f"dedupe_0123abcd_{name}", len(key_names), *key_names, *args)


def timed(command: tuple[Any, ...], calls: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each packer, over ``repeat`` rounds taken in turn."""
    samples: dict[str, list[float]] = {name: [] for name in PACKERS}
    for _ in range(repeat):
        for name, pack in PACKERS.items():
            samples[name].append(timeit.timeit(lambda pack=pack: pack(command), number=calls) / calls)
    return {name: statistics.median(values) for name, values in samples.items()}


def instructions(packer: str, calls: int) -> int:
    """Instructions (callgrind's total) of a process that packs the command ``calls`` times."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
                        "bench.packing", "--run-only", packer, "--calls", str(calls)],
                       check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "0"})
        with open(out) as f:
            totals = re.search(r"^totals:\s+(\d+)", f.read(), re.MULTILINE)
        assert totals is not None, "callgrind wrote no totals"
        return int(totals.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per repeat (callgrind: the shorter run)")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--callgrind", action="store_true", help="count instructions with valgrind instead")
    parser.add_argument("--run-only", choices=PACKERS, help=argparse.SUPPRESS)  # one run under callgrind
    args = parser.parse_args()
    command = claim_command()
    if args.run_only:
        pack = PACKERS[args.run_only]
        for _ in range(args.calls):
            pack(command)
        return
    packed = {name: pack(command) for name, pack in PACKERS.items() if name != "loop"}
    assert len(set(packed.values())) == 1, "the packers disagree"
    size = len(command)
    print(f"one claim of 32 keys: {size} arguments, {len(packed['hiredis'])} bytes packed; "
          f"packers: {', '.join(n for n in PACKERS if n != 'loop')}")
    if args.callgrind:
        if not shutil.which("valgrind"):
            sys.exit("--callgrind needs valgrind")
        cost = {name: (instructions(name, 2 * args.calls) - instructions(name, args.calls)) / args.calls
                for name in PACKERS}
        loop = cost.pop("loop")
        print(f"instructions per call (a {loop:,.0f}-instruction Python loop and call subtracted):")
        for name, per_call in cost.items():
            print(f"  {name:9s} {per_call - loop:10,.0f} per call  {(per_call - loop) / size:7,.0f} per argument")
        if "compiled" in cost:
            print(f"  compiled/hiredis: {(cost['compiled'] - loop) / (cost['hiredis'] - loop):.3f}")
        return
    seconds = timed(command, args.calls, args.repeat)
    loop = seconds.pop("loop")
    print(f"µs per call, median of {args.repeat} x {args.calls:,} calls (a {loop * 1e6:.2f} µs loop and call "
          f"not subtracted); pid {os.getpid()}, cpus {sorted(os.sched_getaffinity(0))}:")
    for name, per_call in seconds.items():
        print(f"  {name:9s} {per_call * 1e6:8.2f} µs per call  {per_call * 1e9 / size:7.1f} ns per argument")
    if "compiled" in seconds:
        print(f"  compiled/hiredis: {seconds['compiled'] / seconds['hiredis']:.3f}")


if __name__ == "__main__":
    main()
