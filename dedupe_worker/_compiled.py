"""The package's compiled extension, ``None`` where it was not built.

- ``compiled_pack``: ``dedupe_worker._resp.pack_command`` (``_resp.c``), RESP packing, byte for byte
  as ``hiredis.pack_command`` (chosen by :func:`~dedupe_worker._transport.held.direct_packer`, for
  the held connection and the asyncio direct sender only).

It is built with the package where a C compiler is found (``hatch_build.py``), and not at all
with ``DEDUPE_NO_EXTENSIONS=1``. ``DEDUPE_PURE_PYTHON=1`` in the environment makes the library take
its plain paths instead (:func:`~dedupe_worker._settings.accelerators_off`, read where each is
chosen): CI runs the whole suite that way too (``make test-oldest``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["compiled_pack"]


compiled_pack: Any
try:
    from ._resp import pack_command as compiled_pack
except ImportError:  # not compiled at install (no C compiler, DEDUPE_NO_EXTENSIONS=1): hiredis packs
    compiled_pack = None

