"""Typed reads of GGUF metadata (`GGUFFile.metadata`, key -> Python value): a value of the wrong type or out of range
is a one-line JaxinferError naming the key and what was expected vs found, never a TypeError deep in the model."""

import dataclasses
import math

from jaxinfer.errors import JaxinferError

REQUIRED = object()  # default of a key that must be present


@dataclasses.dataclass(frozen=True)
class LongArray:
    """Stands in `GGUFFile.metadata` for an array too long to decode up front (vocabularies, merges); read it with
    `GGUFFile.array`."""

    length: int


def describe(value) -> str:
    """A short account of a found value, for error messages."""
    if isinstance(value, LongArray):
        return f"an array of {value.length} items"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _lookup(meta: dict, key: str, default):
    if key in meta:
        return meta[key], True
    if default is REQUIRED:
        raise JaxinferError(f"GGUF metadata lacks {key}")
    return default, False


def integer(meta: dict, key: str, default=REQUIRED, minimum: int | None = None):
    """An integer-typed value (not a bool, float or string), at least `minimum`; `default` when absent."""
    value, present = _lookup(meta, key, default)
    if not present:
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise JaxinferError(f"GGUF metadata {key} must be an integer, found {describe(value)}")
    if minimum is not None and value < minimum:
        raise JaxinferError(f"GGUF metadata {key} must be >= {minimum}, found {value}")
    return value


def number(meta: dict, key: str, default=REQUIRED, positive: bool = False, finite: bool = True):
    """A float-typed value (as llama.cpp, not an integer's bits read as one), finite (and > 0 when `positive`);
    `default` when absent."""
    value, present = _lookup(meta, key, default)
    if not present:
        return value
    if not isinstance(value, float):
        raise JaxinferError(f"GGUF metadata {key} must be a float, found {describe(value)}")
    if finite and not math.isfinite(value):
        raise JaxinferError(f"GGUF metadata {key} must be finite, found {value}")
    if positive and not value > 0:
        raise JaxinferError(f"GGUF metadata {key} must be > 0, found {value}")
    return float(value)


def string(meta: dict, key: str, default=REQUIRED, choices=None):
    """A string-typed value, one of `choices` when given; `default` when absent."""
    value, present = _lookup(meta, key, default)
    if not present:
        return value
    if not isinstance(value, str):
        raise JaxinferError(f"GGUF metadata {key} must be a string, found {describe(value)}")
    if choices is not None and value not in choices:
        raise JaxinferError(f"GGUF metadata {key} is {value!r}, expected one of: {', '.join(sorted(choices))}")
    return value


def boolean(meta: dict, key: str, default=REQUIRED):
    value, present = _lookup(meta, key, default)
    if present and not isinstance(value, bool):
        raise JaxinferError(f"GGUF metadata {key} must be a bool, found {describe(value)}")
    return value
