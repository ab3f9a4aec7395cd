"""The Idempotency-Key layer at the trust boundary, behind real servers (FastAPI on uvicorn with
two workers, Flask with Flask-Login on gunicorn, Django on gunicorn) on real Redis: whose key is
whose, bounded requests, whatever the app answers, records it cannot read, a short Retry-After."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import redis

from dedupe_worker import Deduplicator
from dedupe_worker._protocol.fingerprint import content_hash
from dedupe_worker._protocol.layout import KeyLayout

from .http_servers import PIDS, SERVERS, serve

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request: pytest.FixtureRequest, redis_url: str) -> Iterator[tuple[str, str, str]]:
    namespace = f"t-trust-{uuid.uuid4().hex[:10]}"
    with serve(request.param, redis_url, namespace) as base:
        yield base, namespace, request.param


def client(base: str, **headers: str) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=30.0, headers=headers)


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


def post(c: httpx.Client, key: str, path: str = "/orders", body: bytes = b'{"amount": 10}') -> httpx.Response:
    return c.post(path, content=body, headers={"Idempotency-Key": key, "Content-Type": "application/json"})


def runs(redis_url: str, namespace: str, path: str, key: str, who: str) -> int:
    r = redis.Redis.from_url(redis_url)
    try:
        return int(r.get(f"{namespace}:runs:{path}:{key}:{who}") or 0)
    finally:
        r.close()


def pair_runs_apart(server: tuple[str, str, str], redis_url: str, one: httpx.Client, two: httpx.Client,
                    names: tuple[str, str]) -> None:
    """Both clients send one key: each runs its own request, never gets the other's response,
    and its own retry is its own replay."""
    key = str(uuid.uuid4())
    first, second = post(one, key), post(two, key)
    assert first.status_code == second.status_code == 201, (first.text, second.text)
    assert not replayed(first) and not replayed(second)
    assert first.json()["who"] == names[0] and second.json()["who"] == names[1]
    assert runs(redis_url, server[1], "/orders", key, names[0]) == 1
    assert runs(redis_url, server[1], "/orders", key, names[1]) == 1
    again = post(two, key)
    assert replayed(again) and again.content == second.content


def test_two_cookie_session_users_never_see_each_other(server: tuple[str, str, str], redis_url: str) -> None:
    with client(server[0]) as alice, client(server[0]) as bob:
        assert alice.get("/login/alice").status_code == bob.get("/login/bob").status_code == 200
        pair_runs_apart(server, redis_url, alice, bob, ("user:alice", "user:bob"))


def test_two_anonymous_visitors_never_see_each_other(server: tuple[str, str, str], redis_url: str) -> None:
    with client(server[0]) as one, client(server[0]) as two:
        visitors = one.get("/visit").text, two.get("/visit").text
        pair_runs_apart(server, redis_url, one, two, (f"visitor:{visitors[0]}", f"visitor:{visitors[1]}"))


def test_two_users_behind_one_gateway_token(server: tuple[str, str, str], redis_url: str) -> None:
    gateway = {"Authorization": "Bearer gateway-shared"}
    with client(server[0], **gateway) as alice, client(server[0], **gateway) as bob:
        alice.get("/login/alice")
        bob.get("/login/bob")
        pair_runs_apart(server, redis_url, alice, bob, ("user:alice", "user:bob"))


def test_nobody_behind_the_gateway_is_refused_not_shared(server: tuple[str, str, str], redis_url: str) -> None:
    key = str(uuid.uuid4())
    with client(server[0], Authorization="Bearer gateway-shared") as c:
        refused = post(c, key)
        assert refused.status_code == 403 and refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"].endswith("#scope-refused")
    assert runs(redis_url, server[1], "/orders", key, "None") == 0


def test_retry_after_a_bearer_token_refresh_is_replayed(server: tuple[str, str, str], redis_url: str) -> None:
    key = str(uuid.uuid4())
    with client(server[0], Authorization="Bearer carol-token-1") as before:
        first = post(before, key)
    with client(server[0], Authorization="Bearer carol-token-2") as after:
        retry = post(after, key)
    assert first.status_code == retry.status_code == 201
    assert replayed(retry) and retry.content == first.content
    assert runs(redis_url, server[1], "/orders", key, "user:carol") == 1


def server_rss(base: str) -> int:
    root = psutil.Process(PIDS[base])
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def send_huge(base: str, total: int, chunked: bool) -> bytes:
    """POST ``total`` bytes (never built whole: one 1 MiB block sent again and again), stopping
    as soon as the server answers or closes; the server's reply."""
    host, port = base.removeprefix("http://").split(":")
    block = b"x" * (1024 * 1024)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    head = (f"POST /orders HTTP/1.1\r\nHost: {host}\r\nIdempotency-Key: {uuid.uuid4()}\r\n"
            f"Authorization: Bearer tester\r\nContent-Type: application/octet-stream\r\n{framing}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        sent = 0
        try:
            while sent < total:
                sock.settimeout(0.0)
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break  # answered already
                except BlockingIOError:
                    pass
                sock.settimeout(30)
                sock.sendall(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
                sent += len(block)
            if chunked and sent >= total:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(30)
        reply = b""
        try:
            while b"\r\n\r\n" not in reply:
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
        except ConnectionResetError:
            pass
        return reply


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_256_mb_request_is_413_without_the_memory(server: tuple[str, str, str], chunked: bool) -> None:
    if server[2].startswith("django") and chunked:
        pytest.skip("gunicorn hands Django a chunked body without CONTENT_LENGTH: Django reads it as empty")
    before = server_rss(server[0])
    reply = send_huge(server[0], 256 * 1024 * 1024, chunked)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    growth = server_rss(server[0]) - before
    assert growth < 32 * 1024 * 1024, growth


def test_3_mb_django_multipart_upload_goes_through(server: tuple[str, str, str]) -> None:
    if not server[2].startswith("django"):
        pytest.skip("the upload the Django app parses (request.FILES)")
    payload = bytes(range(256)) * (3 * 1024 * 1024 // 256)
    key = str(uuid.uuid4())
    with client(server[0], Authorization="Bearer tester") as c:
        upload = c.build_request("POST", "/upload", files={"file": ("scan.bin", payload)},
                                 headers={"Idempotency-Key": key})
        body = upload.read()  # one multipart body (one boundary), sent twice as a retry sends it
        answers = [c.post("/upload", content=body, headers={"Idempotency-Key": key,
                                                            "Content-Type": upload.headers["content-type"]})
                   for _ in range(2)]
    assert [a.status_code for a in answers] == [201, 201], answers[0].text[:300]
    stored = answers[0].json()
    assert stored["size"] == len(payload) and stored["sha256"] == content_hash(payload, 64)
    assert replayed(answers[1]) and answers[1].content == answers[0].content


@pytest.mark.parametrize("value", ["inf", "1e308", "400000000", "1" * 40, "-5", "nan", "soon", "0.5"])
def test_any_idempotency_ttl_leaves_the_response_intact(server: tuple[str, str, str], redis_url: str,
                                                        value: str) -> None:
    key = str(uuid.uuid4())
    with client(server[0], Authorization="Bearer tester") as c:
        first = c.post("/ttl-value", params={"v": value}, content=b"{}", headers={"Idempotency-Key": key})
        again = c.post("/ttl-value", params={"v": value}, content=b"{}", headers={"Idempotency-Key": key})
    assert first.status_code == 201 and first.text == "order 1" and "idempotency-ttl" not in first.headers
    assert replayed(again) and again.content == first.content
    assert runs(redis_url, server[1], "/ttl-value", key, "user:tester") == 1


def test_binary_body_with_latin1_header_is_replayed(server: tuple[str, str, str]) -> None:
    key = str(uuid.uuid4())
    with client(server[0], Authorization="Bearer tester") as c:
        first, again = post(c, key, "/binary"), post(c, key, "/binary")
    assert first.status_code == again.status_code == 201 and len(first.content) == 14_200
    assert replayed(again) and again.content == first.content
    assert again.headers["content-disposition"] == first.headers["content-disposition"]


def test_concurrent_retry_gets_a_short_retry_after(server: tuple[str, str, str]) -> None:
    key = str(uuid.uuid4())
    with client(server[0], Authorization="Bearer tester") as c, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, c, key, "/orders?sleep=2")
        time.sleep(0.5)
        retry = post(c, key, "/orders?sleep=2")
        assert retry.status_code == 409 and 1 <= int(retry.headers["retry-after"]) <= 2  # lease: 10 s
        assert first.result().status_code == 201


def stored_key(namespace: str, path: str, key: str, who: str) -> tuple[Deduplicator, str]:
    """A client on the server's namespace and the stored key of ``key`` sent by ``who`` to ``path``."""
    return (Deduplicator.from_url(REDIS_URL_OF[namespace], namespace=namespace),
            "http:" + content_hash("\n".join(("POST", path, who, key)), 40))


REDIS_URL_OF: dict[str, str] = {}


@pytest.mark.parametrize("damage", ["truncated value", "foreign value", "short record", "list", "hash",
                                    "bad base64"])
def test_unreadable_record_lets_the_request_run(server: tuple[str, str, str], redis_url: str, damage: str) -> None:
    REDIS_URL_OF[server[1]] = redis_url
    key = str(uuid.uuid4())
    dedupe, stored = stored_key(server[1], "/orders", key, "user:tester")
    stem = dedupe.request(stored).stem
    r = redis.Redis.from_url(redis_url)
    try:
        with client(server[0], Authorization="Bearer tester") as c:
            assert post(c, key).status_code == 201
            records = KeyLayout.records(stem)
            if damage == "truncated value":  # in whichever record format holds it
                if r.exists(records[2]):
                    r.hset(records[2], "v", r.hget(records[2], "v")[:-12])  # type: ignore[index]
                else:
                    r.set(stem, r.get(stem)[:-12])  # type: ignore[index]
            elif damage in ("foreign value", "bad base64"):
                r.delete(*records)
                claim = dedupe.begin(stored)
                value = {"hello": "world"} if damage == "foreign value" else {"v": 1, "s": 201, "h": [], "b": "%%%"}
                dedupe.complete(claim, value)
            elif damage == "short record":
                r.delete(*records)
                r.set(stem, b"c\x00\x01")
            else:
                r.delete(*records)
                if damage == "list":
                    r.rpush(stem, "not ours")
                else:
                    r.hset(stem, "not", "ours")
            after = post(c, key)
            assert after.status_code == 201 and not replayed(after), after.text
            again = post(c, key)
            assert replayed(again) and again.content == after.content
        assert runs(redis_url, server[1], "/orders", key, "user:tester") == 2
    finally:
        r.close()
        dedupe.close()


def test_already_applied_out_of_the_endpoint_is_answered_and_stored(server: tuple[str, str, str],
                                                                    redis_url: str) -> None:
    key = str(uuid.uuid4())
    with client(server[0], Authorization="Bearer tester") as c:
        answers = [post(c, key, "/applied") for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200], answers[0].text
    assert all(a.json() == {"paid": 7, "run": 1} and replayed(a) for a in answers)
    assert runs(redis_url, server[1], "/applied", key, "user:tester") == 1  # stored: never released, never re-run
