"""A fuzz run of the HTTP API from its own OpenAPI schema: no 500s, nothing undocumented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from outbox.app import create_app
from outbox.core.routes import load_routes
from outbox.core.settings import Settings
from tests.support import AUTH, Stack


def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(
    stack: Stack, tmp_path: Path
) -> None:
    """Hundreds of generated requests (valid and invalid) against every operation, including
    the operator endpoints with the token and the provider webhook endpoint: no 5xx, and every
    status code, content type and body as the schema documents. The schema is the app's own
    (the stack serves none: API_DOCS is off in production)."""
    app = create_app(
        Settings(database_url=stack.database_url, broker_url=stack.broker_url),
        load_routes(stack.routes_file),
    )
    schema = tmp_path / "openapi.json"
    schema.write_text(json.dumps(app.openapi()), encoding="utf-8")
    checks = ",".join(
        [
            "not_a_server_error",
            "status_code_conformance",
            "content_type_conformance",
            "response_schema_conformance",
        ]
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            str(schema),
            "--url",
            stack.url,
            "--checks",
            checks,
            "--max-examples",
            "25",
            "--workers",
            "1",
            "--phases",
            "examples,fuzzing,stateful",
            "--seed",
            "20261130",
            "-H",
            f"Authorization: {AUTH['Authorization']}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    summary = run.stdout[-4000:]
    assert run.returncode == 0, summary
    assert " passed" in summary
    assert "POST /v1/webhooks/{source}" in run.stdout, summary
