"""Hatchling build hook: compiles the package's C extension from its one source beside it:
``dedupe_worker._resp`` (``_resp.c``, RESP packing).

What is guaranteed: a wheel built where the machine's C compiler (setuptools' ``build_ext``, the
compiler Python was built with, or ``CC``) compiles the extensions carries them and is tagged for this
interpreter and platform (``cp311-cp311-linux_x86_64``); an editable install (``pip install -e .``,
``make install``) puts them beside the sources, where the ``.pth`` of the editable wheel makes Python
import them (git-ignored, each replaced by a rename so a running process keeps the file it loaded).
Where they do not compile (no compiler, no Python headers, no setuptools) or ``DEDUPE_NO_EXTENSIONS=1``
is set, the build still succeeds, pure Python and tagged ``py3-none-any``, and says why; the library
then packs with ``hiredis.pack_command`` (see ``dedupe_worker/_transport/held.py``). An editable
install that skips the extensions removes those an earlier install left beside the sources (and
the retired ``_kafka_records``).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

#: The extensions: import name -> its one C source, relative to the project root.
EXTENSIONS = {
    "dedupe_worker._resp": "dedupe_worker/_resp.c",
}
#: Extensions of earlier releases: an editable install removes what one left beside the sources.
RETIRED = ("dedupe_worker._kafka_records",)
#: Set to anything but ``""``/``0``: build without the extensions.
NO_EXTENSIONS_ENV = "DEDUPE_NO_EXTENSIONS"


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    """Compiles the extensions for the ``wheel`` target, standard and editable."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        # Where the import finds each: dedupe_worker/_resp.cpython-311-x86_64-linux-gnu.so, say.
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        targets = {name: Path(self.root, name.replace(".", "/") + suffix) for name in EXTENSIONS}
        names = ", ".join(EXTENSIONS)
        editable = version == "editable"
        if editable:  # a stale build of an earlier install would be imported instead of the fallback
            for target in [*targets.values(), *(Path(self.root, name.replace(".", "/") + suffix) for name in RETIRED)]:
                target.unlink(missing_ok=True)
        if os.environ.get(NO_EXTENSIONS_ENV, "").strip() not in ("", "0"):
            self.app.display_info(f"{NO_EXTENSIONS_ENV} is set: building {names} is skipped (pure Python)")
            return
        self._temp = tempfile.mkdtemp(prefix="dedupe-worker-build-")
        try:
            built = self._compile(Path(self._temp))
        except Exception as exc:  # no compiler, no headers, no setuptools: the pure-Python package
            self.app.display_warning(f"{names} were not compiled ({type(exc).__name__}: {exc}); the package "
                                     "is pure Python: hiredis packs commands")
            return
        for name, target in targets.items():
            if editable:
                staged = target.with_name(target.name + ".tmp")
                shutil.copyfile(built[name], staged)
                os.replace(staged, target)  # a new file: a process that loaded the old one keeps it
            else:
                build_data["force_include"][str(built[name])] = target.relative_to(self.root).as_posix()
        if not editable:
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
        self.app.display_info(f"compiled {names}")

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        temp = getattr(self, "_temp", None)
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)

    def _compile(self, out: Path) -> dict[str, Path]:
        """The built extensions' paths under ``out``, by name; raises when one does not compile."""
        from setuptools import Distribution, Extension
        from setuptools.command.build_ext import build_ext

        extensions = [Extension(name, [str(Path(self.root, source))]) for name, source in EXTENSIONS.items()]
        command = build_ext(Distribution({"name": "dedupe-worker", "ext_modules": extensions}))
        command.build_lib = str(out / "lib")
        command.build_temp = str(out / "temp")
        command.ensure_finalized()
        command.run()
        return {name: Path(command.get_ext_fullpath(name)) for name in EXTENSIONS}
