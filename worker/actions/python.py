"""`python`: call `package.module:function(ctx)` for custom side effects.

The function returns an `ActionResult`, a JSON-able value (stored as the result) or None; it
signals failures with `TransientError(retry_after=...)` or `PermanentError`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Any

from outbox.core.actions import ActionSettings
from worker.actions import ActionContext, ActionResult
from worker.errors import ActionError, PermanentError, TransientError


@cache
def _resolve(spec: str) -> Callable[[ActionContext], Any]:
    module_name, _, attribute = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise PermanentError("configuration", f"cannot load python action {spec!r}") from error
    if not callable(function):
        raise PermanentError("configuration", f"python action {spec!r} is not callable")
    return function  # type: ignore[no-any-return]


def run(route: ActionSettings, ctx: ActionContext) -> ActionResult:
    assert route.function is not None  # the routes file was validated
    function = _resolve(route.function)
    try:
        value = function(ctx)
    except ActionError:
        raise
    except Exception as error:
        # Only the type: an exception's message may quote the payload.
        detail = f"{route.function} raised {type(error).__name__}"
        if route.unexpected_error == "permanent":
            raise PermanentError("python_exception", detail, uncertain=True) from error
        # The function may have done its work before it raised: look before acting again.
        raise TransientError("python_exception", detail, uncertain=True) from error
    if isinstance(value, ActionResult):
        return value
    return ActionResult(result=value)
