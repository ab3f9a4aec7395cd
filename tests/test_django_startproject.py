"""The Django block of docs/usage.md (marked ``run by tests/test_django_startproject.py
(startproject)``), pasted at the end of the ``settings.py`` of a real ``django-admin startproject``
project: ``manage.py check`` passes, and the middleware answers requests of that project against
a real Redis. Pasting a new ``MIDDLEWARE`` list over startproject's fails the checks (admin.E409):
the docs say so, and this shows it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "usage.md"

#: Run with ``manage.py shell``: two POSTs with one Idempotency-Key, one without (the project's
#: only URLs are the admin's: its login page answers a wrong login with the form again, a 200).
REQUESTS = """
import json, uuid
from django.test import Client
client = Client(HTTP_HOST="localhost")
key = str(uuid.uuid4())
answers = [client.post("/admin/login/", {"username": "x"}, HTTP_IDEMPOTENCY_KEY=key) for _ in range(2)]
missing = client.post("/admin/login/", {"username": "x"})
print(json.dumps({"status": [a.status_code for a in answers], "same": answers[0].content == answers[1].content,
                  "replayed": [a.headers.get("Idempotent-Replayed") for a in answers],
                  "missing": missing.status_code}))
"""


def block(name: str) -> str:
    marker = f"<!-- docs-test: run by tests/test_django_startproject.py ({name}) -->\n```python\n"
    found = re.search(re.escape(marker) + r"(.*?)```", DOC.read_text(), flags=re.S)
    assert found, f"docs/usage.md has no block {name!r}"
    return found.group(1)


def startproject(tmp_path: Path, settings_tail: str) -> tuple[Path, dict[str, str]]:
    """A fresh ``django-admin startproject shop`` with ``settings_tail`` appended to its settings."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    django_admin = Path(sys.executable).parent / "django-admin"
    subprocess.run([str(django_admin), "startproject", "shop", str(tmp_path)], check=True, env=env, timeout=60)
    settings = tmp_path / "shop" / "settings.py"
    settings.write_text(settings.read_text() + "\n" + settings_tail)
    return tmp_path / "manage.py", env


def manage(project: tuple[Path, dict[str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    script, env = project
    return subprocess.run([sys.executable, str(script), *args], cwd=script.parent, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_documented_middleware_passes_the_checks_of_a_startproject(
        tmp_path: Path, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEDUPE_REDIS_URL", redis_url)
    snippet = block("startproject")
    assert 'DEDUPE_NAMESPACE = "shop-api"' in snippet
    project = startproject(tmp_path, snippet.replace('"shop-api"', f'"{namespace}"'))
    checked = manage(project, "check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "no issues" in checked.stdout
    middleware = manage(project, "shell", "-c", "from django.conf import settings; print(settings.MIDDLEWARE)")
    listed = middleware.stdout
    assert listed.index("AuthenticationMiddleware") < listed.index("dedupe_worker.django.IdempotencyMiddleware")
    assert "MessageMiddleware" in listed and "SessionMiddleware" in listed  # startproject's kept

    answered = manage(project, "shell", "-c", REQUESTS)
    assert answered.returncode == 0, answered.stderr
    result = json.loads(answered.stdout.strip().splitlines()[-1])
    assert result == {"status": [200, 200], "same": True, "replayed": [None, "true"], "missing": 400}


def test_a_list_pasted_over_startprojects_fails_the_checks(tmp_path: Path) -> None:
    """Why the docs insert into the list: a list replacing it (sessions, authentication and ours,
    as a reader would write it) drops the middleware the admin needs."""
    replaced = ('MIDDLEWARE = [\n    "django.contrib.sessions.middleware.SessionMiddleware",\n'
                '    "django.contrib.auth.middleware.AuthenticationMiddleware",\n'
                '    "dedupe_worker.django.IdempotencyMiddleware",\n]\n')
    checked = manage(startproject(tmp_path, replaced), "check")
    assert checked.returncode != 0
    assert "admin.E409" in checked.stderr + checked.stdout
