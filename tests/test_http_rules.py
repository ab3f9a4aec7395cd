"""The I/O-free rules of the Idempotency-Key layer: key parsing, scope, fingerprint, what is
stored, how it is encoded, and the problem responses."""

from __future__ import annotations

import pytest

from dedupe_worker import Claim, Outcome
from dedupe_worker._protocol.fingerprint import content_hash
from dedupe_worker.http import IdempotencyRules, KeyProblem, RequestInfo, header_scope, parse_key, stored_status
from dedupe_worker.http._stored import Response, decode, encode

SCOPE = header_scope("authorization")
EMPTY = content_hash(b"{}")


def caller_of(rules: IdempotencyRules, info: RequestInfo) -> str:
    who = rules.caller(info)
    assert isinstance(who, str)
    return who


@pytest.mark.parametrize(("values", "expected"), [
    ([], KeyProblem.MISSING),
    (['"abc"'], "abc"),
    ([' "abc" '], "abc"),
    (['"a\\"b\\\\c"'], 'a"b\\c'),
    (["8e03978e-40d5-43e8-bc93-6894a57f9324"], "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    (["token:with/slash"], "token:with/slash"),
    (["a", "b"], KeyProblem.REPEATED),
    (['"a", "b"'], KeyProblem.REPEATED),
    (["a, b"], KeyProblem.REPEATED),
    ([""], KeyProblem.EMPTY),
    (['""'], KeyProblem.EMPTY),
    (['"' + "x" * 37 + '"'], KeyProblem.TOO_LONG),
    (['"abc'], KeyProblem.SYNTAX),
    (['"a\\nb"'], KeyProblem.SYNTAX),
    (['"a"b"'], KeyProblem.SYNTAX),
    (["has space"], KeyProblem.SYNTAX),
    (['"caf\u00e9"'], KeyProblem.SYNTAX),
])
def test_parse_key(values: list[str], expected: object) -> None:
    assert parse_key(values, max_length=36) == expected


def request(path: str = "/pay", method: str = "POST", headers: tuple[tuple[str, str], ...] = (),
            query: str = "") -> RequestInfo:
    return RequestInfo(method, path, query, headers)


def test_screen_methods_required_and_excluded() -> None:
    rules = IdempotencyRules(scope=SCOPE, required=lambda r: None if r.path == "/out" else r.path == "/must")
    assert rules.screen(request("/must", "GET")) is None
    missing = rules.screen(request("/must"))
    assert isinstance(missing, Response) and missing.status == 400
    assert rules.screen(request("/may")) is None
    assert rules.screen(request("/out", headers=(("idempotency-key", "k"),))) is None
    assert rules.screen(request("/may", headers=(("idempotency-key", "k"), ("authorization", "a")))) == "k"
    nobody = rules.caller(request("/may", headers=(("idempotency-key", "k"),)))  # no principal: refused
    assert isinstance(nobody, Response) and nobody.status == 403
    renamed = IdempotencyRules(scope=SCOPE, header="X-Request-Id", required=True)
    assert renamed.screen(request(headers=(("x-request-id", '"r1"'), ("authorization", "a")))) == "r1"
    assert b"X-Request-Id is missing" in renamed.screen(request()).body  # type: ignore[union-attr]


def test_scope_and_fingerprint() -> None:
    rules = IdempotencyRules(scope=SCOPE)
    a_req, b_req = (request(headers=(("authorization", f"Bearer {x}"),)) for x in "ab")
    alice = rules.attempt(a_req, "k", caller_of(rules, a_req), EMPTY)
    bob = rules.attempt(b_req, "k", caller_of(rules, b_req), EMPTY)
    assert alice.key != bob.key and alice.fingerprint == bob.fingerprint
    assert rules.attempt(request("/other"), "k", "u", EMPTY).key != rules.attempt(request(), "k", "u", EMPTY).key
    assert rules.attempt(request(method="PATCH"), "k", "u", EMPTY).key != rules.attempt(request(), "k", "u", EMPTY).key
    base = rules.attempt(request(), "k", "u", EMPTY).fingerprint
    assert rules.attempt(request(query="a=1"), "k", "u", EMPTY).fingerprint != base
    assert rules.attempt(request(), "k", "u", content_hash(b"{ }")).fingerprint != base
    assert rules.attempt(request(headers=(("content-type", "text/plain"),)), "k", "u", EMPTY).fingerprint != base
    by_user = IdempotencyRules(scope=lambda r: "user-7")  # the principal, whatever the credential
    assert caller_of(by_user, a_req) == caller_of(by_user, b_req) == "user-7"
    assert isinstance(IdempotencyRules(scope=lambda r: "").caller(a_req), Response)  # "" is refused like None


def test_statuses_stored_by_default() -> None:
    assert all(stored_status(s) for s in (200, 201, 204, 301, 400, 404, 422))
    assert not any(stored_status(s) for s in (408, 409, 425, 429, 500, 503))


def test_recorder_strips_ttl_header_and_settles() -> None:
    rules = IdempotencyRules(scope=SCOPE, max_body_bytes=10, compress_above=4)
    recorder = rules.recorder(request())
    sent = recorder.start(201, [("Content-Type", "text/plain"), ("Idempotency-TTL", "7"), ("Date", "x"),
                                ("Set-Cookie", "a=b")])
    assert sent == [("Content-Type", "text/plain"), ("Date", "x"), ("Set-Cookie", "a=b")]
    recorder.body(b"aaaa")
    recorder.body(b"aaaa")
    settle = recorder.settle(True, 1_000_000)
    assert settle.store and settle.ttl == 7.0
    stored = decode(settle.value, 1_000_000)
    assert stored == Response(201, (("Content-Type", "text/plain"),), b"aaaaaaaa")
    assert not recorder.settle(False, 1_000_000).store  # cut off: released


def test_body_over_the_limit_is_stored_without_it() -> None:
    rules = IdempotencyRules(scope=SCOPE, max_body_bytes=10)
    recorder = rules.recorder(request())
    recorder.start(200, [("Content-Length", "11")])
    recorder.body(b"x" * 11)
    stored = decode(recorder.settle(True, 1_000_000).value, 1_000_000)
    assert stored is not None and stored.omitted and stored.body == b""
    replay = rules.answer(Claim("k", Outcome.DUPLICATE, 3, result=recorder.settle(True, 1_000_000).value))
    assert replay is not None and replay.status == 200 and replay.body == b""
    assert ("idempotent-body-omitted", "true") in replay.headers and ("content-length", "0") in replay.headers
    small_limit = rules.recorder(request())
    small_limit.start(200, [])
    small_limit.body(b"x" * 10)
    assert not decode(small_limit.settle(True, 45).value, 1_000_000).omitted  # type: ignore[union-attr]
    assert decode(small_limit.settle(True, 44).value, 1_000_000).omitted  # type: ignore[union-attr]  # exact size


@pytest.mark.parametrize("compression", ["deflate", "gzip"])
def test_encode_round_trips_bytes(compression: str) -> None:
    body = bytes(range(256)) * 40
    response = Response(404, (("X-Raw", "caf\u00e9"), ("x-dup", "1"), ("x-dup", "2")), body)
    value = encode(response, compress_above=100, compression=compression)
    assert value["z"] == compression
    assert decode(value, 1_000_000) == response
    assert decode({"v": 99}, 1_000_000) is None and decode("text", 1_000_000) is None


def test_answers_to_claims() -> None:
    rules = IdempotencyRules(scope=SCOPE, docs_url="https://d.example/idem")
    assert rules.answer(Claim("k", Outcome.ACQUIRED, 1)) is None
    busy = rules.answer(Claim("k", Outcome.IN_PROGRESS, 1, retry_after=2.2))
    assert busy is not None and busy.status == 409 and ("retry-after", "1") in busy.headers  # short by default
    patient = IdempotencyRules(scope=SCOPE, retry_after=5.0)
    capped = patient.answer(Claim("k", Outcome.IN_PROGRESS, 1, retry_after=2.2))
    assert capped is not None and ("retry-after", "3") in capped.headers  # never past the holder's lease
    waits = patient.answer(Claim("k", Outcome.IN_PROGRESS, 1, retry_after=29.0))
    assert waits is not None and ("retry-after", "5") in waits.headers
    assert b'"type":"https://d.example/idem#request-outstanding"' in busy.body
    conflict = rules.answer(Claim("k", Outcome.CONFLICT))
    assert conflict is not None and conflict.status == 422
    assert b"Idempotency-Key is already used" in conflict.body
    stored = encode(Response(201, (("content-type", "application/json"),), b'{"id":1}'),
                    compress_above=1024, compression="deflate")
    replay = rules.answer(Claim("k", Outcome.DUPLICATE, 1, result=stored))
    assert replay == Response(201, (("content-type", "application/json"), ("idempotent-replayed", "true")),
                              b'{"id":1}')


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError):
        IdempotencyRules(scope=SCOPE, compression="brotli")
    with pytest.raises(ValueError):
        IdempotencyRules(scope=SCOPE, max_key_length=0)


def test_cookies_are_replayed_only_when_asked() -> None:
    for replay_cookies in (False, True):
        recorder = IdempotencyRules(scope=SCOPE, replay_cookies=replay_cookies).recorder(request())
        recorder.start(200, [("Set-Cookie", "a=b"), ("Connection", "close"), ("X-Kept", "1")])
        stored = decode(recorder.settle(True, 1_000_000).value, 1_000_000)
        assert stored is not None
        assert stored.headers == ((("Set-Cookie", "a=b"),) if replay_cookies else ()) + (("X-Kept", "1"),)


@pytest.mark.parametrize("status", [201, 404, 409, 429, 500])
def test_store_predicate_decides(status: int) -> None:
    recorder = IdempotencyRules(scope=SCOPE, store=lambda s: s != 404).recorder(request())
    recorder.start(status, [])
    assert recorder.settle(True, 1_000_000).store is (status != 404)
