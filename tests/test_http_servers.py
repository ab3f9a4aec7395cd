"""The Idempotency-Key middleware behind real servers, two worker processes each, on real Redis:
FastAPI on uvicorn (ASGI), Flask on gunicorn (WSGI) and Django on gunicorn (its own middleware).
Every test runs against all three, on one server per kind for the whole module."""

from __future__ import annotations

import gzip
import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker._protocol.serialization import unpack
from dedupe_worker._transport.record import read_result

from .http_servers import SERVERS, serve

pytestmark = pytest.mark.timeout(120)

#: The caller of these tests (a bearer token whose subject is "tester").
TESTER = "Bearer tester"


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request: pytest.FixtureRequest, redis_url: str) -> Iterator[tuple[str, str]]:
    namespace = f"t-http-{uuid.uuid4().hex[:10]}"
    with serve(request.param, redis_url, namespace) as base:
        yield base, namespace


@pytest.fixture
def client(server: tuple[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=30.0, headers={"Authorization": TESTER},
                      limits=httpx.Limits(max_connections=64, max_keepalive_connections=64)) as c:
        yield c


@pytest.fixture
def effects(server: tuple[str, str], redis_url: str) -> Iterator[object]:
    r = redis.Redis.from_url(redis_url)

    def count(method: str, path: str, key: str, auth: str = TESTER) -> int:
        return int(r.get(f"{server[1]}:effects:{method}:{path}:{key}:{auth}") or 0)

    yield count
    r.close()


def new_key() -> str:
    return str(uuid.uuid4())


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


def assert_problem(response: httpx.Response, status: int, title: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["title"] == title
    assert problem["status"] == status
    assert problem["type"].startswith("https://api.example.com/docs/idempotency#")


def fifty(client: httpx.Client, path: str, key: str) -> list[httpx.Response]:
    barrier = threading.Barrier(50)

    def post(_: int) -> httpx.Response:
        barrier.wait()
        return client.post(path, content=b'{"amount": 10}',
                           headers={"Idempotency-Key": key, "Content-Type": "application/json"})

    with ThreadPoolExecutor(50) as pool:
        return list(pool.map(post, range(50)))


def test_fifty_concurrent_posts_run_once(client: httpx.Client, effects: object) -> None:
    key = new_key()
    responses = fifty(client, "/orders?sleep=0.5", key)
    assert effects("POST", "/orders", key) == 1  # type: ignore[operator]
    first = [r for r in responses if r.status_code == 201 and not replayed(r)]
    assert len(first) == 1
    for response in responses:
        if response.status_code == 409:
            assert_problem(response, 409, "A request is outstanding for this Idempotency-Key")
            assert int(response.headers["retry-after"]) >= 1
        else:
            assert response.status_code == 201
            assert response.content == first[0].content
            assert response is first[0] or replayed(response)
    later = client.post("/orders?sleep=0.5", content=b'{"amount": 10}',
                        headers={"Idempotency-Key": key, "Content-Type": "application/json"})
    assert later.status_code == 201 and replayed(later) and later.content == first[0].content
    assert effects("POST", "/orders", key) == 1  # type: ignore[operator]


def test_fifty_concurrent_posts_with_wait_all_get_the_response(client: httpx.Client, effects: object) -> None:
    key = new_key()
    responses = fifty(client, "/wait/orders?sleep=0.5", key)
    assert effects("POST", "/wait/orders", key) == 1  # type: ignore[operator]
    assert {r.status_code for r in responses} == {201}
    assert len({r.content for r in responses}) == 1
    assert sum(not replayed(r) for r in responses) == 1


@pytest.mark.parametrize(("value", "why"), [
    (None, "Idempotency-Key is missing"),
    ("", "Idempotency-Key is invalid"),
    ('""', "Idempotency-Key is invalid"),
    ("x" * 256, "Idempotency-Key is invalid"),
    ('"unterminated', "Idempotency-Key is invalid"),
    ("has space", "Idempotency-Key is invalid"),
    ('"a", "b"', "Idempotency-Key is invalid"),
])
def test_bad_keys_are_400(client: httpx.Client, value: str | None, why: str) -> None:
    headers = {} if value is None else {"Idempotency-Key": value}
    assert_problem(client.post("/orders", content=b"{}", headers=headers), 400, why)


def test_two_key_fields_are_400(client: httpx.Client) -> None:
    response = client.post("/orders", content=b"{}", headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")])
    assert_problem(response, 400, "Idempotency-Key is invalid")


def test_sf_string_and_bare_token_name_the_same_key(client: httpx.Client, effects: object) -> None:
    key = new_key()
    first = client.post("/orders", content=b"{}", headers={"Idempotency-Key": f'"{key}"'})
    again = client.post("/orders", content=b"{}", headers={"Idempotency-Key": key})
    assert first.status_code == 201 and not replayed(first)
    assert again.status_code == 201 and replayed(again) and again.content == first.content


def test_optional_and_excluded_routes(client: httpx.Client, effects: object) -> None:
    assert client.post("/optional/orders", content=b"{}").status_code == 201
    key = new_key()
    for _ in range(2):
        response = client.post("/excluded/orders", content=b"{}", headers={"Idempotency-Key": key})
        assert response.status_code == 201 and not replayed(response)
    assert effects("POST", "/excluded/orders", key) == 2  # type: ignore[operator]
    one = client.post("/optional/orders", content=b"{}", headers={"Idempotency-Key": key})
    two = client.post("/optional/orders", content=b"{}", headers={"Idempotency-Key": key})
    assert replayed(two) and two.content == one.content


def test_same_key_other_payload_is_422(client: httpx.Client, effects: object) -> None:
    key = new_key()
    assert client.post("/orders", content=b'{"amount": 1}', headers={"Idempotency-Key": key}).status_code == 201
    for other in ({"content": b'{"amount": 2}'}, {"content": b'{"amount": 1}', "params": {"x": "1"}}):
        response = client.post("/orders", headers={"Idempotency-Key": key}, **other)  # type: ignore[arg-type]
        assert_problem(response, 422, "Idempotency-Key is already used")
    assert effects("POST", "/orders", key) == 1  # type: ignore[operator]


def test_retry_while_running_is_409_with_retry_after(client: httpx.Client, effects: object) -> None:
    key = new_key()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.post, "/orders?sleep=1", content=b"{}", headers={"Idempotency-Key": key})
        time.sleep(0.4)
        retry = client.post("/orders?sleep=1", content=b"{}", headers={"Idempotency-Key": key})
        assert_problem(retry, 409, "A request is outstanding for this Idempotency-Key")
        assert 1 <= int(retry.headers["retry-after"]) <= 10
        assert first.result().status_code == 201


def test_a_5xx_lets_the_retry_run_again(client: httpx.Client, effects: object) -> None:
    key = new_key()
    assert client.post("/flaky", content=b"{}", headers={"Idempotency-Key": key}).status_code == 503
    second = client.post("/flaky", content=b"{}", headers={"Idempotency-Key": key})
    assert second.status_code == 201 and not replayed(second) and second.content == b"done on attempt 2"
    third = client.post("/flaky", content=b"{}", headers={"Idempotency-Key": key})
    assert third.status_code == 201 and replayed(third) and third.content == second.content
    assert effects("POST", "/flaky", key) == 2  # type: ignore[operator]


def comparable(response: httpx.Response) -> list[tuple[str, str]]:
    # vary: added by the session middleware outside the Idempotency-Key layer, when a session is touched
    skip = {"date", "server", "connection", "idempotent-replayed", "set-cookie", "transfer-encoding", "keep-alive",
            "vary"}
    return sorted((k.lower(), v) for k, v in response.headers.multi_items() if k.lower() not in skip)


@pytest.mark.parametrize("path", ["/orders", "/missing"])
def test_201_and_404_replayed_exactly(client: httpx.Client, effects: object, path: str) -> None:
    key = new_key()
    first = client.post(path, content=b'{"a": 1}', headers={"Idempotency-Key": key})
    again = client.post(path, content=b'{"a": 1}', headers={"Idempotency-Key": key})
    assert first.status_code == again.status_code == (201 if path == "/orders" else 404)
    assert again.content == first.content and replayed(again) and not replayed(first)
    assert comparable(again) == comparable(first)
    if path == "/orders":
        assert "theme=dark" in first.headers.get("set-cookie", "")
        assert "set-cookie" not in again.headers  # cookies are not replayed by default
        assert json.loads(first.content)["body"] == '{"a": 1}'  # the body reached the app intact
    assert effects("POST", path, key) == 1  # type: ignore[operator]


def test_two_principals_with_one_key_are_kept_apart(client: httpx.Client, effects: object) -> None:
    key = new_key()
    alice = client.post("/orders", content=b"{}", headers={"Idempotency-Key": key, "Authorization": "Bearer alice"})
    bob = client.post("/orders", content=b"{}", headers={"Idempotency-Key": key, "Authorization": "Bearer bob"})
    assert not replayed(alice) and not replayed(bob) and alice.content != bob.content
    again = client.post("/orders", content=b"{}", headers={"Idempotency-Key": key, "Authorization": "Bearer bob"})
    assert replayed(again) and again.content == bob.content


def test_get_passes_through(client: httpx.Client, effects: object) -> None:
    key = new_key()
    for _ in range(2):
        response = client.get("/orders", headers={"Idempotency-Key": key})
        assert response.status_code == 201 and not replayed(response)
    assert client.get("/orders").status_code == 201  # no key needed either
    assert effects("GET", "/orders", key) == 2  # type: ignore[operator]


@pytest.mark.parametrize("path", ["/ttl", "/short-ttl"])
def test_response_ttl_from_header_or_route_is_honoured(client: httpx.Client, effects: object, path: str) -> None:
    key = new_key()
    first = client.post(path, content=b"{}", headers={"Idempotency-Key": key})
    assert "idempotency-ttl" not in first.headers
    again = client.post(path, content=b"{}", headers={"Idempotency-Key": key})
    assert replayed(again) and "idempotency-ttl" not in again.headers
    time.sleep(0.7)  # the response was kept 0.5 s
    later = client.post(path, content=b"{}", headers={"Idempotency-Key": key})
    assert later.status_code == 201 and not replayed(later)
    assert effects("POST", path, key) == 2  # type: ignore[operator]


def test_large_body_is_stored_compressed_and_replayed_intact(client: httpx.Client, server: tuple[str, str],
                                                             redis_url: str) -> None:
    key = new_key()
    first = client.post("/big", content=b"{}", headers={"Idempotency-Key": key})
    again = client.post("/big", content=b"{}", headers={"Idempotency-Key": key})
    assert len(first.content) > 200_000 and again.content == first.content and replayed(again)
    r = redis.Redis.from_url(redis_url)
    stems = {KeyLayout.stem_of(name.decode()) for name in r.scan_iter(f"{server[1]}:{{http:*")}
    outcomes = [read_result(r, stem) for stem in stems]  # in either record format
    stored = [json.loads(unpack(o.value) or b"null") for o in outcomes if o is not None]
    r.close()
    assert any(v and v.get("z") == "deflate" and len(v["b"]) < 100_000 for v in stored)


def test_app_compressed_body_is_replayed_byte_for_byte(client: httpx.Client) -> None:
    key = new_key()
    bodies = []
    for _ in range(2):
        with client.stream("POST", "/gzip", content=b"{}", headers={"Idempotency-Key": key}) as response:
            assert response.headers["content-encoding"] == "gzip"
            bodies.append((replayed(response), b"".join(response.iter_raw())))
    assert bodies[0][0] is False and bodies[1][0] is True
    assert bodies[1][1] == bodies[0][1]
    assert json.loads(gzip.decompress(bodies[0][1]))["packed"] is True


def test_streaming_response_passes_through_and_is_replayed(client: httpx.Client, effects: object) -> None:
    # With no Content-Length, a WSGI server's stream is stored once the server asked past its last
    # chunk, just after the client has it all: the retry waits (/wait) rather than racing that.
    key = new_key()
    with client.stream("POST", "/wait/stream", content=b"{}", headers={"Idempotency-Key": key}) as response:
        assert "content-length" not in response.headers
        chunks = list(response.iter_bytes())
    body = b"".join(chunks)
    assert body.count(b"chunk") == 5
    again = client.post("/wait/stream", content=b"{}", headers={"Idempotency-Key": key})
    assert again.content == body and replayed(again)
    assert effects("POST", "/wait/stream", key) == 1  # type: ignore[operator]


def test_current_claim_is_set_inside_the_request(client: httpx.Client) -> None:
    doc = client.post("/orders", content=b"{}", headers={"Idempotency-Key": new_key()}).json()
    assert doc["claim"].startswith("http:") and doc["token"] >= 1
