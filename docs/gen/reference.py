"""The settings and routes-file reference pages."""

from __future__ import annotations

from docs.gen.models import table


def settings_page() -> str:
    return "\n".join(
        [
            "# Settings",
            "",
            "Every setting of the gateway, generated from its settings model",
            "(`outbox/core/settings.py`). Each is an environment variable, the upper-case name;",
            "every process reads them at start. Under `idem dev` the URLs of the embedded servers",
            "and an operator token are written to `.idem/env`, which every `idem` command run from",
            "the same folder reads for what the environment leaves unset.",
            "",
            table("settings", lambda name: name.upper()),
        ]
    )


def routes_page() -> str:
    return "\n".join(
        [
            "# Routes file",
            "",
            "Every key of the routes file (`ROUTES_FILE`, TOML), generated from its models",
            "(`outbox/core/routes.py`, `actions.py`, `sources.py`, `notify.py`). A key the models",
            "do not know stops the processes at start, naming it. How to write one:",
            "[Routes and protection](../how-to/routes.md).",
            "",
            "## `[[routes]]`",
            "",
            "Which events a route takes (`match`) and how it acts on them, or the destinations",
            "it fans out to (`fan_out`).",
            "",
            table("routes"),
            "## `[[destinations]]`",
            "",
            "A downstream that fan-out routes deliver to. Besides its name it takes every acting",
            "key of a route (`action`, `url`, retries, limits, circuit, lanes, …), not `match`,",
            "`ttl_days`, `sources`, the contract or `fan_out`.",
            "",
            table("destinations"),
            "## `[[sources]]`",
            "",
            "A webhook source that signs its requests, and where its events' id and type are when",
            "it posts to `/v1/webhooks/{name}`.",
            "",
            table("sources"),
            "## `[[notify]]`",
            "",
            "Where the sweeper tells people about dead letters, open circuits, pauses, stuck keys",
            "and blocked lanes.",
            "",
            table("notify"),
        ]
    )
