"""How results are stored: JSON by default, never pickle.

Whoever can write to Redis must not get code execution in our workers, so data read back is only
ever parsed as JSON. Values go through orjson; pydantic models are stored as their JSON dump and
come back as plain dicts (re-validate them if you need the model). Dataclasses, ``datetime``,
``UUID`` and numpy-free builtins are handled by orjson. NaN and infinity are refused like any other
value JSON cannot hold (orjson would write them as ``null``, and a duplicate would get ``None``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import orjson

from .._errors import ResultNotSerializable

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


def _non_finite(value: Any) -> float | None:
    """The first NaN or infinity inside ``value`` (as orjson walks it), else ``None``."""
    if isinstance(value, float):
        return None if math.isfinite(value) else value
    if isinstance(value, dict):
        for key, item in value.items():
            found = _non_finite(key) if isinstance(key, float) else None
            if found is None:
                found = _non_finite(item)
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple, set, frozenset)):
        items: Any = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, field.name) for field in dataclasses.fields(value)]
    elif callable(getattr(value, "model_dump", None)) and not isinstance(value, type):
        items = [value.model_dump()]  # pydantic writes NaN as null in JSON mode: look before it does
    else:
        return None
    for item in items:
        found = _non_finite(item)
        if found is not None:
            return found
    return None


class JsonSerializer:
    """The default :class:`Serializer`: compact JSON via orjson. Raises
    :class:`ResultNotSerializable` for a value JSON cannot hold, NaN and infinity included."""

    def dumps(self, value: Any) -> bytes:
        try:
            data = orjson.dumps(value, default=_default, option=orjson.OPT_NON_STR_KEYS)
        except (TypeError, orjson.JSONEncodeError) as exc:
            raise ResultNotSerializable(f"result cannot be stored as JSON: {exc}") from exc
        # orjson writes NaN and infinity as null, so only output holding a null needs the look
        if b"null" in data:
            found = _non_finite(value)
            if found is not None:
                raise ResultNotSerializable(f"result cannot be stored as JSON: it holds {found!r}, "
                                            "and JSON has no NaN or infinity")
        return data

    def loads(self, data: bytes | str) -> Any:
        return orjson.loads(data)
