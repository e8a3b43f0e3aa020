"""Reading a request's JSON: the body parsed strictly, and RFC 6901 pointers into it.

The events and the providers' webhooks call `parse_json` on the bytes they read: NaN and
Infinity are not JSON, and every string (a value or an object's key) must be Unicode text.
The endpoints whose body the framework parses (the claims and operator APIs) apply the same
string rule through `outbox.core.jsonroute.JsonBodyRoute`.

Python's parser turns the escape `"\\ud800"` into a string holding a lone surrogate, which no
UTF-8 encoder (PostgreSQL's driver, the JSON answer, a log line) can write: left in, it fails
far from the request, as a 500. `refuse_lone_surrogates` answers 400 `invalid_unicode` instead,
with `errors[0].field` naming the member (`payload.name`, `items.0`).
"""

from __future__ import annotations

import json
from typing import Any

from outbox.core import keys
from outbox.core.problems import Problem

# A lone surrogate in a parsed string can only come from an escape `\uD800`..`\uDFFF` (the
# bytes are decoded as strict UTF-8, which refuses an encoded surrogate), and each of those
# starts with one of these. A body holding neither (nearly every body) needs no walk; the
# test is two byte searches, a few hundred nanoseconds on a body of kilobytes.
_ESCAPE_LOWER, _ESCAPE_UPPER = b"\\ud", b"\\uD"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes) -> Any:
    """The body's JSON document; NaN and Infinity are not JSON. 400 `invalid_json` otherwise,
    400 `invalid_unicode` for a string that is not Unicode text; `keys.NumberOutOfRange` (a
    number beyond a double) is left to the caller to answer."""
    try:
        document = json.loads(body, parse_constant=_reject_constant, parse_float=keys.finite_float)
    except keys.NumberOutOfRange:
        raise
    except (ValueError, RecursionError) as error:
        raise Problem(400, "invalid_json", "The body is not a JSON document.") from error
    refuse_lone_surrogates(body, document)
    return document


def refuse_lone_surrogates(body: bytes, document: Any) -> None:
    """Raise 400 `invalid_unicode` naming the first string (a value or a key) of `document`,
    parsed from `body`, that holds a lone surrogate. A loop, not recursion: the parser bounds
    the depth, not us."""
    if _ESCAPE_LOWER not in body and _ESCAPE_UPPER not in body:
        return
    pending: list[tuple[Any, tuple[str, ...]]] = [(document, ())]
    while pending:
        value, path = pending.pop()
        if isinstance(value, str):
            if not _is_text(value):
                raise _not_unicode(path, "value")
        elif isinstance(value, dict):
            items = list(value.items())
            for name, _ in items:
                if not _is_text(name):
                    raise _not_unicode((*path, name), "key")
            pending.extend((item, (*path, name)) for name, item in reversed(items))
        elif isinstance(value, list):
            pending.extend((item, (*path, str(i))) for i, item in reversed(list(enumerate(value))))


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_unicode(path: tuple[str, ...], what: str) -> Problem:
    # The path may hold the offending key itself: its surrogates become U+FFFD so the answer
    # (UTF-8 JSON) can carry it.
    field = "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in ".".join(path))
    message = f"this {what} is not Unicode text: it holds a lone surrogate (\\ud800-\\udfff)"
    return Problem(
        400,
        "invalid_unicode",
        "A string in the body is not Unicode text; nothing was stored.",
        errors=[{"field": field or "(body)", "message": message, "type": "lone_surrogate"}],
    )


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
