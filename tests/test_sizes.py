"""Sizes on the command line: parsed exactly, binary and decimal units as the
ecosystem spells them, and the budget a plan was checked against shown in bytes."""

import doctest
import importlib
import subprocess
import sys
from fractions import Fraction

import pytest

from kvxfer._text import MAX_BYTES, parse_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize("unit,size", [
    ("KB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12), ("kB", 10**3),
    ("KiB", KiB), ("MiB", MiB), ("GiB", GiB), ("kib", KiB), ("gib", GiB), ("TiB", 1 << 40),
    ("K", KiB), ("M", MiB), ("G", GiB), ("k", KiB), ("m", MiB), ("g", GiB), ("T", 1 << 40),
    ("kb", KiB), ("mb", MiB), ("gb", GiB), ("Gb", GiB), ("B", 1), ("b", 1), ("", 1)])
def test_units_as_the_ecosystem_spells_them(unit, size):
    """KiB binary, KB decimal; a bare G (and docker's lowercase gb) binary, as
    ``-Xmx64g`` and ``docker --memory 64g`` / ``64gb`` read it."""
    assert parse_bytes(f"64{unit}") == 64 * size
    assert parse_bytes(f"64 {unit}") == 64 * size


def test_every_two_decimal_size_is_exact():
    """0.00 .. 99.99 in every unit: a decimal unit always gives whole bytes (2.01KB is
    2010, where float arithmetic refused about 3,000 such sizes); a binary one gives
    whole bytes exactly when the exact product is whole, and is refused otherwise."""
    wrong = []
    for hundredths in range(10_000):
        number = f"{hundredths // 100}.{hundredths % 100:02d}"
        for unit, size in (("KB", 10**3), ("MB", 10**6), ("GB", 10**9), ("KiB", KiB),
                           ("MiB", MiB), ("G", GiB), ("B", 1)):
            exact = Fraction(number) * size
            text = number + unit
            try:
                got = parse_bytes(text)
            except ValueError as e:
                if exact.denominator == 1 or text not in str(e):
                    wrong.append((text, str(e)))
                continue
            if exact.denominator != 1 or got != exact:
                wrong.append((text, got))
    assert wrong == []
    assert parse_bytes("2.01KB") == 2010 and parse_bytes("4.02KB") == 4020
    assert parse_bytes("8.03MB") == 8_030_000


@pytest.mark.parametrize("text,shown", [
    ("1.0000000000000001KiB", "1024.0000000000001024 bytes"), ("0.5", "0.5 bytes"),
    ("2.0001KB", "2000.1 bytes"), ("0.1B", "0.1 bytes"), ("1.001KiB", "1025.024 bytes")])
def test_a_fraction_of_a_byte_is_refused_naming_the_value(text, shown):
    with pytest.raises(ValueError, match=rf"'{text}' is {shown}, not a whole number of bytes"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["64XB", "64 GiBs", "1e9", "-5", "64GiB64", "", "nan",
                                  "١٢", "64 iB", "0x10"])
def test_not_a_size(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes(text)


def test_the_largest_size():
    assert parse_bytes("1024PiB") == MAX_BYTES
    with pytest.raises(ValueError, match="above"):
        parse_bytes("1024.000000000000000000001PiB")
    with pytest.raises(ValueError, match="above"):
        parse_bytes("1025P")


@pytest.mark.parametrize("name", ["kvxfer._text", "kvxfer._check"])
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0, result


@pytest.mark.parametrize("budget,bytes_", [("64G", 64 * GiB), ("64gb", 64 * GiB),
                                           ("64GB", 64 * 10**9), ("2.01KB", 2010)])
def test_a_plan_shows_its_budget_in_bytes_as_parsed(budget, bytes_):
    out = subprocess.run([sys.executable, "-m", "kvxfer", "plan", "--config", "tiny",
                          "--budget", budget], capture_output=True, text=True, timeout=120)
    assert f"({bytes_} bytes)" in out.stdout + out.stderr, out
    if out.returncode == 0:
        assert "budget: " in out.stdout
