"""Small helpers shared across engine_ref: sizes, bounded JSON reading and arithmetic."""

from __future__ import annotations

import json
import os
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

from engine_ref.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "p": 1000**5, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
_SIZE_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
#: The largest size parse_size accepts: above any device's memory, far below what overflows an allocator.
MAX_SIZE_BYTES = 1024**5


def parse_size(value: str | int, field: str = "size") -> int:
    """Parse "8GiB", "512MiB", "1.5GB" or a plain byte count into bytes.

    Raises ConfigError naming ``field`` when the string is not a size, or the size is not in
    (0, MAX_SIZE_BYTES].
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field}={value!r} is not a size; write a byte count or a string such as '8GiB'.")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{field}={value} must be a positive number of bytes.")
        return _check_size_limit(value, value, field)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{field}={value!r} is not a size; write a number with a unit such as '8GiB', '512MiB' or '80GB' "
            f"(units: {', '.join(u for u in _UNITS if u)})."
        )
    size = int(Fraction(match.group(1)) * _UNITS[unit])  # exact: float loses bytes above 2**53
    if size <= 0:
        raise ConfigError(f"{field}={value!r} must be larger than zero; write a size such as '8GiB'.")
    return _check_size_limit(size, value, field)


def _check_size_limit(size: int, value: str | int, field: str) -> int:
    if size > MAX_SIZE_BYTES:
        raise ConfigError(f"{field}={value!r} is larger than any device ({size:.3g} bytes); "
                          f"write at most '1PiB' ({MAX_SIZE_BYTES} bytes).")
    return size


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def read_json(path: Path, *, max_bytes: int, max_depth: int, object_hook: Any = None) -> Any:
    """Parse a JSON file of at most ``max_bytes`` bytes nested at most ``max_depth`` deep.

    Raises ValueError, with a message saying why, for a file that is too large, not UTF-8, not
    JSON or nested too deeply (instead of the RecursionError ``json`` raises past ~1000 levels).
    OSError (a missing or unreadable file) propagates.
    """
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    try:
        value = json.loads(data.decode("utf-8"), object_hook=object_hook)
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    if json_depth(value) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return value


def json_depth(value: Any) -> int:
    """How deeply lists and dicts nest in a parsed JSON value (a scalar is 0), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in children)
    return depth


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
