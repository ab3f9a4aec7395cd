"""Every example of docs/http.md runs here as written (the end-to-end one in test_http_e2e.py):
FastAPI in-process through httpx's ASGI transport, Flask through its test client, Django through
its test client in a process of its own (Django's settings are global)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs" / "http.md"


def examples() -> dict[str, str]:
    """The python blocks of docs/http.md marked ``<!-- docs-test: run by tests/test_x.py (NAME) -->``
    (tests/test_docs.py checks that the file named runs them)."""
    marked = r"<!-- docs-test: run by tests/test_\w+\.py \(([\w-]+)\) -->\n```python\n(.*?)```"
    return dict(re.findall(marked, DOCS.read_text(), re.S))


def load(name: str, code: str, tmp_path: Path) -> ModuleType:
    path = tmp_path / f"{name.replace('-', '_')}_{uuid.uuid4().hex[:8]}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def docs_env(redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("DEDUPE_REDIS_URL", redis_url)
    monkeypatch.setenv("DEDUPE_NAMESPACE", namespace)
    yield namespace


def test_every_example_is_named() -> None:
    assert set(examples()) == {"fastapi-sessions", "fastapi-oauth", "flask", "django-settings", "django-views",
                               "end-to-end"}
    assert DOCS.read_text().count("```python") == len(examples())


def replayed(response: Any) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


@pytest.mark.asyncio
async def test_fastapi_sessions_example(docs_env: str, tmp_path: Path) -> None:
    module = load("fastapi_sessions", examples()["fastapi-sessions"], tmp_path)
    transport = httpx.ASGITransport(app=module.app)
    key = {"Idempotency-Key": f'"{uuid.uuid4()}"'}
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as alice, \
            httpx.AsyncClient(transport=transport, base_url="http://api") as bob, \
            httpx.AsyncClient(transport=transport, base_url="http://api") as stranger:
        assert (await alice.post("/login", json={"user": "alice"})).status_code == 200
        assert (await bob.post("/login", json={"user": "bob"})).status_code == 200
        first = await alice.post("/payments", json={"amount": 10}, headers=key)
        theirs = await bob.post("/payments", json={"amount": 10}, headers=key)  # the same key, another user
        again = await alice.post("/payments", json={"amount": 10}, headers=key)
        assert first.status_code == theirs.status_code == again.status_code == 201
        assert first.json()["user"] == "alice" and theirs.json()["user"] == "bob" and not replayed(theirs)
        assert again.content == first.content and replayed(again)
        assert (await alice.post("/payments", json={"amount": 11}, headers=key)).status_code == 422
        missing = await alice.post("/payments", json={"amount": 10})
        assert missing.status_code == 400 and missing.json()["type"].endswith("#missing-key")
        refused = await stranger.post("/payments", json={"amount": 10}, headers=key)  # not signed in
        assert refused.status_code == 403 and refused.json()["type"].endswith("#scope-refused")
    await module.dedupe.aclose()


@pytest.mark.asyncio
async def test_fastapi_oauth_example(docs_env: str, tmp_path: Path) -> None:
    module = load("fastapi_oauth", examples()["fastapi-oauth"], tmp_path)
    issued = {name: module.tokens.dumps({"sub": name.split("-")[0], "jti": name})
              for name in ("alice-1", "alice-2", "bob-1")}
    key = str(uuid.uuid4())

    async def send(token: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=module.app), base_url="http://api") as c:
            return await c.post("/transfers", json={"to": "carol", "amount": 5},
                                headers={"Idempotency-Key": key, "Authorization": f"Bearer {token}"})

    first = await send(issued["alice-1"])
    refreshed = await send(issued["alice-2"])  # the retry after a token refresh: the same principal
    bob = await send(issued["bob-1"])
    assert first.status_code == refreshed.status_code == bob.status_code == 201
    assert replayed(refreshed) and refreshed.content == first.content and not replayed(bob)
    assert (await send("forged")).status_code == 403
    await module.app.user_middleware[0].kwargs["dedupe"].aclose()


def test_flask_example(docs_env: str, tmp_path: Path) -> None:
    module = load("flask", examples()["flask"], tmp_path)
    alice, bob, stranger = (module.app.test_client() for _ in range(3))
    alice.post("/login", json={"user": "alice"})
    bob.post("/login", json={"user": "bob"})
    key = {"Idempotency-Key": str(uuid.uuid4())}
    first = alice.post("/payments", json={"amount": 10}, headers=key)
    body = first.data  # the test client streams: the response is stored once it was read
    theirs = bob.post("/payments", json={"amount": 10}, headers=key)
    again = alice.post("/payments", json={"amount": 10}, headers=key)
    assert first.status_code == theirs.status_code == again.status_code == 201
    assert first.json["user"] == "alice" and theirs.json["user"] == "bob"
    assert "Idempotent-Replayed" not in theirs.headers
    assert again.data == body and again.headers["Idempotent-Replayed"] == "true"
    assert alice.post("/payments", json={"amount": 10}).status_code == 400
    assert stranger.post("/payments", json={"amount": 10}, headers=key).status_code == 403
    module.dedupe.close()


DJANGO_RUNNER = '''
import json, os, sys, uuid
from pathlib import Path
import django
from django.conf import settings

blocks = json.loads(sys.argv[1])
# the settings.py `django-admin startproject` writes, with the documented lines at its end
template = Path(django.__file__).parent / "conf" / "project_template" / "project_name" / "settings.py-tpl"
written = template.read_text()
for name, value in (("project_name", "docs_site"), ("secret_key", "docs"), ("django_version", django.__version__),
                    ("docs_version", "dev")):
    written = written.replace("{{ %s }}" % name, value)
documented = {"__file__": "/nowhere/docs_site/settings.py"}
exec(written + "\\n" + blocks["django-settings"], documented)
views = type(sys)("docs_views")
exec(blocks["django-views"], views.__dict__)
urls = type(sys)("docs_urls")
from django.urls import path
urls.urlpatterns = [path("payments", views.create_payment)]
sys.modules["docs_views"], sys.modules["docs_urls"] = views, urls
settings.configure(**{
    **{name: value for name, value in documented.items() if name.isupper()},
    "ALLOWED_HOSTS": ["*"], "ROOT_URLCONF": "docs_urls",
    "DATABASES": {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    "DEDUPE_REDIS_URL": os.environ["DEDUPE_REDIS_URL"], "DEDUPE_NAMESPACE": os.environ["DEDUPE_NAMESPACE"]})
django.setup()
from django.core import checks
problems = [str(m) for m in checks.run_checks() if m.level >= checks.ERROR]  # admin.E409 and the like
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client

call_command("migrate", verbosity=0)
clients = {}
for name in ("alice", "bob"):
    clients[name] = Client()
    clients[name].force_login(User.objects.create_user(name))
key = str(uuid.uuid4())

def pay(client, **extra):
    return client.post("/payments", data=json.dumps({"amount": 10}), content_type="application/json", **extra)

answers = [pay(clients["alice"], HTTP_IDEMPOTENCY_KEY=key) for _ in range(2)]
bob = pay(clients["bob"], HTTP_IDEMPOTENCY_KEY=key)
print(json.dumps({"status": [a.status_code for a in answers], "same": answers[0].content == answers[1].content,
                  "replayed": [a.headers.get("Idempotent-Replayed") for a in answers],
                  "token": json.loads(answers[0].content)["token"], "missing": pay(clients["alice"]).status_code,
                  "users": [json.loads(answers[0].content)["user"], json.loads(bob.content)["user"]],
                  "anonymous": pay(Client(), HTTP_IDEMPOTENCY_KEY=key).status_code,
                  "checks": problems, "middleware": settings.MIDDLEWARE}))
'''


def test_django_example(docs_env: str) -> None:
    blocks = examples()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DOCS.parent.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(DJANGO_RUNNER), json.dumps(blocks)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    middleware = result.pop("middleware")
    assert result == {"status": [201, 201], "same": True, "replayed": [None, "true"], "token": result["token"],
                      "missing": 400, "users": ["alice", "bob"], "anonymous": 403, "checks": []}
    assert middleware[middleware.index("django.contrib.auth.middleware.AuthenticationMiddleware") + 1] \
        == "dedupe_worker.django.IdempotencyMiddleware" and len(middleware) == 8  # startproject's 7, and ours
    assert result["token"] >= 1
