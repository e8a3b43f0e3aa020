"""FastAPI's body parsing, made `outbox.core.jsonbody.parse_json`'s (FastAPI's documented
custom request and route class pattern): a router built with `route_class=JsonBodyRoute` reads
JSON bodies under the same rules as the events path, so no lone surrogate, NaN or Infinity
reaches a model, the store or an answer."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from outbox.core import keys
from outbox.core.jsonbody import parse_json
from outbox.core.problems import Problem


class JsonBodyError(StarletteHTTPException):
    """A `Problem` raised while the framework parses a body: an HTTPException, because FastAPI
    passes those through its body parsing (it turns any other error into a bare 400); the
    app's handler answers with `problem`."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.status, problem.detail)
        self.problem = problem


class JsonBodyRequest(Request):
    """A request whose `json()` is `parse_json`'s: the same rules as the events path."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json(await self.body())
            except keys.NumberOutOfRange as error:
                # A model's own error for the same input would be 422 `invalid_request`.
                where = {"field": "(body)", "message": str(error), "type": "number_out_of_range"}
                problem = Problem(
                    422, "invalid_request", "The request is malformed.", errors=[where]
                )
                raise JsonBodyError(problem) from error
            except Problem as problem:
                raise JsonBodyError(problem) from problem
        return self._json


class JsonBodyRoute(APIRoute):
    """An endpoint whose JSON body is read by `JsonBodyRequest` (FastAPI's custom request
    class pattern): pass as `route_class` of a router whose endpoints take JSON bodies."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(JsonBodyRequest(request.scope, request.receive))

        return strict
