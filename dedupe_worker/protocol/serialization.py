"""How results are stored: JSON by default, never pickle.

Whoever can write to Redis must not get code execution in our workers, so data read back is only
ever parsed as JSON. Values go through orjson; pydantic models are stored as their JSON dump and
come back as plain dicts (re-validate them if you need the model). Dataclasses, ``datetime``,
``UUID`` and numpy-free builtins are handled by orjson.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from ..errors import ResultNotSerializable

__all__ = ["JsonSerializer", "Serializer"]


class Serializer(Protocol):
    """Turns handler results into bytes for Redis and back."""

    def dumps(self, value: Any) -> bytes: ...

    def loads(self, data: bytes | str) -> Any: ...


def _default(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)  # pydantic v2 models
    if callable(dump):
        return dump(mode="json")
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if isinstance(value, bytes):
        raise TypeError("bytes are not JSON; return str or base64 text")
    raise TypeError(f"type {type(value).__name__} is not JSON serialisable")


class JsonSerializer:
    """The default :class:`Serializer`: compact JSON via orjson."""

    def dumps(self, value: Any) -> bytes:
        try:
            return orjson.dumps(value, default=_default, option=orjson.OPT_NON_STR_KEYS)
        except (TypeError, orjson.JSONEncodeError) as exc:
            raise ResultNotSerializable(f"result cannot be stored as JSON: {exc}") from exc

    def loads(self, data: bytes | str) -> Any:
        return orjson.loads(data)
