"""The `idem` commands, read from the typer application itself (click's view of it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer.main

from outbox.cli import app


@dataclass(frozen=True)
class Option:
    names: str
    help: str
    default: str


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    options: tuple[Option, ...]


def _option(param: Any) -> Option:
    """One parameter (typer ships its own click: its classes are read by their attributes)."""
    argument = param.param_type_name == "argument"
    if argument:
        names = f"`{(param.metavar or param.name).upper()}`"
    else:
        names = ", ".join(f"`{opt}`" for opt in [*param.opts, *param.secondary_opts])
    help_text = getattr(param, "help", None) or ""
    default = param.default
    shown = "" if default in (None, False, (), "") or callable(default) else f"`{default}`"
    return Option(names, help_text, shown)


def commands() -> list[Command]:
    """Every command of `idem`, sub-commands included (`idem dlq list`), in name order."""
    root = typer.main.get_command(app)
    found: list[Command] = []

    def walk(group: Any, prefix: str) -> None:
        if not hasattr(group, "commands"):
            return
        for name, sub in sorted(group.commands.items()):
            options = tuple(_option(p) for p in sub.params if p.name != "help")
            found.append(Command(f"{prefix} {name}", (sub.help or "").strip(), options))
            walk(sub, f"{prefix} {name}")

    walk(root, "idem")
    return found


def undocumented() -> list[str]:
    """Commands without a help text, and options without one (`idem stuck --limit`)."""
    gaps = []
    for command in commands():
        if not command.help:
            gaps.append(command.name)
        gaps += [f"{command.name} {o.names}" for o in command.options if not o.help.strip()]
    return gaps


def page() -> str:
    lines = [
        "# Commands",
        "",
        "Every `idem` command and its options, generated from the command line's own definitions",
        "(`outbox/cli.py`). Every command reads the [settings](settings.md) from the environment;",
        "`idem COMMAND --help` prints the same text.",
        "",
    ]
    for command in commands():
        lines += [f"## `{command.name}`", "", command.help.replace("\n\n", "\n\n"), ""]
        if command.options:
            lines += ["| option | default | |", "|---|---|---|"]
            for option in command.options:
                text = option.help.replace("|", "\\|").replace("\n", " ")
                lines.append(f"| {option.names} | {option.default} | {text} |")
            lines.append("")
    return "\n".join(lines)
