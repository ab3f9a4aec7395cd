# The compiled dedupe_worker._kafka_records (_kafka_records.c): the Kafka consumer's identification of plain records.
from collections.abc import Sequence
from typing import Any, Literal

#: What computes the SHA-256 of a record's body: OpenSSL's EVP interface (built with ``DEDUPE_OPENSSL``), or hashlib.
DIGEST: Literal["openssl", "hashlib"]

def plain_identities(
    messages: Sequence[Any], fingerprint: bool, ttl_lowered: str | None, /
) -> tuple[list[str | None], list[str | None]]: ...
