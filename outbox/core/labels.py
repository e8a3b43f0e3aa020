"""Labels a caller gives an event or a claim that later travel in HTTP headers and log lines:
`correlation_id`, `workflow`, `execution_id`.

They are checked once, at intake, so no later step meets a value it cannot send: an HTTP
client refuses a header with a non-ASCII character or a line break *locally* (httpx raises
before anything is sent), and a CR/LF in a header or a log line is an injection. A label is
printable ASCII (0x20-0x7E) with no space at either end: inner spaces are allowed, because
workflow names are written for people ("Lead intake") and a header value may hold them.
Control characters, CR/LF, tabs and anything outside ASCII are refused with a 422 whose
`errors[].type` is `label_not_visible_ascii` (or `label_too_long`) and whose `field` names
the member.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, StrictInt, StrictStr
from pydantic_core import PydanticCustomError

# Long enough for a UUID, an n8n execution id or a readable workflow name with a prefix;
# short enough to keep every header and log line small.
MAX_LABEL_CHARS = 200

_VISIBLE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


def check_label(value: str) -> str:
    """`value` when it may travel in a header; a pydantic error naming the rule otherwise."""
    if len(value) > MAX_LABEL_CHARS:
        raise PydanticCustomError(
            "label_too_long",
            "must be at most {limit} characters",
            {"limit": MAX_LABEL_CHARS},
        )
    if not _VISIBLE.fullmatch(value):
        raise PydanticCustomError(
            "label_not_visible_ascii",
            "must be printable ASCII (0x20-0x7E) with no space at either end: no control "
            "characters, line breaks or non-ASCII characters",
        )
    return value


def _check_label_or_number(value: str | int) -> str | int:
    return check_label(value) if isinstance(value, str) else value


Label = Annotated[StrictStr, AfterValidator(check_label)]
"""A correlation id or a workflow name."""

# Checked after the union is resolved, so a bad string is one error, not one per member.
LabelOrNumber = Annotated[StrictStr | StrictInt, AfterValidator(_check_label_or_number)]
"""An execution id: n8n sends a number or a string."""
