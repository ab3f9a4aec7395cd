"""The package's compiled extensions, each ``None`` where it was not built.

- ``compiled_pack``: ``dedupe_worker._resp.pack_command`` (``_resp.c``), RESP packing, byte for byte
  as ``hiredis.pack_command`` (chosen by :func:`~dedupe_worker._protocol.held.direct_packer`);
- ``plain_identities``: ``dedupe_worker._kafka_records.plain_identities`` (``_kafka_records.c``),
  the Kafka consumer's keys and fingerprints of plain records, as its Python path gives them.

They are built with the package where a C compiler is found (``hatch_build.py``), and not at all
with ``DEDUPE_NO_EXTENSIONS=1``. ``DEDUPE_PURE_PYTHON=1`` in the environment makes the library use
the Python paths instead (:func:`~dedupe_worker._settings.accelerators_off`, read where each is
chosen: a connection's first use, a consumer's construction): CI runs the whole suite that way
too (``make test-oldest``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["compiled_pack", "plain_identities"]


compiled_pack: Any
try:
    from ._resp import pack_command as compiled_pack
except ImportError:  # not compiled at install (no C compiler, DEDUPE_NO_EXTENSIONS=1): hiredis packs
    compiled_pack = None

plain_identities: Any
try:
    from ._kafka_records import plain_identities
except ImportError:  # not compiled at install: the Kafka consumer identifies its records in Python
    plain_identities = None

