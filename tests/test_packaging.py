"""The wheel ships the Lua scripts and the compiled extension, and the public names are the intended ones."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import dedupe_worker
from dedupe_worker._transport.script_flow import SCRIPT_NAMES, SENDER_SCRIPTS

ROOT = Path(__file__).resolve().parent.parent
#: The compiled packer's file name for this interpreter, as the wheel and an editable install hold it.
EXTENSION = "dedupe_worker/_resp" + str(sysconfig.get_config_var("EXT_SUFFIX"))
#: Every compiled extension's file name (the packer alone since the Kafka identification's was retired).
EXTENSIONS = [EXTENSION]
#: Their C sources and stubs, which every wheel and sdist carry.
SOURCES = {"dedupe_worker/_resp.c", "dedupe_worker/_resp.pyi"}


def build(out: Path, *what: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m build`` of the project into ``out`` (``--no-isolation``: hatchling and setuptools
    come from the test extra, no download), asserted to succeed."""
    built = subprocess.run([sys.executable, "-m", "build", *what, "--no-isolation", "--outdir", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert built.returncode == 0, built.stdout + built.stderr
    return built


def compiled_expected() -> bool:
    """Whether this machine's builds carry the compiled packer: unless ``DEDUPE_NO_EXTENSIONS`` is
    set, always in CI, and elsewhere where the editable install compiled it (a C compiler exists)."""
    if os.environ.get("DEDUPE_NO_EXTENSIONS", "").strip() not in ("", "0"):
        return False
    if os.environ.get("CI") == "true":
        return True
    try:
        import dedupe_worker._resp  # noqa: F401
    except ImportError:
        return False
    return True


def wheel_tag(wheel: Path) -> str:
    """The wheel's ``.dist-info/WHEEL`` file (``Root-Is-Purelib``, ``Tag``)."""
    archive = zipfile.ZipFile(wheel)
    return archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/WHEEL"))).decode()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build(out, "--wheel")
    (found,) = out.glob("dedupe_worker-*.whl")
    return found


def test_wheel_contains_every_script_and_py_typed(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (*SENDER_SCRIPTS, *SCRIPT_NAMES):
        assert f"dedupe_worker/lua/{name}.lua" in names
    assert "dedupe_worker/py.typed" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    assert {"dedupe_worker/sql/ddl/postgresql.sql", "dedupe_worker/sql/ddl/mysql.sql"} <= names  # atomic()'s DDL
    assert {"dedupe_worker/_sqlstore/postgresql.sql", "dedupe_worker/_sqlstore/mysql.sql"} <= names  # the SQL store's
    assert SOURCES <= names


def test_the_wheel_carries_the_compiled_packer_and_is_tagged_for_it(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    if not compiled_expected():
        pytest.skip("no compiled packer expected here (DEDUPE_NO_EXTENSIONS, or no C compiler outside CI)")
    assert sorted(n for n in names if n.endswith((".so", ".pyd"))) == EXTENSIONS  # not a stale one from the tree
    tag = wheel_tag(wheel)
    assert "Root-Is-Purelib: false" in tag
    assert f"Tag: cp{sys.version_info.major}{sys.version_info.minor}-" in tag and "-none-any" not in wheel.name


@pytest.mark.parametrize("env", [{"DEDUPE_NO_EXTENSIONS": "1"}, {"CC": "/nonexistent/cc"}],
                         ids=["DEDUPE_NO_EXTENSIONS", "no-compiler"])
def test_a_wheel_without_the_extension_still_builds_pure(env: dict[str, str], tmp_path: Path) -> None:
    """Asked to skip it, or without a working C compiler, the build succeeds: a pure-Python wheel
    (hiredis packs), the C source still in it, no compiled file (an editable install's, beside the
    sources, is git-ignored and so never packed)."""
    built = build(tmp_path, "--wheel", **env)
    (found,) = tmp_path.glob("dedupe_worker-*-py3-none-any.whl")
    names = set(zipfile.ZipFile(found).namelist())
    assert SOURCES <= names and not [n for n in names if n.endswith((".so", ".pyd"))]
    assert "Root-Is-Purelib: true" in wheel_tag(found)
    if "CC" in env:
        assert "were not compiled" in built.stdout + built.stderr  # said, not silent


def test_the_sdist_builds_a_wheel_with_the_compiled_packer(tmp_path: Path) -> None:
    """The sdist carries the C source and the build hook; the wheel built from it (``python -m
    build`` builds the wheel from the sdist) carries the extension."""
    build(tmp_path)
    (sdist,) = tmp_path.glob("dedupe_worker-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"hatch_build.py", *SOURCES} <= names
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    (found,) = tmp_path.glob("dedupe_worker-*.whl")
    if compiled_expected():
        assert set(EXTENSIONS) <= set(zipfile.ZipFile(found).namelist())


def test_installed_wheel_loads_its_own_scripts(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], check=True, timeout=300)
    # dependencies come from the test environment's site-packages, the package from the wheel
    deps = sysconfig.get_paths()["purelib"]
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "test-deps.pth").write_text(deps + "\n")
    code = (
        "import dedupe_worker, pathlib; from dedupe_worker._transport.scripts import load_script, SCRIPT_NAMES;"
        "from importlib import resources;"
        "print(dedupe_worker.__file__);"
        "print(all(resources.files('dedupe_worker').joinpath('lua', n + '.lua').is_file() for n in SCRIPT_NAMES));"
        "print(load_script('claim').splitlines()[0]);"
        "import hiredis, sys; from dedupe_worker._transport import held; command = ('GET', 'k\u00e9', 1, 0.5);"
        "print(held.compiled_pack is not None and held.compiled_pack(command) == hiredis.pack_command(command));"
        "print(getattr(sys.modules.get('dedupe_worker._resp'), '__file__', None))"
    )
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "DEDUPE_PURE_PYTHON"}).stdout
    location, packaged, first_line, packs, compiled = out.splitlines()
    assert location.startswith(str(venv))
    assert packaged == "True"
    assert first_line.startswith("-- claim.lua")
    if compiled_expected():  # the wheel's own compiled packer, imported from the venv, packing
        assert packs == "True" and compiled.startswith(str(venv)), out


def test_public_names() -> None:
    expected = {
        "OMITTED", "Action", "AlreadyApplied", "Claim", "ClaimClient", "ClaimError", "ClientOptions", "DedupeError",
        "DedupeSettings", "ConsumerOptions",
        "Decision", "EvictionPolicyError", "Hooks", "State", "Stored",
        "Deduplicator", "Envelope", "InProgress", "InvalidKey", "KeyConflict", "KeyState", "LeaseLost",
        "MissingKey", "Omitted", "Outcome", "PreviouslyFailed", "Reason", "ResultNotSerializable",
        "StoreUnavailable", "UndecodableMessage", "UnreadableRecord", "current_claim", "decide", "decide_many",
        "idempotent",
    }
    assert set(dedupe_worker.__all__) == expected
    for name in expected:
        assert getattr(dedupe_worker, name) is not None


def test_every_error_derives_from_the_root() -> None:
    from dedupe_worker import _errors as errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.DedupeError)


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/3")
    monkeypatch.setenv("DEDUPE_LEASE", "2.5")
    monkeypatch.setenv("DEDUPE_NAMESPACE", "billing")
    d = dedupe_worker.Deduplicator.from_settings()
    assert d.lease == 2.5 and d.layout.namespace == "billing"
    assert d.store.client.connection_pool.connection_kwargs["db"] == 3


def test_claim_errors_rebuild_from_their_args() -> None:
    import pickle

    from dedupe_worker import InProgress, KeyConflict, LeaseLost, PreviouslyFailed

    for exc in (InProgress("k", 1.5, 3), KeyConflict("k"), LeaseLost("k", 7),
                PreviouslyFailed("k", {"type": "ValueError", "message": "no"})):
        rebuilt = type(exc)(*exc.args)  # what Celery's JSON result backend does
        assert str(rebuilt) == str(exc) and rebuilt.key == "k"
        assert str(pickle.loads(pickle.dumps(exc))) == str(exc)
    assert "retry in 1.500s" in str(InProgress("k", 1.5))


@pytest.mark.parametrize(("module", "missing", "extra"), [
    ("dedupe_worker.rabbitmq", "kombu", "rabbitmq"),
    ("dedupe_worker.rabbitmq", "amqp", "rabbitmq"),
    ("dedupe_worker.kafka", "confluent_kafka", "kafka"),
    ("dedupe_worker.celery", "celery", "celery"),
    ("dedupe_worker.dramatiq", "dramatiq", "dramatiq"),
    ("dedupe_worker.faststream", "faststream", "faststream"),
])
def test_an_integration_without_its_extra_names_the_extra_to_install(module: str, missing: str, extra: str) -> None:
    import subprocess
    import sys

    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            f"try:\n    import {module}\nexcept ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert f"pip install 'dedupe-worker[{extra}]'" in out, out


def test_the_layers_import_only_downwards() -> None:
    """_protocol < _transport, _messages < _engine, each importing only its own layer, the ones below,
    and the leaves (_errors, _settings, _extras, observe, the compiled extension and _compiled, which imports
    only it): so no import cycle runs through them."""
    import ast
    from pathlib import Path

    root = Path(dedupe_worker.__file__).parent
    rank = {"_protocol": 1, "_transport": 2, "_messages": 2, "_engine": 3}
    # _resp: compiled, importing nothing; _compiled: importing only it
    leaves = {"_errors", "_settings", "_extras", "observe", "_resp", "_compiled"}
    for layer, own in rank.items():
        for path in (root / layer).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level):
                    continue
                base = path.parent.relative_to(root).parts[: len(path.parent.relative_to(root).parts)
                                                           - (node.level - 1)]
                first = [*base, *(node.module or "").split(".")][0]
                assert first in leaves or rank.get(first, 99) <= own, \
                    f"{layer}/{path.name} imports {'.' * node.level}{node.module}, above its layer"


#: The packages with a door: every module outside one imports it from its ``__init__``.
DOORS = ("_protocol", "_transport")


@pytest.mark.parametrize("package", DOORS)
def test_nothing_outside_a_package_imports_past_its_door(package: str) -> None:
    """Every module outside ``<package>/`` imports it from its ``__init__`` (its door), never from
    a submodule, and only names the door's ``__all__`` hands on (no module, no private name): so
    the package's submodules can move, merge or split without touching the rest. The state
    machine (``_protocol``) and the transport (``_transport``) each have one."""
    import ast
    import importlib
    from pathlib import Path

    door = importlib.import_module(f"dedupe_worker.{package}")
    name = f"dedupe_worker.{package}"
    root = Path(dedupe_worker.__file__).parent
    past, unlisted = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[1] == package:
            continue
        folder = parts[:-1]  # a module's and an __init__'s relative imports both start from its folder
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = folder[: len(folder) - node.level + 1] if node.level else ()
                modules = [".".join([*base, *([node.module] if node.module else [])])]
                if modules[0] == "dedupe_worker":  # from .. import _protocol: the package itself
                    modules = [f"dedupe_worker.{a.name}" for a in node.names]
                elif modules[0] == name:
                    unlisted += [f"{path.name}: {a.name}" for a in node.names if a.name not in door.__all__]
            else:
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            past += [f"{'/'.join(parts)}.py imports {m}" for m in modules if m.startswith(f"{name}.")]
    assert not past, past
    assert not unlisted, unlisted


def test_the_state_machine_imports_no_transport() -> None:
    """``_protocol`` does no I/O and knows nothing of what carries its calls: no module of it
    imports ``_transport`` (nor redis-py's clients; its exception classes are read, never raised
    from a socket here), so the transport and every accelerator in it can go without touching it."""
    import ast
    from pathlib import Path

    for path in (Path(dedupe_worker.__file__).parent / "_protocol").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                assert "_transport" not in module and "_compiled" not in module, f"{path.name} imports {module}"
                assert module in {"redis.exceptions"} or not module.startswith("redis"), \
                    f"{path.name} imports {module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] in {"redis", "hiredis", "socket"} for a in node.names), \
                    f"{path.name} imports {[a.name for a in node.names]}"


def test_the_compiled_extensions_module_imports_only_them() -> None:
    import ast
    from pathlib import Path

    path = Path(dedupe_worker.__file__).parent / "_compiled.py"
    imported = {(node.level, node.module) for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level}
    assert imported == {(1, "_resp")}


def test_the_leaves_import_nothing_of_the_package() -> None:
    """The errors, the settings, the extras' hint and the observers sit on the bottom floor."""
    import ast
    from pathlib import Path

    root = Path(dedupe_worker.__file__).parent
    for path in [root / "_errors.py", root / "_settings.py", root / "_extras.py", *(root / "observe").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0 or (path.parent.name == "observe" and node.level == 1), \
                    f"{path.name} imports {'.' * node.level}{node.module}"
                assert not (node.module or "").startswith("dedupe_worker"), f"{path.name} imports {node.module}"


def test_the_asyncio_package_sits_beside_the_deduplicator() -> None:
    """``dedupe_worker.asyncio`` imports the layers below (protocol, transport, messages, engine), the leaves
    and its sibling ``_deduplicator``/``_decorators`` only; and no layer below imports it."""
    import ast
    from pathlib import Path

    root = Path(dedupe_worker.__file__).parent
    allowed = {"_protocol", "_transport", "_messages", "_engine", "_errors", "_settings", "_extras", "observe",
               "_deduplicator", "_decorators", "asyncio"}
    for path in (root / "asyncio").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                first = (node.module or "").split(".")[0] if node.level == 2 else "asyncio"
                assert first in allowed, f"asyncio/{path.name} imports {'.' * node.level}{node.module}"
    for layer in ("_protocol", "_transport", "_messages", "_engine"):
        for path in (root / layer).glob("*.py"):
            assert "asyncio" not in {
                part for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
                and node.level for part in (node.module or "").split(".")}, f"{layer}/{path.name} imports asyncio"
