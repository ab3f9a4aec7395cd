"""Hatchling build hook: compiles ``dedupe_worker/_resp.c`` into ``dedupe_worker._resp``.

What is guaranteed: a wheel built where the machine's C compiler (setuptools' ``build_ext``, the
compiler Python was built with, or ``CC``) compiles the extension carries it and is tagged for this
interpreter and platform (``cp311-cp311-linux_x86_64``); an editable install (``pip install -e .``,
``make install``) puts it beside the sources, where the ``.pth`` of the editable wheel makes Python
import it (git-ignored, replaced by a rename so a running process keeps the file it loaded). Where it
does not compile (no compiler, no Python headers, no setuptools) or ``DEDUPE_NO_EXTENSIONS=1`` is set,
the build still succeeds, pure Python and tagged ``py3-none-any``, and says why; the library then
packs with ``hiredis.pack_command`` (see ``dedupe_worker/_protocol/held.py``). An editable install
that skips the extension removes the one an earlier install left beside the sources.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

#: The extension: its import name and its one C source, relative to the project root.
EXTENSION = "dedupe_worker._resp"
SOURCE = "dedupe_worker/_resp.c"
#: Set to anything but ``""``/``0``: build without the extension.
NO_EXTENSIONS_ENV = "DEDUPE_NO_EXTENSIONS"


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    """Compiles the extension for the ``wheel`` target, standard and editable."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        # Where the import finds it: dedupe_worker/_resp.cpython-311-x86_64-linux-gnu.so, say.
        target = Path(self.root, "dedupe_worker", "_resp" + sysconfig.get_config_var("EXT_SUFFIX"))
        editable = version == "editable"
        if editable:  # a stale build of an earlier install would be imported instead of the fallback
            target.unlink(missing_ok=True)
        if os.environ.get(NO_EXTENSIONS_ENV, "").strip() not in ("", "0"):
            self.app.display_info(f"{NO_EXTENSIONS_ENV} is set: building {EXTENSION} is skipped (pure Python)")
            return
        self._temp = tempfile.mkdtemp(prefix="dedupe-worker-build-")
        try:
            built = self._compile(Path(self._temp))
        except Exception as exc:  # no compiler, no headers, no setuptools: the pure-Python package
            self.app.display_warning(f"{EXTENSION} was not compiled ({type(exc).__name__}: {exc}); "
                                     "the package is pure Python and packs commands with hiredis")
            return
        if editable:
            staged = target.with_name(target.name + ".tmp")
            shutil.copyfile(built, staged)
            os.replace(staged, target)  # a new file: a process that loaded the old one keeps it
        else:
            build_data["force_include"][str(built)] = target.relative_to(self.root).as_posix()
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
        self.app.display_info(f"compiled {EXTENSION}")

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        temp = getattr(self, "_temp", None)
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)

    def _compile(self, out: Path) -> Path:
        """The built extension's path under ``out``; raises when it does not compile."""
        from setuptools import Distribution, Extension
        from setuptools.command.build_ext import build_ext

        extension = Extension(EXTENSION, [str(Path(self.root, SOURCE))])
        command = build_ext(Distribution({"name": "dedupe-worker", "ext_modules": [extension]}))
        command.build_lib = str(out / "lib")
        command.build_temp = str(out / "temp")
        command.ensure_finalized()
        command.run()
        return Path(command.get_ext_fullpath(EXTENSION))
