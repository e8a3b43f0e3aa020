"""FastAPI's body parsing with `outbox.core.jsonbody`'s Unicode rule (FastAPI's documented
custom request and route class pattern): a router built with `route_class=JsonBodyRoute` reads
JSON bodies as the framework does, then refuses a lone surrogate in any string exactly as the
events path does, so none reaches a model, the store or an answer. NaN and Infinity are left
to the models, which answer them 422 `invalid_request` as before."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from outbox.core.jsonbody import refuse_lone_surrogates
from outbox.core.problems import Problem


class JsonBodyError(StarletteHTTPException):
    """A `Problem` raised while the framework parses a body: an HTTPException, because FastAPI
    passes those through its body parsing (it turns any other error into a bare 400); the
    app's handler answers with `problem`."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.status, problem.detail)
        self.problem = problem


class JsonBodyRequest(Request):
    """A request whose `json()` refuses strings that are not Unicode text."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            # As Starlette parses (a json.JSONDecodeError stays FastAPI's 422 json_invalid).
            document = json.loads(body)
            try:
                refuse_lone_surrogates(body, document)
            except Problem as problem:
                raise JsonBodyError(problem) from problem
            self._json = document
        return self._json


class JsonBodyRoute(APIRoute):
    """An endpoint whose JSON body is read by `JsonBodyRequest`: pass as `route_class` of a
    router whose endpoints take JSON bodies."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(JsonBodyRequest(request.scope, request.receive))

        return strict
