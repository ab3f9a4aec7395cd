"""Django support (extra ``django``): :func:`atomic`, the ORM's transaction with the key's
outcome committed in it (see :mod:`dedupe_worker.django.atomic`)."""

from __future__ import annotations

from .atomic import atomic

__all__ = ["atomic"]
