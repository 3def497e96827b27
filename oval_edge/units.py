"""Byte sizes as users write them ("1.5GiB", "800MB", 123456) and back."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, field: str = "size") -> int:
    """Return a byte count from an int or a string such as "1.5GiB" / "800MB" / "4G".

    Raises ValueError naming ``field`` and the accepted forms, so a config or CLI error says what to change.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is not a size; give bytes (e.g. 1610612736) or a string like '1.5GiB'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):  # int(inf) would raise OverflowError, int(nan) an unhelpful ValueError
            raise ValueError(f"{field}={value!r} is not a finite number of bytes; give e.g. 1610612736 or '1.5GiB'")
        if value <= 0:
            raise ValueError(f"{field}={value!r} must be > 0 bytes")
        return _at_least_one_byte(value, value, field)
    if not isinstance(value, str):
        raise ValueError(f"{field}={value!r} is not a size; give bytes or a string like '1.5GiB'")
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{field}={value!r} is not a size; use a number with an optional unit "
            f"(B, KB, MB, GB, KiB, MiB, GiB, e.g. '1.5GiB' or '800MB')"
        )
    number = float(match.group(1))
    if number <= 0:
        raise ValueError(f"{field}={value!r} must be > 0 bytes")
    return _at_least_one_byte(number * _UNITS[match.group(2).lower()], value, field)


def _at_least_one_byte(count: float, value, field: str) -> int:
    # "0.1B" or 0.5 would truncate to a zero-byte budget, which is never what the user meant.
    if count < 1:
        raise ValueError(f"{field}={value!r} is less than one byte; give a size of at least 1 byte")
    return int(count)


def format_bytes(n: int | float) -> str:
    """Human-readable binary size, e.g. 1610612736 -> '1.50 GiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
