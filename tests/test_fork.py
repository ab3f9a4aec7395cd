"""After ``fork()`` the child's renewer renews only the leases the child took.

A worker holding a lease forks a helper that uses the same client, then dies. The helper's
renewer must not keep the dead parent's claim alive: the key is free once the parent's lease is
over, while the helper's own claim stays held for as long as the helper runs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from dedupe_worker import Deduplicator, State

pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork()")

PARENT = textwrap.dedent("""
    import os, sys, time
    from dedupe_worker import Deduplicator

    url, namespace = sys.argv[1], sys.argv[2]
    d = Deduplicator.from_url(url, namespace=namespace, lease=1.0, renew_interval=0.1)
    claim = d.begin("parent-key")
    assert claim.acquired
    d.renewer.track(claim.stem, claim.token)   # the parent works on it, lease renewed
    time.sleep(0.3)
    if os.fork() == 0:                          # a helper process, using the same client
        mine = d.begin("child-key")
        assert mine.acquired
        with d.keep_leases([mine]):
            time.sleep(3.5)
        os._exit(0)
    print("forked", flush=True)
    os._exit(1)                                 # the parent crashes: nothing releases its claim
""")


def test_a_forked_child_does_not_renew_its_parents_lease(redis_url: str, namespace: str) -> None:
    observer = Deduplicator.from_url(redis_url, namespace=namespace)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, redis_url, namespace], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    assert parent.stdout.readline().strip() == "forked"
    parent.wait(10)  # the parent only: the child lives on
    died = time.monotonic()
    while observer.status("parent-key").state is State.IN_PROGRESS and time.monotonic() - died < 3:
        time.sleep(0.05)
    freed_after = time.monotonic() - died
    child = observer.status("child-key").state  # the helper runs on, renewing its own claim
    print(f"\nparent's key free {freed_after:.2f} s after the parent died; the child's key: {child.value}")
    assert observer.status("parent-key").state is State.FREE
    assert freed_after < 1.5
    assert child is State.IN_PROGRESS
    time.sleep(1.2)  # longer than a lease: still held, so the child renews what it took
    assert observer.status("child-key").state is State.IN_PROGRESS
    observer.close()
    parent.stdout.close()
