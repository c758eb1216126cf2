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

__all__ = ["GENESIS_HASH", "as_stored", "canonical", "chain_hash", "dumps", "loads"]

GENESIS_HASH = bytes(32)
"""The ``prev_hash`` of a stream's first event."""

_JSON_OPTIONS = orjson.OPT_SORT_KEYS


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


def canonical(value: Any) -> bytes:
    """The canonical JSON encoding of ``value`` as the hash chain sees it."""
    return orjson.dumps(_fold(value), option=_JSON_OPTIONS)


def as_stored(value: Any) -> Any:
    """``value`` as the log gives it back once stored as ``jsonb`` (see ``canonical``)."""
    return orjson.loads(canonical(value))


def chain_hash(prev_hash: bytes, body: dict[str, Any]) -> bytes:
    """SHA-256 over the previous hash followed by the canonical encoding of ``body``."""
    digest = hashlib.sha256(prev_hash)
    digest.update(canonical(body))
    return digest.digest()
