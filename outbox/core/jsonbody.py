"""Reading a request's JSON: the body parsed strictly, and RFC 6901 pointers into it."""

from __future__ import annotations

import json
from typing import Any

from outbox.core import keys
from outbox.core.problems import Problem


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes) -> Any:
    """The body's JSON document; NaN and Infinity are not JSON. 400 `invalid_json` otherwise;
    `keys.NumberOutOfRange` (a number beyond a double) is left to the caller to answer."""
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_float=keys.finite_float)
    except keys.NumberOutOfRange:
        raise
    except (ValueError, RecursionError) as error:
        raise Problem(400, "invalid_json", "The body is not a JSON document.") from error


def resolve_pointer(document: Any, pointer: str) -> Any:
    """RFC 6901: the value at `pointer` in `document`, or None when the path is absent."""
    if pointer == "":
        return document
    current = document
    for raw in pointer.removeprefix("/").split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(current, dict) and token in current:
            current = current[token]
        elif isinstance(current, list) and token.isdigit() and int(token) < len(current):
            current = current[int(token)]
        else:
            return None
    return current
