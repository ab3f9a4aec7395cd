# The compiled dedupe_worker._kafka_records (_kafka_records.c): the Kafka consumer's identification of plain records.
from collections.abc import Callable, Sequence
from typing import Any

def plain_identities(
    messages: Sequence[Any], sha256: Callable[[bytes], Any] | None, ttl_lowered: str | None, /
) -> tuple[list[str | None], list[str | None]]: ...
