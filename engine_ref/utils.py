"""Small helpers shared across engine_ref: sizes and arithmetic."""

from __future__ import annotations

import re
from fractions import Fraction

from engine_ref.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, field: str = "size") -> int:
    """Parse "8GiB", "512MiB", "1.5GB" or a plain byte count into bytes.

    Raises ConfigError naming ``field`` when the string is not a size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field}={value!r} is not a size; write a byte count or a string such as '8GiB'.")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{field}={value} must be a positive number of bytes.")
        return value
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{field}={value!r} is not a size; write a number with a unit such as '8GiB', '512MiB' or '80GB' "
            f"(units: {', '.join(u for u in _UNITS if u)})."
        )
    size = int(Fraction(match.group(1)) * _UNITS[unit])  # exact: float loses bytes above 2**53
    if size <= 0:
        raise ConfigError(f"{field}={value!r} must be larger than zero.")
    return size


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.50 KiB'; binary units, two decimals."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; the callers validated divisibility, so a remainder is a bug."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)
