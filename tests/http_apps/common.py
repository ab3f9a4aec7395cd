"""The endpoints every test server serves (FastAPI on uvicorn, Flask and Django on gunicorn), as
one framework-free handler, so the three middleware are tested on the same behaviour.

Each call counts its side effect in Redis under ``<namespace>:effects:<method>:<path>:<key>:<auth>``.
Configured by ``HTTP_TEST_REDIS_URL`` and ``HTTP_TEST_NAMESPACE``.

Whom a key belongs to (the apps' ``scope=``) is :func:`principal`, fed by each framework's own
cookie session: a signed-in user, else a bearer token's subject (as an OAuth resource server
reads it: a refreshed token names the same user), else an anonymous visitor's session; the
gateway's shared token names nobody.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs

import redis

from dedupe_worker import AlreadyApplied, current_claim
from dedupe_worker.http import RequestInfo

REDIS_URL = os.environ.get("HTTP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
NAMESPACE = os.environ.get("HTTP_TEST_NAMESPACE", "http-test")
effects = redis.Redis.from_url(REDIS_URL)


#: The token a gateway in front of the app adds to every request it forwards: not a user.
GATEWAY_TOKEN = "gateway-shared"


def principal(user: str | None, visitor: str | None, authorization: str | None) -> str | None:
    """The caller: the session's user, else the bearer token's subject (``<user>`` or
    ``<user>-<anything>``, the gateway's token excepted), else the anonymous visitor's session."""
    if user:
        return f"user:{user}"
    token = (authorization or "").removeprefix("Bearer ").strip()
    if token and token != GATEWAY_TOKEN:
        return f"user:{token.split('-', 1)[0]}"
    return f"visitor:{visitor}" if visitor else None


def session_reply(path: str, session: Any) -> tuple[int, bytes] | None:
    """``/login?user=NAME`` and ``/visit`` (GET: no Idempotency-Key layer): put a user or an
    anonymous visitor id in the framework's ``session`` (a dict-like); else ``None``."""
    if path == "/visit":
        session["visitor"] = os.urandom(8).hex()
        return 200, session["visitor"].encode()
    if path.startswith("/login/"):
        session["user"] = path.removeprefix("/login/")
        return 200, session["user"].encode()
    return None


def required(request: RequestInfo) -> bool | None:
    if request.path.startswith("/excluded"):
        return None
    return not request.path.startswith("/optional")


def wait(request: RequestInfo) -> float:
    return 5.0 if request.path.startswith("/wait") else 0.0


def ttl(request: RequestInfo) -> float | None:
    return 0.5 if request.path.endswith("/short-ttl") else None


#: The middleware options of every test app (``DEDUPE_HTTP`` for Django).
OPTIONS: dict[str, Any] = {"required": required, "wait": wait, "ttl": ttl, "compress_above": 1024,
                           "max_request_bytes": 1024 * 1024, "docs_url": "https://api.example.com/docs/idempotency"}

Reply = tuple[int, list[tuple[str, str]], "bytes | Iterator[bytes]"]


def handle(method: str, path: str, query: str, headers: dict[str, str], body: bytes, who: str | None = None) -> Reply:
    """The app: what it does and answers for each path (prefixes ``/wait``, ``/optional`` and
    ``/excluded`` select the middleware's options and are otherwise ignored); ``who`` is the
    caller as :func:`principal` names it (also counted under ``<namespace>:runs:<path>:<key>:<who>``)."""
    count = effects.incr(f"{NAMESPACE}:effects:{method}:{path}:{headers.get('idempotency-key', '')}:"
                         f"{headers.get('authorization', '')}")
    effects.incr(f"{NAMESPACE}:runs:{path}:{headers.get('idempotency-key', '')}:{who}")
    sleep = float(parse_qs(query).get("sleep", ["0"])[0])
    if sleep:
        time.sleep(sleep)
    route = path
    for prefix in ("/wait", "/optional", "/excluded"):
        route = route.removeprefix(prefix)
    claim = current_claim()
    if route == "/health":
        return 200, [("content-type", "text/plain")], b"ok"
    if route in ("/orders", "/ttl", "/short-ttl"):
        extra = [("Idempotency-TTL", "0.5")] if route == "/ttl" else []
        doc = {"order": count, "who": who, "pid": os.getpid(), "time": time.time(),
               "body": body.decode("utf-8", "replace"),
               "claim": claim.key if claim else None, "token": claim.token if claim else None}
        return 201, [("content-type", "application/json"), ("x-order", str(count)),
                     ("set-cookie", "theme=dark; Path=/"), *extra], json.dumps(doc).encode()
    if route == "/ttl-value":  # the app's Idempotency-TTL header, whatever it holds
        value = parse_qs(query).get("v", [""])[0]
        return 201, [("content-type", "text/plain"), ("Idempotency-TTL", value)], f"order {count}".encode()
    if route == "/binary":  # every byte value, and a header only latin-1 can carry
        blob = (bytes(range(256)) * 56)[:14_200]
        return 201, [("content-type", "application/octet-stream"), ("x-order", str(count)),
                     ("content-disposition", "attachment; filename=\"r\u00e9sum\u00e9.bin\"")], blob
    if route == "/applied":  # what atomic() raises when an earlier run of the key committed
        raise AlreadyApplied(claim.key if claim else "", {"paid": 7, "run": count}, 3)
    if route == "/upload":
        return 201, [("content-type", "application/json")], body
    if route == "/missing":
        missing = {"detail": f"no such thing {time.time()}"}
        return 404, [("content-type", "application/json")], json.dumps(missing).encode()
    if route == "/flaky":
        if count == 1:
            return 503, [("content-type", "text/plain")], b"try again"
        return 201, [("content-type", "text/plain")], f"done on attempt {count}".encode()
    if route == "/big":
        text = "".join(f"line {i} of a long report at {time.time()}\n" for i in range(8000)).encode()
        return 200, [("content-type", "text/plain")], text
    if route == "/gzip":
        raw = json.dumps({"packed": True, "at": time.time(), "filler": "x" * 5000}).encode()
        return 200, [("content-type", "application/json"), ("content-encoding", "gzip")], gzip.compress(raw)
    if route == "/stream":
        stamp = time.time()

        def chunks() -> Iterator[bytes]:
            for i in range(5):
                time.sleep(0.01)
                yield f"chunk {i} of {stamp}\n".encode()

        return 200, [("content-type", "text/plain")], chunks()
    return 404, [("content-type", "text/plain")], b"unknown route"
