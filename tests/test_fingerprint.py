"""Fingerprints: RFC 8785 canonical JSON, the same in every process, refusing what has no JSON form."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import os
import subprocess
import sys
import textwrap
import uuid

import pydantic
import pytest

from dedupe_worker import Deduplicator, Outcome, idempotent
from dedupe_worker._protocol.fingerprint import canonical_json, canonical_number, fingerprint_of


@pytest.mark.parametrize(("number", "text"), [
    # ECMAScript String(x), as node prints it (RFC 8785 section 3.2.2.3)
    (1.0, "1"), (-0.0, "0"), (1e21, "1e+21"), (1e20, "100000000000000000000"), (1e-7, "1e-7"),
    (1e-6, "0.000001"), (123.456, "123.456"), (0.1, "0.1"), (5e-324, "5e-324"),
    (-1.7976931348623157e308, "-1.7976931348623157e+308"), (9007199254740992.0, "9007199254740992"),
    (2.0**68, "295147905179352830000"), (333333333.3333333, "333333333.3333333"), (4.35, "4.35"),
    (0.002, "0.002"), (-5e-7, "-5e-7"), (1.5e300, "1.5e+300"), (1e23, "1e+23"),
    # integers: every digit (never rounded through a double), laid out the same way
    (0, "0"), (-17, "-17"), (10**21, "1e+21"), (10**23, "1e+23"), (2**53 + 1, "9007199254740993"),
    (2**68, "295147905179352825856"),
    (decimal.Decimal("1.00"), "1"), (decimal.Decimal("-0.0"), "0"), (decimal.Decimal("2.50"), "2.5"),
])
def test_numbers_are_written_as_rfc_8785_numbers(number: float | int | decimal.Decimal, text: str) -> None:
    assert canonical_number(number) == text
    assert canonical_json([number]) == f"[{text}]".encode()


def test_equal_numbers_are_one_fingerprint_and_different_ones_are_not() -> None:
    assert fingerprint_of({"amount": 1.0}) == fingerprint_of({"amount": 1}) == fingerprint_of(
        {"amount": decimal.Decimal("1.000")})
    assert fingerprint_of([-0.0]) == fingerprint_of([0])
    assert fingerprint_of(10**21) == fingerprint_of(1e21)
    assert fingerprint_of(2**53 + 1) != fingerprint_of(2**53)  # large ids stay apart
    assert fingerprint_of(1) != fingerprint_of("1") != fingerprint_of(True)


def test_members_are_sorted_by_utf16_code_units() -> None:
    # RFC 8785 3.2.3: U+1F600 is D83D DE00 in UTF-16, so it sorts before U+FFFF
    assert canonical_json({"\uffff": 1, "\U0001f600": 2, "a": 3}) == (
        '{"a":3,"\U0001f600":2,"\uffff":1}'.encode())
    assert canonical_json({"b": 1, "a": "x\n\u001f\u007f"}) == b'{"a":"x\\n\\u001f\x7f","b":1}'


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Line:
    sku: str
    qty: float


class Order(pydantic.BaseModel):
    id: int
    total: float


def test_types_with_a_stable_form_are_written_as_documented() -> None:
    when = datetime.datetime(2026, 11, 24, 12, 0, tzinfo=datetime.timezone.utc)
    value = [Line("a", 2.0), Colour.RED, frozenset({"b", "a"}), when, uuid.UUID(int=1), b"\x00\xff", (1, 2),
             {3: "int key"}, Order(id=1, total=9.0)]
    assert canonical_json(value) == (
        b'[{"qty":2,"sku":"a"},"red",["a","b"],"2026-11-24T12:00:00+00:00",'
        + b'"00000000-0000-0000-0000-000000000001","AP8=",[1,2],{"3":"int key"},{"id":1,"total":9}]'
    )


class Widget:
    """A plain object: its only text would be a repr with a memory address."""


@pytest.mark.parametrize(("value", "named"), [
    (Widget(), "Widget"), ({"nested": [Widget()]}, "Widget"), (datetime.timedelta(seconds=1), "timedelta"),
    (float("nan"), "nan"), ({"x": float("inf")}, "inf"), (decimal.Decimal("NaN"), "NaN"),
    ({(1, 2): "tuple key"}, "tuple"), ({1: "a", "1": "b"}, "two keys"), (object, "type"),
])
def test_what_cannot_be_fingerprinted_raises_a_type_error_naming_it(value: object, named: str) -> None:
    with pytest.raises(TypeError, match=named):
        fingerprint_of(value)


def test_idempotent_refuses_an_argument_it_cannot_fingerprint(dedupe: Deduplicator) -> None:
    @idempotent(dedupe, key="w:{n}")
    def handle(n: int, widget: object) -> int:
        return n

    with pytest.raises(TypeError, match="Widget"):
        handle(1, Widget())
    assert handle(1, {"plain": 1.0}) == 1
    assert handle(1, {"plain": 1}) == 1  # 1.0 and 1 are one payload: a duplicate, not a conflict
    assert dedupe.begin("w:1").outcome is Outcome.DUPLICATE


_CHILD = textwrap.dedent("""
    import dataclasses, datetime, sys
    from dedupe_worker._protocol.fingerprint import fingerprint_of

    @dataclasses.dataclass
    class Line:
        sku: str
        qty: float

    class Widget:
        pass

    payload = {"lines": [Line("a", 1.0), Line("b", 2.5)], "tags": {"x", "y", "z", "w"},
               "at": datetime.date(2026, 11, 24), "n": 10**21}
    print(fingerprint_of(payload))
    try:
        print(fingerprint_of({"w": Widget()}))
    except TypeError as exc:
        print("TypeError:", exc)
""")


def test_a_payload_has_one_fingerprint_in_every_process() -> None:
    """Two interpreters with different hash seeds (set order differs) and different memory layouts
    (a repr would differ) agree; a plain object is refused in both instead of hashed by its repr."""
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60,
                              check=True)
        outputs.append(done.stdout.splitlines())
    assert outputs[0] == outputs[1]
    fingerprint, refused = outputs[0]
    assert len(fingerprint) == 32
    assert refused.startswith("TypeError:") and "Widget" in refused
