"""Settings and routes-file keys: names, types and defaults from the pydantic models, what each
does from `descriptions.toml` (a test keeps the two in step)."""

from __future__ import annotations

import tomllib
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from outbox.core.actions import ActionSettings
from outbox.core.notify import NotifyTarget
from outbox.core.routes import Destination, Route
from outbox.core.settings import Settings
from outbox.core.sources import Source

DESCRIPTIONS = Path(__file__).with_name("descriptions.toml")

# Each section of descriptions.toml and the model whose fields it describes.
MODELS: dict[str, type[BaseModel]] = {
    "settings": Settings,
    "routes": Route,
    "destinations": Destination,
    "sources": Source,
    "notify": NotifyTarget,
}


def descriptions() -> dict[str, dict[str, str]]:
    """descriptions.toml as {section: {field: text}}."""
    with DESCRIPTIONS.open("rb") as file:
        return tomllib.load(file)


def own_fields(section: str) -> dict[str, FieldInfo]:
    """The fields a section documents: a destination's are its own (`name`); the acting keys it
    shares with routes are documented once, under routes."""
    model = MODELS[section]
    fields = dict(model.model_fields)
    if section == "destinations":
        own = set(model.__annotations__)
        return {k: v for k, v in fields.items() if k not in ActionSettings.model_fields or k in own}
    return fields


def missing_descriptions() -> list[str]:
    """`section.field` for every field without a description (empty when all are described)."""
    texts = descriptions()
    return [
        f"{section}.{name}"
        for section in MODELS
        for name in own_fields(section)
        if not texts.get(section, {}).get(name, "").strip()
    ]


def stale_descriptions() -> list[str]:
    """`section.key` for every description that names no field."""
    texts = descriptions()
    return [
        f"{section}.{name}"
        for section, entries in texts.items()
        if section != "errors"
        for name in entries
        if section not in MODELS or name not in own_fields(section)
    ]


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: `int`, `float`, `str`, `bool`, `path`, one of the
    allowed values, or `list of …`; `| none` when it may be unset."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        optional = " (optional)" if type(None) in args else ""
        return " or ".join(names) + optional
    if origin is typing.Literal:
        return " or ".join(f"`{value}`" for value in args)
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "table (string → string)"
    if annotation is SecretStr:
        return "str (secret)"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return " or ".join(f"`{member.value}`" for member in annotation)
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    """The default as the reader would write it; `required` when there is none."""
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "" or value == [] or value == {}:
        return "unset" if value == "" else "empty"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def table(section: str, name_of: Any = None) -> str:
    """The Markdown table of one section's fields, in the model's order."""
    texts = descriptions().get(section, {})
    rows = ["| name | type | default | description |", "|---|---|---|---|"]
    for name, field in own_fields(section).items():
        shown = name_of(name) if name_of else name
        rows.append(
            f"| `{shown}` | {cell(type_name(field.annotation))} | {cell(default_text(field))} "
            f"| {cell(texts.get(name, ''))} |"
        )
    return "\n".join(rows) + "\n"
