"""The short fault-injection soak (issue 10): every integration at once, every fault kind at least
once (``redis_flush`` included), about two minutes; no operation lost, none applied twice, every
re-run explained. The handlers do plain, non-idempotent writes inside ``atomic()`` (issue 22).

The long run is ``make soak`` (``python -m tests.soak``); its figures are in docs/reliability.md.
"""

from __future__ import annotations

import shutil

import pytest

from . import services
from .soak.faults import KINDS
from .soak.harness import INTEGRATIONS, SoakConfig, run_soak

pytestmark = pytest.mark.slow


def test_short_soak_loses_nothing_and_applies_nothing_twice(rabbitmq_url: str, postgres_dsn: str) -> None:
    if shutil.which("redis-server") is None:
        services.unavailable("redis-server (the soak restarts a private Redis)")
    if services.tansu_binary() is None:
        services.unavailable("tansu (the soak runs a Kafka broker behind its proxy)")
    config = SoakConfig(duration=75, seed=10, fault_gap=(2.0, 4.5), postgres_dsn=postgres_dsn,
                        rabbitmq_url=rabbitmq_url, drain_timeout=120, write="plain")
    result = run_soak(config)
    print(result.report())
    assert set(result.fault_counts()) == set(KINDS), f"a fault kind never happened: {result.fault_counts()}"
    for name in INTEGRATIONS:
        fig = result.figures[name]
        assert fig.operations > 50, f"{name}: too little traffic"
        assert fig.deliveries >= 2 * fig.operations, f"{name}: an operation was sent only once"
    assert result.lost == 0, result.report()
    assert result.applied_twice == 0, result.report()
    assert result.unexplained == 0, result.report()
    assert result.ok
