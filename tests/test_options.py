"""The client's options as one object: :class:`ClientOptions`, built from keywords, ``options=``,
a URL's query or :class:`DedupeSettings`, and passed whole to the client; ``token_retention``
and its old name ``retention``."""

from __future__ import annotations

import asyncio
import dataclasses
import warnings

import pytest
import redis
import redis.asyncio

from dedupe_worker import ClaimClient, ClientOptions, DedupeSettings, Deduplicator, Outcome
from dedupe_worker.asyncio import AsyncClaimClient, AsyncDeduplicator


def test_options_compare_by_value_and_are_frozen() -> None:
    assert ClientOptions() == ClientOptions()
    assert ClientOptions(lease=10) == ClientOptions(lease=10.0) != ClientOptions()
    assert hash(ClientOptions(lease=10)) == hash(ClientOptions(lease=10.0))
    options = ClientOptions(namespace="billing")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.lease = 1  # type: ignore[misc]
    changed = options.replace(lease=5)
    assert (changed.namespace, changed.lease, options.lease) == ("billing", 5, ClientOptions.lease)


@pytest.mark.parametrize("bad", [dict(lease=0), dict(result_ttl=-1), dict(token_retention=0), dict(wait_replicas=-1),
                                 dict(max_key_length=0), dict(compress_above=-1), dict(lease="30"),
                                 dict(compression="lz4")])
def test_options_are_checked_once_when_built(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ClientOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ClientOptions().replace(**bad)


def test_keywords_and_options_give_the_same_client(redis_client: redis.Redis, namespace: str) -> None:
    by_keywords = Deduplicator(redis_client, namespace=namespace, lease=7, result_ttl=60, fail_open=True)
    options = ClientOptions(namespace=namespace, lease=7, result_ttl=60, fail_open=True)
    by_options = Deduplicator(redis_client, options=options)
    assert by_keywords.options == by_options.options == options
    assert (by_options.lease, by_options.result_ttl, by_options.fail_open, by_options.renewer.interval) == \
           (by_keywords.lease, by_keywords.result_ttl, by_keywords.fail_open, by_keywords.renewer.interval)
    # one namespace: a key claimed by one is held for the other
    claim = by_keywords.begin("k")
    assert by_options.begin("k").outcome is Outcome.IN_PROGRESS
    by_keywords.complete(claim, 42)
    assert by_options.begin("k").result == 42
    # keywords win over options=
    assert Deduplicator(redis_client, options=options, lease=3).options == options.replace(lease=3)
    for d in (by_keywords, by_options):
        d.close()


def test_the_asyncio_client_takes_the_same_options(redis_url: str, namespace: str) -> None:
    async def main() -> None:
        options = ClientOptions(namespace=namespace, lease=7)
        aredis = redis.asyncio.Redis.from_url(redis_url)
        client = AsyncClaimClient(aredis, options=options)
        dedupe = AsyncDeduplicator(aredis, namespace=namespace, lease=7)
        assert client.options == dedupe.options == options
        claim = await client.begin("k")
        assert (await dedupe.begin("k")).outcome is Outcome.IN_PROGRESS
        await client.complete(claim, 1)
        await client.aclose()
        await dedupe.aclose()
        await aredis.aclose()

    asyncio.run(main())


def test_an_unknown_keyword_is_refused(redis_client: redis.Redis) -> None:
    with pytest.raises(TypeError, match="'leese'"):
        ClaimClient(redis_client, leese=10)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'leese'"):
        Deduplicator(redis_client, leese=10)  # type: ignore[call-arg]


def test_retention_is_the_old_name_of_token_retention(redis_client: redis.Redis, namespace: str) -> None:
    with pytest.warns(DeprecationWarning, match="'retention' option is renamed 'token_retention'") as caught:
        d = Deduplicator(redis_client, namespace=namespace, lease=0.1, result_ttl=30, retention=0.3)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert d.options == ClientOptions(namespace=namespace, lease=0.1, result_ttl=30, token_retention=0.3)
    d.release(d.begin("k"))
    started = f"{namespace}:{{k}}:started"
    assert 0 < redis_client.pttl(started) <= 300  # the counter is kept for the retention asked
    with pytest.raises(TypeError, match="old name"):
        Deduplicator(redis_client, retention=1, token_retention=1)
    d.close()


def test_token_retention_does_not_warn(redis_client: redis.Redis, namespace: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Deduplicator(redis_client, namespace=namespace, token_retention=5).close()


def test_from_url_reads_options_from_the_query(redis_url: str, namespace: str) -> None:
    url = (f"{redis_url}?namespace={namespace}&lease=12.5&result_ttl=60&fail_open=true&compress_above=none"
           "&max_key_length=100&wait_timeout=0.5&token_retention=90")
    d = Deduplicator.from_url(url)
    assert d.options == ClientOptions(namespace=namespace, lease=12.5, result_ttl=60, fail_open=True,
                                      compress_above=None, max_key_length=100, wait_timeout=0.5,
                                      token_retention=90)
    assert d.begin("k").outcome is Outcome.ACQUIRED  # the URL left to redis-py connects
    d.close()
    # keywords win over the query; an option not in the query keeps its default
    d = Deduplicator.from_url(f"{redis_url}?namespace={namespace}&lease=12.5", lease=3)
    assert d.options == ClientOptions(namespace=namespace, lease=3)
    d.close()
    with pytest.raises(ValueError, match="lease='soon' in the URL"):
        Deduplicator.from_url(f"{redis_url}?lease=soon")
    with pytest.raises(ValueError, match="lease must be positive"):
        Deduplicator.from_url(f"{redis_url}?lease=0")


def test_from_url_leaves_a_url_without_options_as_it_was() -> None:
    from dedupe_worker._settings import options_in_query

    for url in ("redis://h:6379/0", "redis://h:6379/0?cluster=1&socket_timeout=2", "redis+sentinel://a,b/svc/0?x=1"):
        assert options_in_query(url) == (url, {})
    assert options_in_query("redis://h/0?cluster=1&lease=2&socket_timeout=2") == \
           ("redis://h/0?cluster=1&socket_timeout=2", {"lease": 2.0})


def test_settings_become_the_options_object(monkeypatch: pytest.MonkeyPatch, redis_url: str, namespace: str) -> None:
    monkeypatch.setenv("DEDUPE_REDIS_URL", redis_url)
    monkeypatch.setenv("DEDUPE_NAMESPACE", namespace)
    monkeypatch.setenv("DEDUPE_LEASE", "9")
    monkeypatch.setenv("DEDUPE_COMPRESSION", "zlib")
    monkeypatch.setenv("DEDUPE_ALLOW_EVICTION", "true")
    options = DedupeSettings().options()
    assert options == ClientOptions(namespace=namespace, lease=9, compression="zlib", allow_eviction=True)
    assert DedupeSettings(_env_file=None).options() == options  # type: ignore[call-arg]
    d = Deduplicator.from_settings(result_ttl=60)  # keywords win over the settings
    assert d.options == options.replace(result_ttl=60)
    d.close()


def test_settings_defaults_are_the_options_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NAMESPACE", "LEASE", "RESULT_TTL", "MAX_KEY_LENGTH", "MAX_RESULT_BYTES", "COMPRESS_ABOVE",
                 "COMPRESSION", "FAIL_OPEN", "WAIT_REPLICAS", "WAIT_TIMEOUT", "ALLOW_EVICTION"):
        monkeypatch.delenv(f"DEDUPE_{name}", raising=False)
    assert DedupeSettings().options() == ClientOptions()
