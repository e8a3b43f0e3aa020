"""Route contracts: what a payload must contain before any side effect is attempted.

An event that breaks its route's contract is still accepted (a 2xx stops the provider from
redelivering it forever) but quarantined: a dead letter of kind `quarantined`, no action. The
violations name fields and rules, never the values, which may be personal data.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from outbox.core.actions import ActionSettings
from outbox.core.routes import Route


@cache
def _validator(path: Path) -> Draft202012Validator:
    schema = json.loads(path.read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def violations(route: ActionSettings, payload: dict[str, Any]) -> list[str]:
    """Every way `payload` breaks the route's contract; empty when it keeps it. A destination
    has none of its own: its deliveries were checked against their route's at intake."""
    if not isinstance(route, Route):
        return []
    found = [
        f"missing required field {name!r}"
        for name in route.required_fields
        if payload.get(name) in (None, "")
    ]
    if route.schema_file is not None:
        for error in _validator(route.schema_file).iter_errors(payload):
            where = "/" + "/".join(str(part) for part in error.absolute_path)
            found.append(f"{where}: breaks schema rule {error.validator!r}")
    return found
