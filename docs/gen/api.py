"""The HTTP API, from the receiver's own OpenAPI schema (the one `/openapi.json` serves)."""

from __future__ import annotations

import logging
from typing import Any

from outbox.core.routes import RouteTable
from outbox.core.settings import Settings


def schema() -> dict[str, Any]:
    """The receiver's OpenAPI document, built without a database or broker (the app connects
    only when it starts serving)."""
    from outbox.app import create_app

    # Building the app warns about unset tokens: a deployment's concern, not the docs'.
    logging.disable(logging.WARNING)
    try:
        app = create_app(Settings(api_docs=True, claims_token="x" * 32), RouteTable([]))
        document: dict[str, Any] = app.openapi()
    finally:
        logging.disable(logging.NOTSET)
    return document


def page() -> str:
    document = schema()
    info = document.get("info", {})
    lines = [
        "# HTTP API",
        "",
        "Every endpoint of the receiver, generated from its OpenAPI schema "
        f"(OpenAPI {document.get('openapi', '')}, API version {info.get('version', '')}).",
        "With `API_DOCS=true` (the default under `idem dev`) the receiver serves the same schema",
        "at `/openapi.json` and Swagger UI at `/docs`. Errors are",
        "[problem documents](errors.md) with a machine-readable `error` code.",
        "",
        "| method | path | summary | answers |",
        "|---|---|---|---|",
    ]
    details: list[str] = []
    for path, operations in sorted(document.get("paths", {}).items()):
        for method, operation in operations.items():
            summary = operation.get("summary", "")
            answers = ", ".join(sorted(operation.get("responses", {})))
            lines.append(f"| `{method.upper()}` | `{path}` | {summary} | {answers} |")
            description = (operation.get("description") or "").strip()
            if description:
                details += [f"### `{method.upper()} {path}`", "", description, ""]
    if details:
        lines += ["", "## Endpoints", "", *details]
    return "\n".join(lines) + "\n"
