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


def _inputs(operation: dict[str, Any]) -> list[str]:
    """An operation's parameters and request body, as a reader needs them."""
    rows = []
    for parameter in operation.get("parameters", []):
        required = "required" if parameter.get("required") else "optional"
        text = (parameter.get("description") or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{parameter['name']}` | {parameter.get('in', '')} | {required} | {text} |")
    lines = []
    if rows:
        lines += ["| parameter | in | | |", "|---|---|---|---|", *rows, ""]
    body = operation.get("requestBody", {}).get("content", {})
    for media, content in body.items():
        ref = content.get("schema", {}).get("$ref", "")
        name = ref.rsplit("/", 1)[-1] if ref else "a JSON object"
        lines += [f"Request body: `{media}`, {f'`{name}`' if ref else name}.", ""]
    return lines


def _type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return str(prop["$ref"]).rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " or ".join(_type(option) for option in prop["anyOf"])
    if prop.get("type") == "array":
        return f"list of {_type(prop.get('items', {}))}"
    return str(prop.get("type", "any"))


def _schemas(document: dict[str, Any], names: list[str]) -> list[str]:
    """The request bodies' schemas: each member, its type, whether it is required."""
    schemas = document.get("components", {}).get("schemas", {})
    lines = ["## Request bodies", ""]
    for name in names:
        schema = schemas.get(name, {})
        required = set(schema.get("required", []))
        lines += [f"### `{name}`", ""]
        if schema.get("description"):
            lines += [schema["description"].strip(), ""]
        lines += ["| member | type | | |", "|---|---|---|---|"]
        for member, prop in schema.get("properties", {}).items():
            need = "required" if member in required else "optional"
            text = (prop.get("description") or "").replace("\n", " ").replace("|", "\\|")
            lines.append(f"| `{member}` | {_type(prop)} | {need} | {text} |")
        lines.append("")
    return lines


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
        "[problem documents](errors.md) with a machine-readable `error` code. `POST /v1/events`",
        "and `POST /v1/webhooks/{source}` read the body themselves: the event envelope and",
        "every answer are in [Send events](../how-to/send-events.md), the providers' in",
        "[Providers](../how-to/providers.md).",
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
            details += [f"### `{method.upper()} {path}`", ""]
            description = (operation.get("description") or "").strip()
            if description:
                details += [description, ""]
            details += _inputs(operation)
    if details:
        lines += ["", "## Endpoints", "", *details]
    bodies = sorted(
        {
            content["schema"]["$ref"].rsplit("/", 1)[-1]
            for operations in document.get("paths", {}).values()
            for operation in operations.values()
            for content in operation.get("requestBody", {}).get("content", {}).values()
            if "$ref" in content.get("schema", {})
        }
    )
    if bodies:
        lines += _schemas(document, bodies)
    return "\n".join(lines) + "\n"
