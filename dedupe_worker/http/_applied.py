"""Seeing an :class:`~dedupe_worker.AlreadyApplied` that a WSGI framework caught.

Flask turns an exception in a view into its 500 page before the WSGI middleware sees it. It
reports the exception first, through its ``got_request_exception`` signal: the middleware listens
(once per process, when Flask is loaded) and notes an ``AlreadyApplied`` in :data:`RAISED`,
which it sets for each request it runs, then answers from the committed result instead of the
500 (the server has not sent the 500 yet, so PEP 3333 lets the headers be replaced). A framework
that lets the exception through needs none of this; Django's middleware uses its own
``process_exception`` hook.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar
from typing import Any

from .._errors import AlreadyApplied

__all__ = ["RAISED", "notice_exceptions"]

#: The ``AlreadyApplied`` a framework reported during the current request, else ``None``.
RAISED: ContextVar[BaseException | None] = ContextVar("dedupe_http_already_applied", default=None)
_listening: list[Any] = []


def _note(sender: Any, exception: BaseException | None = None, **_: Any) -> None:
    if isinstance(exception, AlreadyApplied) and RAISED.get() is None:
        RAISED.set(exception)


def notice_exceptions() -> None:
    """Listen to Flask's ``got_request_exception`` when Flask is loaded (once per process)."""
    flask = sys.modules.get("flask")
    if flask is None or _listening:
        return
    signal = getattr(flask, "got_request_exception", None)
    if signal is not None:
        signal.connect(_note, weak=False)
        _listening.append(signal)
