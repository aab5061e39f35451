"""Typed reads of JSON request fields, each failure a 400 naming the field.

JSON `null` means "not given" for every optional field, as in the OpenAI API. Booleans are
never accepted where a number is expected (Python's `True == 1` would otherwise slip through).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

from services.common.errors import BadRequestError
from services.common.schema import INT64_MAX, INT64_MIN, Field, Kind

T = TypeVar("T")
__all__ = ["INT64_MAX", "INT64_MIN", "Fields", "invalid", "type_name"]


def type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
             int: "integer", float: "number"}
    return names.get(type(value), type(value).__name__)


def _int(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


def invalid(param: str, message: str) -> BadRequestError:
    return BadRequestError(f"Invalid value for '{param}': {message}", param=param)


class Fields:
    """A view of one JSON object (the body, or a nested object) with typed getters.

    `prefix` is prepended to param names in errors, e.g. "stream_options.".
    """

    def __init__(self, data: Mapping[str, Any], prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix

    def read(self, field: Field) -> Any:
        """The member `field` describes, checked as its table says (its default if absent)."""
        name, default, lo, hi = field.name, field.default, field.lo, field.hi
        if field.kind is Kind.BOOLEAN:
            return self.boolean(name, default)
        if field.kind is Kind.INTEGER:
            return self.integer(name, default, lo=_int(lo), hi=_int(hi))
        if field.kind is Kind.NUMBER:
            return self.number(name, default, lo=lo, hi=hi)
        if field.kind is Kind.STRING:
            return self.string(name, default)
        if field.kind is Kind.CHOICE:
            return self.choice(name, default, field.choices)
        if field.kind is Kind.STRINGS:
            return self.str_or_str_list(name)
        if field.kind is Kind.INTEGERS:
            return self.int_list(name, _int(lo) or 0, _int(hi) or INT64_MAX)
        if field.kind is Kind.OBJECT:
            return self.obj(name)
        return self._raw(name)

    def _raw(self, name: str) -> Any:
        return self.data.get(name)

    def param(self, name: str) -> str:
        return self.prefix + name

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def boolean(self, name: str, default: bool) -> bool:
        value = self._raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(self.param(name), f"expected a boolean, got {type_name(value)}")
        return value

    def integer(self, name: str, default: T, lo: int | None = None, hi: int | None = None) -> int | T:
        value = self._raw(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)  # 16.0 is an integer in JSON's eyes
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(self.param(name), f"expected an integer, got {type_name(value)}")
        self._check_range(name, value, lo, hi)
        return value

    def number(self, name: str, default: T, lo: float | None = None, hi: float | None = None) -> float | T:
        value = self._raw(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(self.param(name), f"expected a number, got {type_name(value)}")
        try:
            value = float(value)
        except OverflowError:
            raise invalid(self.param(name), "number out of range") from None
        if not math.isfinite(value):
            raise invalid(self.param(name), "expected a finite number")
        self._check_range(name, value, lo, hi)
        return value

    def string(self, name: str, default: T) -> str | T:
        value = self._raw(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise invalid(self.param(name), f"expected a string, got {type_name(value)}")
        return value

    def choice(self, name: str, default: T, allowed: tuple[str, ...]) -> str | T:
        value = self.string(name, default)
        if value is not default and value not in allowed:
            raise invalid(self.param(name), f"expected one of {', '.join(allowed)}, got {value!r}")
        return value

    def obj(self, name: str) -> Fields | None:
        value = self._raw(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid(self.param(name), f"expected an object, got {type_name(value)}")
        return Fields(value, prefix=f"{self.param(name)}.")

    def array(self, name: str) -> list[Any] | None:
        value = self._raw(name)
        if value is None:
            return None
        if not isinstance(value, list):
            raise invalid(self.param(name), f"expected an array, got {type_name(value)}")
        return value

    def str_or_str_list(self, name: str) -> tuple[str, ...]:
        """`stop`-style fields: a string, an array of strings, or null."""
        value = self._raw(name)
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,) if value else ()
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(v for v in value if v)
        raise invalid(self.param(name), "expected a string or an array of strings")

    def int_list(self, name: str, lo: int, hi: int) -> tuple[int, ...]:
        value = self.array(name)
        if value is None:
            return ()
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
                raise invalid(self.param(name), f"expected integers in [{lo}, {hi}]")
        return tuple(value)

    def _check_range(self, name: str, value: float, lo: float | None, hi: float | None) -> None:
        if lo is not None and value < lo:
            raise invalid(self.param(name), f"must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise invalid(self.param(name), f"must be <= {hi}, got {value}")
