"""The wheel ships the Lua scripts, and the public names are the intended ones."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import dedupe_worker
from dedupe_worker._protocol.scripts import SCRIPT_NAMES, SENDER_SCRIPTS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(  # --no-isolation: hatchling comes from the test extra, no download
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = out.glob("dedupe_worker-*.whl")
    return found


def test_wheel_contains_every_script_and_py_typed(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (*SENDER_SCRIPTS, *SCRIPT_NAMES):
        assert f"dedupe_worker/lua/{name}.lua" in names
    assert "dedupe_worker/py.typed" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    assert {"dedupe_worker/sql/ddl/postgresql.sql", "dedupe_worker/sql/ddl/mysql.sql"} <= names  # atomic()'s DDL


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
        "import dedupe_worker, pathlib; from dedupe_worker._protocol.scripts import load_script, SCRIPT_NAMES;"
        "from importlib import resources;"
        "print(dedupe_worker.__file__);"
        "print(all(resources.files('dedupe_worker').joinpath('lua', n + '.lua').is_file() for n in SCRIPT_NAMES));"
        "print(load_script('claim').splitlines()[0])"
    )
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    location, packaged, first_line = out.splitlines()
    assert location.startswith(str(venv))
    assert packaged == "True"
    assert first_line.startswith("-- claim.lua")


def test_public_names() -> None:
    expected = {
        "OMITTED", "Action", "AlreadyApplied", "Claim", "ClaimClient", "ClaimError", "DedupeError", "DedupeSettings",
        "Decision", "EvictionPolicyError", "Hooks", "State", "Stored",
        "Deduplicator", "Envelope", "InProgress", "InvalidKey", "KeyConflict", "KeyState", "LeaseLost",
        "MissingKey", "Omitted", "Outcome", "PreviouslyFailed", "Reason", "ResultNotSerializable",
        "StoreUnavailable", "UndecodableMessage", "current_claim", "decide", "decide_many", "idempotent",
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
    """_protocol < _messages < _engine, each importing only its own layer, the ones below, and the
    leaves (_errors, _settings, _extras, observe): so no import cycle runs through them."""
    import ast
    from pathlib import Path

    root = Path(dedupe_worker.__file__).parent
    rank = {"_protocol": 1, "_messages": 2, "_engine": 3}
    leaves = {"_errors", "_settings", "_extras", "observe"}
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
    """``dedupe_worker.asyncio`` imports the layers below (protocol, messages, engine), the leaves
    and its sibling ``_deduplicator``/``_decorators`` only; and no layer below imports it."""
    import ast
    from pathlib import Path

    root = Path(dedupe_worker.__file__).parent
    allowed = {"_protocol", "_messages", "_engine", "_errors", "_settings", "_extras", "observe",
               "_deduplicator", "_decorators", "asyncio"}
    for path in (root / "asyncio").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                first = (node.module or "").split(".")[0] if node.level == 2 else "asyncio"
                assert first in allowed, f"asyncio/{path.name} imports {'.' * node.level}{node.module}"
    for layer in ("_protocol", "_messages", "_engine"):
        for path in (root / layer).glob("*.py"):
            assert "asyncio" not in {
                part for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
                and node.level for part in (node.module or "").split(".")}, f"{layer}/{path.name} imports asyncio"
