"""What of an action's result can be stored, and a note for what cannot.

A result is kept so that every later duplicate gets the first answer. The effect has already
happened when it is stored, so storing must never fail: a value that is not JSON, too large, or
holds what PostgreSQL refuses (NUL characters or lone surrogates in text or jsonb, numbers
beyond JSON) becomes what could be kept plus `result_dropped` saying why. The key still ends
`succeeded`; the action is never run again because of its result.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# A stored result is returned to every later duplicate and read by operators: 64 KiB holds any
# answer worth replaying, and keeps one row from growing the table by megabytes.
MAX_RESULT_BYTES = 65_536
# The external reference is an id, not a document.
MAX_REF_CHARS = 500


# What PostgreSQL's text and jsonb cannot hold: U+0000, and a UTF-16 surrogate on its own
# (JSON allows the escape "\ud800", which Python decodes to one; it has no UTF-8 form).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable_text(text: str) -> str:
    """`text` with every character PostgreSQL cannot hold replaced by U+FFFD."""
    return _UNSTORABLE.sub("\ufffd", text)


def _clean(value: Any) -> tuple[Any, bool]:
    """The value with NULs replaced and non-finite numbers dropped; whether it changed."""
    if isinstance(value, str):
        cleaned = storable_text(value)
        return cleaned, cleaned != value
    if isinstance(value, float) and not math.isfinite(value):
        return None, True
    if isinstance(value, dict):
        changed = False
        out: dict[str, Any] = {}
        for k, v in value.items():
            key = storable_text(str(k))
            out[key], item_changed = _clean(v)
            changed = changed or item_changed or key != k
        return out, changed
    if isinstance(value, list | tuple):
        items = [_clean(v) for v in value]
        return [v for v, _ in items], any(c for _, c in items)
    return value, False


def storable_result(value: Any) -> str:
    """The JSON text to store for `value`: the value itself, or what could be kept and why."""
    cleaned, changed = _clean(value)
    try:
        text = json.dumps(cleaned, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(
            {"result_dropped": f"the action returned a {type(value).__name__}, not JSON"}
        )
    size = len(text.encode())
    if size > MAX_RESULT_BYTES:
        return json.dumps(
            {"result_dropped": f"the result was {size} bytes; at most {MAX_RESULT_BYTES} are kept"}
        )
    if changed:
        return json.dumps(
            {
                "value": cleaned,
                "result_note": "NUL characters, lone surrogates or non-finite numbers replaced",
            },
            ensure_ascii=False,
        )
    return text


def storable_ref(ref: str | None) -> str | None:
    """The external reference as the text column can hold it."""
    return None if ref is None else storable_text(str(ref))[:MAX_REF_CHARS]
