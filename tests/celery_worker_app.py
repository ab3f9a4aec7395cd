"""The app a ``celery worker`` subprocess runs: ``make_app`` with the test's settings from the
environment (see ``celery_fixtures.WorkerProcess``)."""

from __future__ import annotations

import json
import os

from .celery_fixtures import CONFIG_ENV, make_app

app = make_app(**json.loads(os.environ[CONFIG_ENV]))
