"""Canonical JSON and the per-stream hash chain.

The hash of an event covers its identity, type, schema version, data and metadata encoded as
canonical JSON (sorted keys, no whitespace, UTF-8), chained to the previous event's hash.
PostgreSQL stores data as ``jsonb``, which keeps numbers as ``numeric`` and prints some of them
differently from how they were written (``1e16`` comes back as ``10000000000000000``, ``-0.0`` as
``0.0``). ``canonical`` folds those cases to the form jsonb gives back, so a hash computed before
the insert equals the hash recomputed from what the database returns.
"""

from __future__ import annotations

import decimal
import hashlib
import math
from typing import Any

import orjson

__all__ = [
    "GENESIS_HASH",
    "MAX_DEPTH",
    "as_stored",
    "canonical",
    "chain_hash",
    "dumps",
    "loads",
    "unstorable",
]

GENESIS_HASH = bytes(32)
"""The ``prev_hash`` of a stream's first event."""

_JSON_OPTIONS = orjson.OPT_SORT_KEYS

MAX_DEPTH = 128
"""How deeply a value the log stores may nest (the log adds a few levels around it; the encoder
stops at 254 and a deeper body than this is refused at intake)."""

_INT_RANGE = (-(2**63), 2**64 - 1)


def dumps(value: Any) -> bytes:
    """Encode ``value`` as JSON bytes (keys sorted, so equal values encode equally)."""
    return orjson.dumps(value, option=_JSON_OPTIONS)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def _fold_number(value: float) -> float | int | orjson.Fragment:
    if value == 0.0:
        return 0.0  # jsonb has no negative zero
    if value.is_integer() and abs(value) >= 1e16:
        # orjson writes these with an exponent; numeric prints every digit and it reads back an int.
        # The digits are those orjson wrote (the shortest repr), not the float's exact binary value
        # (int(7.405149907093126e17) is ...640, jsonb gives back ...600), and beyond 64 bits orjson
        # cannot encode an int, so the digits go in verbatim.
        digits = int(decimal.Decimal(repr(value)))
        if -(2**63) <= digits < 2**64:
            return digits
        return orjson.Fragment(str(digits).encode())
    return value


def _fold(value: Any) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("JSON cannot carry NaN or infinity")
        return _fold_number(value)
    if isinstance(value, dict):
        return {key: _fold(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_fold(item) for item in value]
    return value


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def unstorable(value: Any, max_depth: int = MAX_DEPTH) -> str | None:
    """Why ``value`` cannot be stored in the log as JSON (None when it can).

    The log refuses what PostgreSQL's ``jsonb`` or the hash chain cannot hold: NaN and infinity,
    a NUL character or a lone surrogate in a string or a key, a key that is not a string, an
    integer beyond 64 bits, anything that is not JSON (a set, an object), and nesting deeper
    than ``max_depth``.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            if "\x00" in item:
                return "a string holds a NUL character (\\u0000)"
            if not item.isascii() and not _utf8(item):
                return "a string holds a lone surrogate (not UTF-8)"
        elif isinstance(item, int):
            if not _INT_RANGE[0] <= item <= _INT_RANGE[1]:
                return "an integer is beyond 64 bits"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return "a number is NaN or infinite"
        elif isinstance(item, dict):
            if depth >= max_depth:
                return f"it nests deeper than {max_depth} levels"
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"a key is a {type(key).__name__}, not a string"
                if "\x00" in key or (not key.isascii() and not _utf8(key)):
                    return "a key holds a NUL character or a lone surrogate"
                stack.append((child, depth + 1))
        elif isinstance(item, (list, tuple)):
            if depth >= max_depth:
                return f"it nests deeper than {max_depth} levels"
            stack.extend((child, depth + 1) for child in item)
        else:
            return f"a value of type {type(item).__name__} is not JSON"
    return None


def canonical(value: Any) -> bytes:
    """The canonical JSON encoding of ``value`` as the hash chain sees it.

    Encoded as it is first: the fold (``_fold``, a walk of the whole value in Python, most of
    the cost) only changes what orjson writes as ``null`` (NaN and infinity, refused; None
    looks the same), ``-0.0`` or with an exponent ``e+`` (every float of 1e16 or more), so an
    encoding holding none of these is already canonical. A test holds both ways equal."""
    try:
        encoded = orjson.dumps(value, option=_JSON_OPTIONS)
    except orjson.JSONEncodeError:
        pass  # the fold says what is wrong (or makes it encodable: a float beyond 64 bits)
    else:
        if b"null" not in encoded and b"-0.0" not in encoded and b"e+" not in encoded:
            return encoded
    return orjson.dumps(_fold(value), option=_JSON_OPTIONS)


def as_stored(value: Any) -> Any:
    """``value`` as the log gives it back once stored as ``jsonb`` (see ``canonical``)."""
    return orjson.loads(canonical(value))


def chain_hash(prev_hash: bytes, body: dict[str, Any]) -> bytes:
    """SHA-256 over the previous hash followed by the canonical encoding of ``body``."""
    digest = hashlib.sha256(prev_hash)
    digest.update(canonical(body))
    return digest.digest()
