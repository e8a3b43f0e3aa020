"""07's Idem Trigger workflow a second time, for the cases of tests/n8n_e2e/trigger_cases.py:
published under its own path with a short lease, behind a route of its own that reads the
stored result's `task_id` as the external reference.

The short lease (8 s) lets a case see what happens when it runs out (the next delivery starts
on Look First) within seconds, and makes a repeat after each lease expiry show at once (an
execution that never completes its claim would run again every 8 s).
"""

from __future__ import annotations

import json
from typing import Any

LOOK_WORKFLOW_ID = "idemTriggerLook01"
LOOK_PATH = "idem-trigger-look"
LOOK_WEBHOOK_ID = "0e7a1c2b-4d5f-4a6b-8c9d-07f1257100ab"
LOOK_LEASE_SECONDS = 8
# The route `trigger-look` takes these event types.
LOOK_EVENT_TYPE = "look.lead.created"
# Where the route finds the downstream's reference in the answer's body (stored under
# "body"): the Idem Trigger answers the claim's result, Complete's `{task_id}` in 07.
LOOK_EXTERNAL_REF_POINTER = "/task_id"
LOOK_READ_TIMEOUT_SECONDS = 3


def look_workflow(example: dict[str, Any]) -> dict[str, Any]:
    """07 (already configured) under its own id, path, webhook id and an 8 s lease."""
    copy: dict[str, Any] = json.loads(json.dumps(example))
    copy["id"] = LOOK_WORKFLOW_ID
    copy["name"] = "idem trigger, short lease (n8n-e2e)"
    for node in copy["nodes"]:
        if node["type"] == "n8n-nodes-idem.idemTrigger":
            node["webhookId"] = LOOK_WEBHOOK_ID
            node["parameters"]["path"] = LOOK_PATH
            node["parameters"]["leaseSeconds"] = LOOK_LEASE_SECONDS
    return copy


def look_route(n8n_url: str, signing_secret: str) -> dict[str, Any]:
    """The route to the workflow as a user writes one (kind n8n, the trigger's signing
    secret, a read timeout shorter than a slow run, the external reference's pointer); only
    the connect timeout and the backoff cap are short, so the cases end within a minute."""
    return {
        "match": "look.*",
        "name": "trigger-look",
        "kind": "n8n",
        "action": "http",
        "url": f"{n8n_url}/webhook/{LOOK_PATH}",
        "signing_secret": signing_secret,
        "read_timeout_seconds": LOOK_READ_TIMEOUT_SECONDS,
        "connect_timeout_seconds": 1,
        "backoff_cap_seconds": 5,
        "external_ref_pointer": LOOK_EXTERNAL_REF_POINTER,
    }
