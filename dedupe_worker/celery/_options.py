"""Where an :class:`~dedupe_worker.celery.IdempotentTask` gets its settings, and its key.

Each setting is looked up in order: the task's own class attribute (``@app.task(dedupe_lease=5)``),
the Celery app's configuration (``app.conf.dedupe_lease``), then the ``DEDUPE_*`` environment
variables read by :class:`~dedupe_worker.DedupeSettings` (``DEDUPE_LEASE``). ``None`` at one level
means "ask the next one".

One :class:`~dedupe_worker.Deduplicator` is built per distinct set of settings and process, so
tasks that share settings share one Redis connection pool and one lease-renewal thread.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kombu.utils.imports import symbol_by_name

from .._deduplicator import Deduplicator
from .._engine import RETRY_OPTIONS, ConsumerOptions
from .._errors import InvalidKey
from .._settings import DedupeSettings
from ..keys import fingerprint_of

__all__ = ["SETTINGS", "AppSettings", "Call", "bind_arguments", "call_fingerprint", "call_key", "consumer_options",
           "deduplicator_for", "derive_fingerprint", "derive_key", "key_and_fingerprint"]

#: Task attribute / app setting -> field of :class:`DedupeSettings` it falls back to.
SETTINGS = {
    "dedupe_redis_url": "redis_url",
    "dedupe_store_url": "store_url",
    "dedupe_namespace": "namespace",
    "dedupe_lease": "lease",
    "dedupe_result_ttl": "result_ttl",
    "dedupe_max_result_bytes": "max_result_bytes",
    "dedupe_compress_above": "compress_above",
    "dedupe_compression": "compression",
    "dedupe_fail_open": "fail_open",
    "dedupe_wait_replicas": "wait_replicas",
    "dedupe_wait_timeout": "wait_timeout",
    "dedupe_allow_eviction": "allow_eviction",
    "dedupe_sql_dsn": "sql_dsn",
    "dedupe_sql_table": "sql_table",
}


class AppSettings:
    """``app.conf.get(name)`` of one app, as Celery answers it, for the settings read on every
    call (``dedupe_ttl``, ``dedupe_on_send``, ``dedupe_send_ttl``) without Celery's full lookup each time.

    A value set on the app (``app.conf.dedupe_ttl = 60``, ``app.conf.update(...)``), which
    Celery keeps in ``conf.changes``, is seen by the next call. What lies below it
    (``config_from_object``, ``add_defaults``: read once a task asks and again whenever
    ``add_defaults`` layers another map) is not read again: change those before the first call.
    A configuration with a namespace (``config_from_object(..., namespace="CELERY")``) spells a
    name more than one way, so it is asked in full every time.
    """

    __slots__ = ("_below", "conf")

    def __init__(self, conf: Any) -> None:
        self.conf = conf
        self._below: dict[tuple[str, int], Any] = {}

    def get(self, name: str) -> Any:
        conf = self.conf
        changes = getattr(conf, "changes", None)
        if changes is None or getattr(conf, "prefix", None):
            return conf.get(name)
        if name in changes:
            return changes[name]
        layer = (name, len(conf.maps))
        try:
            return self._below[layer]
        except KeyError:
            value = self._below[layer] = conf.get(name)
            return value


_cache: dict[tuple[Any, ...], Deduplicator] = {}
_cache_lock = threading.Lock()


def _resolve(task: Any) -> tuple[dict[str, Any], tuple[type[BaseException], ...]]:
    conf = task.app.conf
    env: DedupeSettings | None = None
    values: dict[str, Any] = {}
    for attr, field in SETTINGS.items():
        value = getattr(task, attr, None)
        if value is None:
            value = conf.get(attr)
        if value is None:
            env = env or DedupeSettings.model_validate({})
            value = getattr(env, field)
        values[field] = value
    errors = getattr(task, "permanent_errors", None)
    if errors is None:
        errors = conf.get("dedupe_permanent_errors") or ()
    permanent = tuple(
        symbol_by_name(e) if isinstance(e, str) else e  # type: ignore[no-untyped-call]
        for e in errors
    )
    return values, permanent


def _outcomes(dsn: str | None, table: str) -> Any:
    """``dedupe_sql_dsn``'s :class:`~dedupe_worker.sql.SqlOutcomes` (``None`` when unset)."""
    if not dsn:
        return None
    from ..sql import SqlOutcomes

    return SqlOutcomes(dsn, table=table)


def deduplicator_for(task: Any) -> Deduplicator:
    """The (cached, per process) :class:`Deduplicator` for ``task``'s resolved settings."""
    values, permanent = _resolve(task)
    cache_key = (*sorted(values.items()), permanent)
    with _cache_lock:
        found = _cache.get(cache_key)
        if found is None:
            # the store-neutral setting wins; a database URL in either selects the SQL store
            url = values.pop("store_url") or values.pop("redis_url")
            values.pop("redis_url", None)
            dsn, table = values.pop("sql_dsn"), values.pop("sql_table")
            found = Deduplicator.from_url(url, permanent_errors=permanent, outcomes=_outcomes(dsn, table), **values)
            _cache[cache_key] = found
        return found


def bind_arguments(signature: inspect.Signature | None, args: tuple[Any, ...],
                   kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The call's arguments by parameter name, defaults applied and ``**kwargs`` flattened;
    ``None`` when they cannot be bound (or the task takes ``*args``)."""
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def _call(option: Callable[..., Any], named: dict[str, Any] | None,
          args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    return option(**named) if named is not None else option(*args, **kwargs)


def derive_key(task_name: str, option: str | Callable[..., Any] | None, header_value: Any,
               named: dict[str, Any] | None, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The task option, else the header, else ``<task name>:<hash of the arguments>``.

    Raises :class:`InvalidKey` when the option cannot produce a key from these arguments.
    """
    try:
        if callable(option):
            key = _call(option, named, args, kwargs)
        elif isinstance(option, str):
            key = option.format(**(named if named is not None else kwargs))
        elif header_value not in (None, ""):
            key = header_value
        else:
            key = f"{task_name}:{fingerprint_of(named if named is not None else [list(args), kwargs])}"
    except Exception as exc:  # a key function that fails on this input: dead-letter it
        raise InvalidKey(f"idempotency_key of {task_name} failed on these arguments: {exc!r}") from exc
    return key if isinstance(key, str) else str(key)


def derive_fingerprint(task_name: str, option: Callable[..., Any] | bool | None,
                       named: dict[str, Any] | None, args: tuple[Any, ...],
                       kwargs: Mapping[str, Any]) -> Any:
    """``None`` (no check) when the option is ``False``; the option's value when callable; else
    a hash of the task name and its arguments by name."""
    if option is False:
        return None
    if callable(option):
        return _call(option, named, args, kwargs)
    return fingerprint_of([task_name, named if named is not None else [list(args), kwargs]])


class Call(NamedTuple):
    """One call of a task: what its key and fingerprint are derived from (the arguments bound by
    name once), and the request whose headers carry the ttl."""

    task: Any
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    header_value: Any
    named: dict[str, Any] | None
    request: Any = None

    @classmethod
    def of(cls, task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], header_value: Any,
           request: Any = None) -> Call:
        return cls(task, args, kwargs, header_value, bind_arguments(task._run_signature, args, kwargs), request)


def call_key(call: Call) -> str:
    """The key of ``call`` (:func:`derive_key`)."""
    task = call.task
    return derive_key(task.name, task.idempotency_key, call.header_value, call.named, call.args, call.kwargs)


def call_fingerprint(call: Call) -> Any:
    """The fingerprint of ``call`` (:func:`derive_fingerprint`); :class:`InvalidKey` when it fails."""
    task = call.task
    try:
        return derive_fingerprint(task.name, task.idempotency_fingerprint, call.named, call.args, call.kwargs)
    except Exception as exc:  # a fingerprint function that fails on this input
        raise InvalidKey(f"idempotency_fingerprint failed: {exc!r}") from exc


def key_and_fingerprint(task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                        header_value: Any) -> tuple[str, Any]:
    """``(key, fingerprint)`` of ``task`` called with these arguments and key header value: what
    a send checks before publishing, derived as the worker's identification derives them.

    Raises :class:`InvalidKey` when the key or the fingerprint option fails on these arguments.
    """
    call = Call.of(task, args, kwargs, header_value)
    return call_key(call), call_fingerprint(call)


#: The task attributes that set a :class:`~dedupe_worker.ConsumerOptions` option, ``dedupe_<name>``.
OPTION_NAMES = ("ttl_header", *RETRY_OPTIONS)


def consumer_options(task: Any) -> ConsumerOptions:
    """``task``'s :class:`~dedupe_worker.ConsumerOptions`: ``dedupe_options`` (else the defaults)
    with each ``dedupe_<name>`` attribute set on top, else ``app.conf.dedupe_<name>``."""
    conf = task.app.conf
    values = {}
    for name in OPTION_NAMES:
        value = getattr(task, f"dedupe_{name}", None)
        values[name] = value if value is not None else conf.get(f"dedupe_{name}")
    base = getattr(task, "dedupe_options", None) or conf.get("dedupe_options") or ConsumerOptions()
    return base.merged(values)


def deprecated_names(cls: type, names: Mapping[str, Any]) -> None:
    """Carry the retry options set on a task class by their old names (``max_attempts=3``) over to
    ``dedupe_<name>``, with a ``DeprecationWarning``: the old names go in the next release."""
    for name in RETRY_OPTIONS:
        if name in names and f"dedupe_{name}" not in names:
            warnings.warn(f"the IdempotentTask option {name!r} is now called 'dedupe_{name}'; {name!r} goes in the "
                          "next release", DeprecationWarning, stacklevel=2)
            setattr(cls, f"dedupe_{name}", names[name])
