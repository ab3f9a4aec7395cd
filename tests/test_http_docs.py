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
    assert set(examples()) == {"fastapi", "flask", "django-settings", "django-views", "end-to-end"}
    assert DOCS.read_text().count("```python") == len(examples())


@pytest.mark.asyncio
async def test_fastapi_example(docs_env: str, tmp_path: Path) -> None:
    module = load("fastapi", examples()["fastapi"], tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=module.app), base_url="http://api") as client:
        key = {"Idempotency-Key": f'"{uuid.uuid4()}"'}
        first = await client.post("/payments", json={"amount": 10}, headers=key)
        again = await client.post("/payments", json={"amount": 10}, headers=key)
        assert first.status_code == again.status_code == 201 and first.json()["token"] >= 1
        assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
        assert (await client.post("/payments", json={"amount": 11}, headers=key)).status_code == 422
        missing = await client.post("/payments", json={"amount": 10})
        assert missing.status_code == 400 and missing.json()["type"].endswith("#missing-key")
    await module.dedupe.aclose()


def test_flask_example(docs_env: str, tmp_path: Path) -> None:
    module = load("flask", examples()["flask"], tmp_path)
    client = module.app.test_client()
    key = {"Idempotency-Key": str(uuid.uuid4())}
    first = client.post("/payments", json={"amount": 10}, headers=key)
    body = first.data  # the test client streams: the response is stored once it was read
    again = client.post("/payments", json={"amount": 10}, headers=key)
    assert first.status_code == again.status_code == 201
    assert again.data == body and again.headers["Idempotent-Replayed"] == "true"
    assert client.post("/payments", json={"amount": 10}).status_code == 400
    module.dedupe.close()


DJANGO_RUNNER = '''
import json, os, sys, uuid
import django
from django.conf import settings

blocks = json.loads(sys.argv[1])
documented = {}
exec(blocks["django-settings"], documented)
views = type(sys)("docs_views")
exec(blocks["django-views"], views.__dict__)
urls = type(sys)("docs_urls")
from django.urls import path
urls.urlpatterns = [path("payments", views.create_payment)]
sys.modules["docs_views"], sys.modules["docs_urls"] = views, urls
settings.configure(
    SECRET_KEY="docs", ALLOWED_HOSTS=["*"], ROOT_URLCONF="docs_urls",
    INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django.contrib.sessions"],
    SESSION_ENGINE="django.contrib.sessions.backends.signed_cookies",
    MIDDLEWARE=documented["MIDDLEWARE"], DEDUPE_HTTP=documented["DEDUPE_HTTP"],
    DEDUPE_REDIS_URL=os.environ["DEDUPE_REDIS_URL"], DEDUPE_NAMESPACE=os.environ["DEDUPE_NAMESPACE"])
django.setup()
from django.test import Client

client = Client()
key = str(uuid.uuid4())
answers = [client.post("/payments", data=json.dumps({"amount": 10}), content_type="application/json",
                       HTTP_IDEMPOTENCY_KEY=key) for _ in range(2)]
missing = client.post("/payments", data="{}", content_type="application/json")
print(json.dumps({"status": [a.status_code for a in answers], "same": answers[0].content == answers[1].content,
                  "replayed": [a.headers.get("Idempotent-Replayed") for a in answers],
                  "token": json.loads(answers[0].content)["token"], "missing": missing.status_code}))
'''


def test_django_example(docs_env: str) -> None:
    blocks = examples()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DOCS.parent.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(DJANGO_RUNNER), json.dumps(blocks)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"status": [201, 201], "same": True, "replayed": [None, "true"], "token": result["token"],
                      "missing": 400}
    assert result["token"] >= 1
