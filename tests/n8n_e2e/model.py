"""A scripted OpenAI-compatible chat model: no real model, no key, the same answers every time.

n8n's OpenAI Chat Model node is pointed at it through the credential's Base URL. For every chat
it calls the agent's only tool twice with the same lead and date (the second time with a
reworded title, as a model retrying or repeating itself would), then answers with the tool's
last result. The turn is read from the request itself (how many tool results it carries), so
the server keeps no conversation state; it records what it was sent for the check to inspect.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Tool calls per chat: a call and its repeat, the repeat a duplicate the claim must absorb.
CALLS_PER_CHAT = 2
EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


@dataclass
class ScriptedModel:
    port: int = 0
    # Every chat-completions request body, in arrival order.
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        """The Base URL for n8n's OpenAI credential (the node appends /chat/completions)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()

    def tool_names(self) -> set[str]:
        """Every tool name n8n offered the model."""
        with self.lock:
            return {
                tool["function"]["name"]
                for request in self.requests
                for tool in request.get("tools") or []
            }

    def tool_results(self) -> list[dict[str, Any]]:
        """The tool results n8n sent back, parsed where they are JSON, from the last request."""
        with self.lock:
            last = self.requests[-1] if self.requests else {}
        results = []
        for message in last.get("messages", []):
            if message.get("role") == "tool":
                results.append(_parse_tool_content(message.get("content")))
        return results

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """The scripted assistant message for this request."""
        messages = request.get("messages", [])
        done = sum(1 for m in messages if m.get("role") == "tool")
        tools = request.get("tools") or []
        asked = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
        if done < CALLS_PER_CHAT and tools:
            email = EMAIL.search(asked)
            date = DATE.search(asked)
            arguments = {
                "lead_email": email.group(0) if email else "nobody@example.com",
                "due_date": date.group(0) if date else "2030-01-01",
                "title": "Call about the demo" if done == 0 else "Follow-up call: the demo",
            }
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{done + 1}",
                        "type": "function",
                        "function": {
                            "name": tools[0]["function"]["name"],
                            "arguments": json.dumps(arguments),
                        },
                    }
                ],
            }
        last = next((m for m in reversed(messages) if m.get("role") == "tool"), None)
        return {"role": "assistant", "content": f"Done. Tool said: {last and last.get('content')}"}

    def start(self) -> ScriptedModel:
        model = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    body = {"object": "list", "data": [{"id": "scripted", "object": "model"}]}
                    self._send(200, json.dumps(body).encode(), "application/json")
                else:
                    self._send(404, b"{}", "application/json")

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                request = json.loads(self.rfile.read(length) or b"{}")
                if not self.path.endswith("/chat/completions"):
                    self._send(404, b"{}", "application/json")
                    return
                with model.lock:
                    model.requests.append(request)
                message = model.answer(request)
                finish = "tool_calls" if message.get("tool_calls") else "stop"
                created = int(time.time())
                if request.get("stream"):
                    self._stream(request, message, finish, created)
                    return
                body = {
                    "id": f"chatcmpl-{len(model.requests)}",
                    "object": "chat.completion",
                    "created": created,
                    "model": request.get("model", "scripted"),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
                self._send(200, json.dumps(body).encode(), "application/json")

            def _stream(
                self, request: dict[str, Any], message: dict[str, Any], finish: str, created: int
            ) -> None:
                delta = dict(message)
                if delta.get("tool_calls"):
                    delta["tool_calls"] = [
                        {"index": i, **call} for i, call in enumerate(delta["tool_calls"])
                    ]
                chunks = [
                    {"index": 0, "delta": delta, "finish_reason": None},
                    {"index": 0, "delta": {}, "finish_reason": finish},
                ]
                lines = []
                for choice in chunks:
                    chunk = {
                        "id": "chatcmpl-stream",
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": request.get("model", "scripted"),
                        "choices": [choice],
                    }
                    lines.append(f"data: {json.dumps(chunk)}\n\n")
                lines.append("data: [DONE]\n\n")
                self._send(200, "".join(lines).encode(), "text/event-stream")

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _parse_tool_content(content: Any) -> dict[str, Any]:
    """A tool message's content as an object: n8n sends the sub-workflow's items as JSON text."""
    if isinstance(content, list):
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    try:
        value = json.loads(content) if isinstance(content, str) else content
    except json.JSONDecodeError:
        return {"text": content}
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, dict) else {"value": value}
