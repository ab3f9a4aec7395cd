"""Every ``dedupe-worker`` command, as a user runs it (the real console script in a subprocess),
answers what the user can fix with ONE line on stderr naming the thing and exit status 2: an
unreachable Redis, RabbitMQ, Kafka or database, a bad URL or DSN, a missing table, a handler
module that does not import, a bad option. ``-v`` adds the traceback."""

from __future__ import annotations

import argparse
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from . import services
from .test_cli_ux import cli

HANDLER = "def apply(*args):\n    return None\n"
CLOSED = services.free_port()  # nothing listens there (bound once and released)

#: Every command that talks to Redis, with the other arguments it needs (a broker address that
#: is never reached: Redis is checked first).
REDIS_COMMANDS = {
    "demo": ["demo"],
    "kafka": ["kafka", "h:apply", "--topic", "t", "--group", "g", "--bootstrap", f"127.0.0.1:{CLOSED}"],
    "rabbitmq": ["rabbitmq", "h:apply", "--queue", "q", "--url", f"amqp://guest:guest@127.0.0.1:{CLOSED}//"],
    "replay rabbitmq": ["replay", "rabbitmq", "--from", "q.dlq", "--url", f"amqp://guest:guest@127.0.0.1:{CLOSED}//"],
    "replay kafka": ["replay", "kafka", "--from", "t.dlq", "--bootstrap", f"127.0.0.1:{CLOSED}"],
    "inspect": ["inspect", "k"],
    "forget": ["forget", "k"],
    "stats": ["stats"],
    "doctor": ["doctor"],
}


def one_line(done: subprocess.CompletedProcess[str], command: str, *named: str) -> str:
    """Assert exit 2, nothing on stdout, one line on stderr starting with the command and
    naming each of ``named``; return the line."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"dedupe-worker {command}: "), lines[0]
    for thing in named:
        assert thing in lines[0], (thing, lines[0])
    return lines[0]


@pytest.fixture
def here(tmp_path: Path) -> Path:
    """A directory holding the handler module ``h`` (``h:apply``), where the commands run."""
    (tmp_path / "h.py").write_text(HANDLER)
    return tmp_path


@pytest.mark.parametrize("command", REDIS_COMMANDS)
def test_unreachable_redis(command: str, here: Path) -> None:
    url = f"redis://127.0.0.1:{CLOSED}/0"
    done = cli(*REDIS_COMMANDS[command], "--redis-url", url, cwd=here)
    one_line(done, command, f"cannot reach Redis at {url} (--redis-url)", "Connection refused")


@pytest.mark.parametrize("command", REDIS_COMMANDS)
def test_bad_redis_url(command: str, here: Path) -> None:
    done = cli(*REDIS_COMMANDS[command], "--redis-url", "foo://bar", cwd=here)
    one_line(done, command, "bad Redis URL foo://bar (--redis-url)", "redis://")


@pytest.mark.parametrize("command", ["stats", "demo"])
def test_the_url_from_the_environment_is_named_as_such(command: str, here: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"redis://:secret@127.0.0.1:{CLOSED}/0"
    monkeypatch.setenv("DEDUPE_REDIS_URL", url)
    line = one_line(cli(command, cwd=here), command, f"redis://:***@127.0.0.1:{CLOSED}/0 (DEDUPE_REDIS_URL)")
    assert "secret" not in line


@pytest.mark.parametrize("command", ["rabbitmq", "replay rabbitmq"])
def test_rabbitmq_unreachable_or_bad_url(command: str, here: Path, redis_url: str) -> None:
    args = REDIS_COMMANDS[command][:-2]
    done = cli(*args, "--url", f"amqp://guest:pw@127.0.0.1:{CLOSED}//", "--redis-url", redis_url, cwd=here)
    line = one_line(done, command, f"cannot reach RabbitMQ at amqp://guest:***@127.0.0.1:{CLOSED}//")
    assert "pw@" not in line
    done = cli(*args, "--url", "foo://bar", "--redis-url", redis_url, cwd=here)
    one_line(done, command, "--url foo://bar", "No such transport: foo")


@pytest.mark.parametrize("command", ["kafka", "replay kafka"])
def test_kafka_unreachable(command: str, here: Path, redis_url: str) -> None:
    """librdkafka retries an unreachable bootstrap server for ever, logging each try: the
    command asks for the metadata once (quietly) and says so."""
    done = cli(*REDIS_COMMANDS[command], "--redis-url", redis_url, cwd=here)
    one_line(done, command, f"cannot reach Kafka at 127.0.0.1:{CLOSED} (--bootstrap")


@pytest.mark.parametrize("command", ["kafka", "replay kafka"])
def test_kafka_without_a_bootstrap_server(command: str, here: Path, redis_url: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEDUPE_KAFKA_BOOTSTRAP", raising=False)
    args = REDIS_COMMANDS[command][:-2]
    one_line(cli(*args, "--redis-url", redis_url, cwd=here), command, "--bootstrap", "DEDUPE_KAFKA_BOOTSTRAP")


@pytest.mark.parametrize("action", ["init", "purge"])
def test_unreachable_postgresql(action: str) -> None:
    done = cli("sql", action, "--dsn", f"postgresql://postgres@127.0.0.1:{CLOSED}/test")
    one_line(done, "sql", "database: ", f"port {CLOSED} failed", "Connection refused")


@pytest.mark.parametrize("action", ["init", "purge"])
def test_unreachable_mysql(action: str) -> None:
    pytest.importorskip("pymysql")
    done = cli("sql", action, "--dsn", f"mysql+pymysql://root@127.0.0.1:{CLOSED}/test")
    one_line(done, "sql", "database: ", "Can't connect to MySQL server", "Connection refused")


@pytest.mark.parametrize("action", ["init", "purge"])
def test_bad_dsn(action: str) -> None:
    one_line(cli("sql", action, "--dsn", "foo://bar"), "sql", "--dsn foo://bar", "postgresql://")
    one_line(cli("sql", action, "--dsn", "nonsense"), "sql", "database: ", "nonsense")


def test_missing_table_postgresql(postgres_dsn: str) -> None:
    table = f"missing_{uuid.uuid4().hex[:8]}"
    one_line(cli("sql", "purge", "--dsn", postgres_dsn, "--table", table), "sql", "database: ", table,
             "does not exist")


def test_missing_table_mysql(mysql_url: str) -> None:
    table = f"missing_{uuid.uuid4().hex[:8]}"
    one_line(cli("sql", "purge", "--dsn", mysql_url, "--table", table), "sql", "database: ", table, "doesn't exist")


@pytest.mark.parametrize("action", ["ddl", "init", "purge"])
def test_a_table_name_that_is_not_an_identifier(action: str) -> None:
    done = cli("sql", action, "--dsn", f"postgresql://postgres@127.0.0.1:{CLOSED}/test", "--table", "x; drop")
    one_line(done, "sql", "table must be a plain SQL identifier", "'x; drop'", "--table")


def test_missing_dead_letter_queue(rabbitmq_url: str, redis_url: str) -> None:
    queue = f"missing-{uuid.uuid4().hex[:8]}.dlq"
    done = cli("replay", "rabbitmq", "--from", queue, "--url", rabbitmq_url, "--redis-url", redis_url)
    one_line(done, "replay rabbitmq", f"dead-letter queue '{queue}' not found")


def test_no_dsn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEDUPE_SQL_DSN", raising=False)
    one_line(cli("sql", "purge"), "sql", "--dsn", "DEDUPE_SQL_DSN")


@pytest.mark.parametrize("command", ["rabbitmq", "kafka"])
@pytest.mark.parametrize(("handler", "named"), [
    ("nosuch_module_h39:apply", ["cannot import the handler's module 'nosuch_module_h39'", "No module named"]),
    ("broken:apply", ["cannot import the handler's module 'broken'", "ZeroDivisionError"]),
    ("h:missing", ["handler 'h:missing'", "h has no 'missing'"]),
    ("h:NOT_CALLABLE", ["handler 'h:NOT_CALLABLE' is not callable"]),
    ("apply", ["handler 'apply'", "expected 'module:function'"]),
])
def test_unimportable_handler(command: str, handler: str, named: list[str], here: Path) -> None:
    (here / "broken.py").write_text("1 / 0\n")
    (here / "h.py").write_text(HANDLER + "NOT_CALLABLE = 1\n")
    args = [handler if a == "h:apply" else a for a in REDIS_COMMANDS[command]]
    one_line(cli(*args, "--redis-url", f"redis://127.0.0.1:{CLOSED}/0", cwd=here), command, *named)


#: Each subcommand with an option it does not have, and one with a bad value.
BAD_OPTIONS = [
    ("demo", ["demo", "--orders", "many"], "argument --orders: invalid int value: 'many'"),
    ("kafka", ["kafka", "h:apply", "--topic", "t"], "the following arguments are required: --group"),
    ("rabbitmq", ["rabbitmq", "h:apply", "--queue", "q", "--lease", "soon"], "argument --lease: invalid float"),
    ("replay rabbitmq", ["replay", "rabbitmq", "--from", "q", "--rate", "fast"], "expected a positive rate"),
    ("replay kafka", ["replay", "kafka", "--from", "t", "-X", "novalue"], "expected NAME=VALUE"),
    ("replay", ["replay", "sqs"], "argument broker: invalid choice: 'sqs'"),
    ("inspect", ["inspect"], "the following arguments are required: KEY"),
    ("forget", ["forget", "k", "--if-token", "x"], "argument --if-token: invalid int value"),
    ("stats", ["stats", "--sample", "all"], "argument --sample: invalid int value"),
    ("doctor", ["doctor", "--rate", "lots"], "argument --rate: invalid float value"),
    ("sql", ["sql", "drop"], "argument action: invalid choice: 'drop'"),
    ("sql", ["sql", "ddl", "--dialect", "oracle"], "argument --dialect: invalid choice: 'oracle'"),
]


@pytest.mark.parametrize(("command", "args", "named"), BAD_OPTIONS, ids=[" ".join(b[1][:2]) for b in BAD_OPTIONS])
def test_bad_option(command: str, args: list[str], named: str) -> None:
    one_line(cli(*args), command, named, f"(see dedupe-worker {command} --help)")


@pytest.mark.parametrize(("args", "command"), [(["stats", "--bogus"], "stats"),
                                             (["replay", "kafka", "--from", "t", "--bogus"], "replay kafka"),
                                             (["forget", "k", "--bogus"], "forget")])
def test_an_unknown_option_is_said_by_its_subcommand(args: list[str], command: str) -> None:
    one_line(cli(*args), command, "unrecognized arguments: --bogus", f"(see dedupe-worker {command} --help)")


def test_a_setting_librdkafka_refuses(here: Path, redis_url: str) -> None:
    args = [*REDIS_COMMANDS["kafka"], "-X", "no.such.setting=1", "--redis-url", redis_url]
    one_line(cli(*args, cwd=here), "kafka", "Kafka settings (-X, --bootstrap)", "no.such.setting")


@pytest.mark.parametrize(("args", "env", "named"), [
    (["--lease", "-1"], {}, ["bad setting: DEDUPE_LEASE=-1.0", "greater than 0"]),
    ([], {"DEDUPE_RESULT_TTL": "soon"}, ["bad setting: DEDUPE_RESULT_TTL='soon'"]),
    (["--namespace", "a b"], {}, ["bad setting: namespace", "'a b'"]),
])
def test_a_bad_setting(args: list[str], env: dict[str, str], named: list[str], redis_url: str,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    one_line(cli("stats", "--redis-url", redis_url, *args), "stats", *named)


def test_verbose_adds_the_traceback(here: Path) -> None:
    done = cli("-v", "stats", "--redis-url", f"redis://127.0.0.1:{CLOSED}/0", cwd=here)
    assert done.returncode == 2
    assert "Traceback" in done.stderr
    assert done.stderr.splitlines()[-1].startswith("dedupe-worker stats: cannot reach Redis at ")



def test_the_default_url_is_named_as_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """No URL given: the line says the default was tried, and how to name another (in process, with
    the default aimed at a closed port: 127.0.0.1:6379 may well answer on this machine)."""
    from dedupe_worker._settings import DedupeSettings
    from dedupe_worker.cli import _options
    from dedupe_worker.cli._fail import CommandError

    class Closed(DedupeSettings):
        redis_url: str = f"redis://127.0.0.1:{CLOSED}/0"

    monkeypatch.delenv("DEDUPE_REDIS_URL", raising=False)
    monkeypatch.setattr(_options, "DedupeSettings", Closed)
    with pytest.raises(CommandError, match=re.escape(f"cannot reach Redis at redis://127.0.0.1:{CLOSED}/0 (the "
                                                     "default; --redis-url or DEDUPE_REDIS_URL names another)")):
        _options.deduplicator_from(argparse.Namespace())


@pytest.mark.parametrize("command", ["inspect", "forget", "stats"])
@pytest.mark.parametrize("url", [f"postgresql://postgres@127.0.0.1:{CLOSED}/test", f"mysql://root@127.0.0.1:{CLOSED}/test"])
def test_unreachable_sql_store_names_the_database(command: str, url: str, here: Path) -> None:
    """A claim store on a database that cannot be reached is named as the database, never as Redis."""
    if url.startswith("mysql"):
        pytest.importorskip("pymysql")
    done = cli(*REDIS_COMMANDS[command], "--store-url", url, cwd=here)
    line = one_line(done, command, "database: ", "Connection refused")
    assert "Redis" not in line, line
