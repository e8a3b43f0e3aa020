"""Static checks of the n8n example workflows in examples/n8n (no n8n, no database needed).

Gateway URLs are compared with the receiver's own OpenAPI paths; the app builds its engines
lazily, so building it contacts nothing.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "n8n"
DOC = ROOT / "docs" / "how-to" / "n8n.md"

POST_EVENT = "01-post-event.json"
CLAIM = "02-claim-side-effect.json"
AGENT_TOOL = "03-agent-tool.json"
WORKFLOWS = [POST_EVENT, CLAIM, AGENT_TOOL]
# The CRM follow-up with the Idem node (integrations/n8n-nodes-idem) instead of HTTP Request nodes.
NODE_CLAIM = "04-claim-with-idem-node.json"
# 04 with a Heartbeat, every lease field and Busy setting left at the node's defaults.
NODE_HEARTBEAT = "05-heartbeat-with-idem-node.json"
# 01 with the node's Send Event, its payload left at the default (the webhook's body).
NODE_SEND_EVENT = "06-send-event-with-idem-node.json"
# The Idem Trigger (one execution per gateway key) -> CRM -> the node's Complete.
NODE_TRIGGER = "07-idem-trigger.json"
NODE_CLAIMS = [NODE_CLAIM, NODE_HEARTBEAT]
NODE_WORKFLOWS = [*NODE_CLAIMS, NODE_SEND_EVENT, NODE_TRIGGER]
# The gateway's lane route delivers a contact's updates in order: Webhook -> CRM -> answer.
LANE_CONTACTS = "09-ordered-contact-updates.json"
# One destination of a fan-out route: a Stripe invoice.paid booked in the ledger, then answered.
FAN_OUT_FINANCE = "10-fan-out-invoice-paid.json"
EVERY_WORKFLOW = [*WORKFLOWS, *NODE_WORKFLOWS, LANE_CONTACTS, FAN_OUT_FINANCE]
IDEM_NODE = "n8n-nodes-idem.idem"
IDEM_NODE_SOURCE = ROOT / "integrations" / "n8n-nodes-idem" / "nodes" / "Idem" / "Idem.node.ts"

HTTP_REQUEST = "n8n-nodes-base.httpRequest"
IF_NODE = "n8n-nodes-base.if"
# Header names a workflow may send to the gateway (compared case-insensitively, as HTTP does).
GATEWAY_HEADERS = {
    "idempotency-key",
    "content-type",
    "x-idem-signature",
    "x-idem-timestamp",
    "authorization",
    "x-correlation-id",
}
EXPRESSION = re.compile(r"\{\{.*?\}\}", re.DOTALL)
NODE_REFERENCE = re.compile(r"""\$\(\s*(['"])(.+?)\1\s*\)""")
PLACEHOLDER = "{}"


def load(name: str) -> dict[str, Any]:
    data = json.loads((EXAMPLES / name).read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def nodes(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    result = workflow["nodes"]
    assert isinstance(result, list)
    return result


def by_name(workflow: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {node["name"]: node for node in nodes(workflow)}


def gateway_requests(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    """HTTP Request nodes whose URL targets the gateway (its paths all start with /v1/)."""
    return [
        node
        for node in nodes(workflow)
        if node["type"] == HTTP_REQUEST and "/v1/" in str(node["parameters"].get("url", ""))
    ]


def url_path(url: str) -> str:
    """The gateway path of an n8n URL, each ``{{ expression }}`` made a ``{}`` placeholder."""
    text = url.removeprefix("=")
    start = text.index("/v1/")
    # Placeholders first: an expression may itself contain '?' or '/'.
    path = EXPRESSION.sub(PLACEHOLDER, text[start:])
    return path.split("?", 1)[0].split("#", 1)[0]


def _segments(path: str) -> list[str]:
    return path.strip("/").split("/")


def path_matches(path: str, template: str) -> bool:
    """Whether a normalised URL path fits an OpenAPI path template segment by segment.

    A placeholder in the URL matches only a ``{param}`` of the template; literals must be equal.
    """
    ours, theirs = _segments(path), _segments(template)
    if len(ours) != len(theirs):
        return False
    for mine, other in zip(ours, theirs, strict=True):
        is_param = other.startswith("{") and other.endswith("}")
        if PLACEHOLDER in mine or is_param:
            if not (PLACEHOLDER in mine and is_param):
                return False
        elif mine != other:
            return False
    return True


def method(node: dict[str, Any]) -> str:
    return str(node["parameters"].get("method", "GET")).upper()


def routes(workflow: dict[str, Any]) -> set[tuple[str, str]]:
    """(method, normalised path) of every gateway request in the workflow."""
    return {
        (method(node), url_path(node["parameters"]["url"])) for node in gateway_requests(workflow)
    }


def header_names(node: dict[str, Any]) -> list[str]:
    params = node["parameters"]
    if not params.get("sendHeaders"):
        return []
    return [str(h["name"]) for h in params.get("headerParameters", {}).get("parameters", [])]


def response_options(node: dict[str, Any]) -> dict[str, Any]:
    options = node["parameters"].get("options", {})
    response = options.get("response", {}).get("response", {})
    assert isinstance(response, dict)
    return response


def edges(workflow: dict[str, Any]) -> list[tuple[str, str, str, int, str]]:
    """(source, kind, target, source output index, edge type) of every connection."""
    result = []
    for source, kinds in workflow["connections"].items():
        for kind, outputs in kinds.items():
            for index, output in enumerate(outputs):
                for edge in output:
                    result.append((source, kind, edge["node"], index, edge["type"]))
    return result


def strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in strings(item)]
    return []


def assignment(node: dict[str, Any], name: str) -> str:
    """The value a Set node assigns to `name`."""
    found = [a for a in node["parameters"]["assignments"]["assignments"] if a["name"] == name]
    assert len(found) == 1, (node["name"], name)
    return str(found[0]["value"])


def targets(workflow: dict[str, Any], source: str, output: int) -> list[str]:
    """The nodes a node's main output number `output` leads to."""
    return [t for s, k, t, i, _ in edges(workflow) if s == source and k == "main" and i == output]


def conditions(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = node["parameters"]["conditions"]["conditions"]
    assert isinstance(found, list)
    return found


@cache
def openapi_paths() -> dict[str, dict[str, Any]]:
    from outbox.app import create_app
    from outbox.core.settings import Settings

    app = create_app(
        Settings(
            database_url="postgresql+psycopg://x@127.0.0.1/x",
            redis_url="redis://127.0.0.1:1/0",
        )
    )
    paths = app.openapi()["paths"]
    assert isinstance(paths, dict)
    return paths


# ------------------------------------------------------------------------------ the helpers


def test_url_path_turns_expressions_into_placeholders() -> None:
    """An n8n URL loses its base-URL expression and each {{ }} segment becomes a placeholder."""
    url = (
        "={{ $('Config').item.json.IDEM_URL }}/v1/claims/"
        "{{ encodeURIComponent($json.key) }}/complete?x={{ 1 }}"
    )
    assert url_path(url) == "/v1/claims/{}/complete"
    assert path_matches("/v1/claims/{}/complete", "/v1/claims/{key}/complete")
    assert not path_matches("/v1/claims/{}/complete", "/v1/claims/{key}/fail")
    assert not path_matches("/v1/claims/complete", "/v1/claims/{key}")
    assert not path_matches("/v1/events/{}", "/v1/events")


# ------------------------------------------------------------------------------ every workflow


@pytest.mark.parametrize("name", EVERY_WORKFLOW)
def test_workflow_is_an_importable_json_object(name: str) -> None:
    """The file is valid JSON with name, nodes, connections, v1 execution order and no pinData."""
    workflow = load(name)
    assert isinstance(workflow["name"], str) and workflow["name"]
    assert isinstance(workflow["nodes"], list) and workflow["nodes"]
    assert isinstance(workflow["connections"], dict)
    assert workflow["settings"] == {"executionOrder": "v1"}
    assert workflow["pinData"] == {}


@pytest.mark.parametrize("name", EVERY_WORKFLOW)
def test_nodes_have_the_exported_members(name: str) -> None:
    """Every node has id, name, type, typeVersion, a two-number position and a parameters dict."""
    for node in nodes(load(name)):
        label = node.get("name", node)
        assert isinstance(node.get("id"), str) and node["id"], label
        assert isinstance(node.get("name"), str) and node["name"], label
        assert isinstance(node.get("type"), str) and "." in node["type"], label
        assert isinstance(node.get("typeVersion"), int | float), label
        position = node.get("position")
        assert isinstance(position, list) and len(position) == 2, label
        assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in position)
        assert isinstance(node.get("parameters"), dict), label


@pytest.mark.parametrize("name", EVERY_WORKFLOW)
def test_node_names_and_ids_are_unique(name: str) -> None:
    """No two nodes share a name (connections are keyed by name) or an id."""
    all_nodes = nodes(load(name))
    names = [node["name"] for node in all_nodes]
    ids = [node["id"] for node in all_nodes]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name", EVERY_WORKFLOW)
def test_connections_name_existing_nodes(name: str) -> None:
    """Every connection's source and target is a node of the workflow, with a matching type."""
    workflow = load(name)
    names = set(by_name(workflow))
    found = edges(workflow)
    assert found
    for source, kind, target, _, edge_type in found:
        assert source in names, f"connection from unknown node {source!r}"
        assert target in names, f"connection from {source!r} to unknown node {target!r}"
        assert edge_type == kind, (source, target)


@pytest.mark.parametrize("name", EVERY_WORKFLOW)
def test_every_non_note_node_is_connected(name: str) -> None:
    """No node except sticky notes is left dangling outside the graph."""
    workflow = load(name)
    touched = {s for s, *_ in edges(workflow)} | {t for _, _, t, *_ in edges(workflow)}
    loose = [
        node["name"]
        for node in nodes(workflow)
        if node["type"] != "n8n-nodes-base.stickyNote" and node["name"] not in touched
    ]
    assert loose == []


@pytest.mark.parametrize("name", EVERY_WORKFLOW)
def test_expressions_are_marked_and_reference_existing_nodes(name: str) -> None:
    """A parameter using {{ }} starts with '=' (or n8n sends it literally); $('X') names a node."""
    workflow = load(name)
    names = set(by_name(workflow))
    for node in nodes(workflow):
        if node["type"] == "n8n-nodes-base.stickyNote":
            continue
        for text in strings(node["parameters"]):
            if "{{" in text:
                assert text.startswith("="), (node["name"], text)
            for _, referenced in NODE_REFERENCE.findall(text):
                assert referenced in names, (node["name"], referenced)


@pytest.mark.parametrize("name", EVERY_WORKFLOW)
def test_if_nodes_use_the_v2_condition_shape(name: str) -> None:
    """IF nodes are typeVersion 2 with typed conditions joined by and/or and two outputs at most."""
    workflow = load(name)
    outputs = {s: kinds for s, kinds in workflow["connections"].items()}
    for node in nodes(workflow):
        if node["type"] != IF_NODE:
            continue
        assert node["typeVersion"] == 2, node["name"]
        assert node["parameters"]["conditions"]["combinator"] in {"and", "or"}
        for condition in conditions(node):
            assert {"id", "leftValue", "rightValue", "operator"} <= set(condition)
            assert {"type", "operation"} <= set(condition["operator"])
            assert str(condition["leftValue"]).startswith("=")
        assert len(outputs.get(node["name"], {}).get("main", [])) <= 2, node["name"]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_gateway_paths_exist_in_the_api(name: str) -> None:
    """Every gateway URL (with /v1/) matches an OpenAPI path of the receiver, method included."""
    paths = openapi_paths()
    requests = gateway_requests(load(name))
    assert requests
    for node in requests:
        path = url_path(node["parameters"]["url"])
        templates = [t for t in paths if path_matches(path, t)]
        assert templates, f"{node['name']}: {path} is not an API path; API has {sorted(paths)}"
        allowed = {m.upper() for t in templates for m in paths[t]}
        assert method(node) in allowed, f"{node['name']}: {method(node)} {path} not in {allowed}"


@pytest.mark.parametrize("name", WORKFLOWS)
def test_gateway_header_names_are_known(name: str) -> None:
    """Headers sent to the gateway are ones it knows: Idempotency-Key, Content-Type, signing."""
    for node in gateway_requests(load(name)):
        for header in header_names(node):
            assert header.lower() in GATEWAY_HEADERS, (node["name"], header)


@pytest.mark.parametrize("name", WORKFLOWS)
def test_gateway_requests_never_error_and_retry_transport_errors_only(name: str) -> None:
    """Gateway calls return every status to an IF (Never Error, full response) and retry on fail."""
    workflow = load(name)
    targets: dict[str, set[str]] = {}
    for source, kind, target, _, _ in edges(workflow):
        if kind == "main":
            targets.setdefault(source, set()).add(target)
    types = {n["name"]: n["type"] for n in nodes(workflow)}
    for node in gateway_requests(workflow):
        assert node["parameters"].get("contentType", "json") == "json", (
            f"{node['name']}: a raw body comes back as an unparsed stream with Response Format JSON"
        )
        response = response_options(node)
        assert response.get("neverError") is True, node["name"]
        assert response.get("fullResponse") is True, node["name"]
        # Autodetect parses only application/json; the gateway's problem+json must parse too.
        assert response.get("responseFormat") == "json", node["name"]
        assert node.get("retryOnFail") is True, node["name"]
        assert 1 < int(node.get("maxTries", 3)) <= 5, node["name"]
        assert int(node.get("waitBetweenTries", 1000)) <= 5000, node["name"]
        if node["parameters"].get("sendBody"):
            assert node["parameters"].get("specifyBody") == "json", node["name"]
            assert "Content-Type" in header_names(node), node["name"]
        assert targets.get(node["name"]), f"{node['name']} must lead somewhere"
        # The answer is inspected: straight into an IF, or into a node that reads its status.
        for target in targets[node["name"]]:
            assert types[target] in {
                IF_NODE,
                "n8n-nodes-base.respondToWebhook",
                "n8n-nodes-base.set",
            }, (node["name"], target)


@pytest.mark.parametrize("name", EVERY_WORKFLOW)
def test_workflow_has_an_id_to_publish(name: str) -> None:
    """Each file carries a workflow id: `n8n publish:workflow --id` needs one after importing."""
    workflow_id = load(name).get("id")
    assert isinstance(workflow_id, str) and re.fullmatch(r"[A-Za-z0-9]{16}", workflow_id)


@pytest.mark.parametrize("name", WORKFLOWS)
def test_unreachable_gateway_is_answered_not_dropped(name: str) -> None:
    """A gateway call's error output (transport error after Retry On Fail) leads to an answer:
    503 with Retry-After for a webhook, a Set node (the tool's answer) for the agent."""
    workflow = load(name)
    named = by_name(workflow)
    for node in gateway_requests(workflow):
        assert node.get("onError") == "continueErrorOutput", node["name"]
        (handler,) = targets(workflow, node["name"], 1)
        if named[handler]["type"] == "n8n-nodes-base.set":
            assert name == AGENT_TOOL, node["name"]
            continue
        options = named[handler]["parameters"]["options"]
        assert named[handler]["type"] == "n8n-nodes-base.respondToWebhook", node["name"]
        assert options["responseCode"] == 503, node["name"]
        headers = {h["name"] for h in options["responseHeaders"]["entries"]}
        assert "Retry-After" in headers, node["name"]


@pytest.mark.parametrize("name", [CLAIM, AGENT_TOOL])
def test_claims_calls_send_the_bearer_token_from_a_credential(name: str) -> None:
    """Every /v1/claims call authenticates with an HTTP Bearer credential (CLAIMS_TOKEN)."""
    for node in gateway_requests(load(name)):
        params = node["parameters"]
        assert params["authentication"] == "genericCredentialType", node["name"]
        assert params["genericAuthType"] == "httpBearerAuth", node["name"]
        assert set(node["credentials"]) == {"httpBearerAuth"}, node["name"]


@pytest.mark.parametrize("name", [CLAIM, AGENT_TOOL])
def test_uncertain_claim_looks_the_task_up_before_creating(name: str) -> None:
    """`uncertain: true` leads to the CRM lookup; found completes, only 404 creates, and any other
    lookup answer fails the claim instead of risking a second task."""
    workflow = load(name)
    named = by_name(workflow)
    assert targets(workflow, "Claimed?", 0) == ["Uncertain?"]
    (condition,) = conditions(named["Uncertain?"])
    assert "body.uncertain === true" in condition["leftValue"]
    assert targets(workflow, "Uncertain?", 0) == ["CRM: find task"]
    assert targets(workflow, "Uncertain?", 1) == ["CRM: create follow-up task"]
    assert targets(workflow, "CRM: find task", 0) == ["Found in CRM?"]
    assert targets(workflow, "Found in CRM?", 0) == ["Task reference"]
    assert targets(workflow, "Found in CRM?", 1) == ["Not in CRM?"]
    assert {c["rightValue"] for c in conditions(named["Not in CRM?"])} == {404}
    assert targets(workflow, "Not in CRM?", 0) == ["CRM: create follow-up task"]
    assert targets(workflow, "Not in CRM?", 1) == ["Classify CRM error"]


@pytest.mark.parametrize("name", [CLAIM, AGENT_TOOL])
def test_fail_declares_whether_the_effect_may_have_happened(name: str) -> None:
    """`/fail` sends `effect`: "none" only for a CRM 4xx refusal, else "unknown"."""
    named = by_name(load(name))
    effect = assignment(named["Classify CRM error"], "effect")
    assert "'none'" in effect and "'unknown'" in effect
    assert "statusCode >= 400" in effect and "statusCode < 500" in effect
    assert "effect: $json.effect" in named["idem: fail"]["parameters"]["jsonBody"]


# ------------------------------------------------------------------------------ (a) post event


def test_post_event_sends_the_provider_event_id_as_idempotency_key() -> None:
    """The webhook's event id is the Idempotency-Key of a POST /v1/events with a JSON envelope."""
    workflow = load(POST_EVENT)
    types = {node["type"] for node in nodes(workflow)}
    assert "n8n-nodes-base.webhook" in types
    webhook = next(n for n in nodes(workflow) if n["type"] == "n8n-nodes-base.webhook")
    assert webhook["typeVersion"] == 2
    assert webhook["parameters"]["responseMode"] == "responseNode"
    (post,) = gateway_requests(workflow)
    assert (method(post), url_path(post["parameters"]["url"])) == ("POST", "/v1/events")
    headers = {h["name"]: h["value"] for h in post["parameters"]["headerParameters"]["parameters"]}
    assert headers["Idempotency-Key"] == "={{ $json.key }}"
    assert "body.id" in assignment(by_name(workflow)["Signed body"], "key")
    # The envelope is built once as text, signed, and sent as that very text.
    assert post["parameters"]["jsonBody"] == "={{ $json.body_text }}"
    envelope = assignment(by_name(workflow)["Signed body"], "body_text")
    for member in ("source", "event_type", "external_id", "payload", "workflow", "execution_id"):
        assert f"{member}:" in envelope, member


def test_post_event_signs_the_body_it_sends() -> None:
    """Crypto 2 HMACs "<ts>.<body_text>" with a credential; the POST sends both signing headers."""
    workflow = load(POST_EVENT)
    named = by_name(workflow)
    sign = named["Sign"]
    assert (sign["type"], sign["typeVersion"]) == ("n8n-nodes-base.crypto", 2)
    assert set(sign["credentials"]) == {"crypto"}
    params = sign["parameters"]
    assert (params["action"], params["type"], params["encoding"]) == ("hmac", "SHA256", "hex")
    # v2: the Idempotency-Key is signed too (a v1 signature with a key is refused).
    assert params["value"] == "={{ $json.ts }}.{{ $json.key }}.{{ $json.body_text }}"
    assert assignment(named["Signed body"], "key") == "={{ $json.SOURCE }}:{{ $json.body.id }}"
    (post,) = gateway_requests(workflow)
    headers = {h["name"]: h["value"] for h in post["parameters"]["headerParameters"]["parameters"]}
    assert headers["Idempotency-Key"] == "={{ $json.key }}"
    assert headers["X-Idem-Timestamp"] == "={{ $json.ts }}"
    assert headers["X-Idem-Signature"] == "=v2={{ $json.signature }}"
    path = [s for s, _, t, _, _ in edges(workflow) if t in {"Sign", post["name"]}]
    assert path == ["Signed body", "Sign"]


def test_post_event_has_retry_on_fail_and_never_error() -> None:
    """The event POST retries transport errors and hands every HTTP status to the workflow."""
    (post,) = gateway_requests(load(POST_EVENT))
    assert post["retryOnFail"] is True
    assert response_options(post) == {
        "fullResponse": True,
        "neverError": True,
        "responseFormat": "json",
    }


def test_post_event_branches_on_status_and_answers_problems() -> None:
    """An IF on statusCode 200/202 continues; the other branch answers the caller the status."""
    workflow = load(POST_EVENT)
    named = by_name(workflow)
    (post,) = gateway_requests(workflow)
    (first,) = targets(workflow, post["name"], 0)
    check = named[first]
    assert check["type"] == IF_NODE
    assert check["parameters"]["conditions"]["combinator"] == "or"
    expected = {200, 202}
    assert {c["rightValue"] for c in conditions(check)} == expected
    assert all("statusCode" in c["leftValue"] for c in conditions(check))
    # Follow the false output: every path ends in a Respond to Webhook passing the status through.
    false_targets = [t for s, _, t, i, _ in edges(workflow) if s == first and i == 1]
    assert false_targets
    reached: set[str] = set()
    todo = list(false_targets)
    while todo:
        current = todo.pop()
        if current in reached:
            continue
        reached.add(current)
        todo += [t for s, _, t, _, _ in edges(workflow) if s == current]
    responders = [named[n] for n in reached if named[n]["type"].endswith("respondToWebhook")]
    assert responders
    codes = " ".join(str(r["parameters"]["options"]["responseCode"]) for r in responders)
    assert "statusCode" in codes
    assert any(
        h["name"] == "Retry-After"
        for r in responders
        for h in r["parameters"]["options"].get("responseHeaders", {}).get("entries", [])
    )


# ------------------------------------------------------------------------------ (b) claim


def test_claim_workflow_claims_and_completes() -> None:
    """The claim workflow posts to /v1/claims and to /v1/claims/{key}/complete and /fail."""
    found = routes(load(CLAIM))
    assert ("POST", "/v1/claims") in found
    assert ("POST", "/v1/claims/{}/complete") in found
    assert ("POST", "/v1/claims/{}/fail") in found


def test_claim_workflow_branches_on_every_claim_answer() -> None:
    """201 claimed, 200 already_succeeded and 409 in_progress each have a branch; 409 waits."""
    workflow = load(CLAIM)
    rights = {
        str(c["rightValue"]) for n in nodes(workflow) if n["type"] == IF_NODE for c in conditions(n)
    }
    assert {"201", "200", "already_succeeded", "409"} <= rights
    assert any(n["type"] == "n8n-nodes-base.wait" for n in nodes(workflow))
    text = json.dumps(workflow)
    assert "lease_token" in text
    assert "uncertain" in text
    assert "retryable" in text


def test_claim_workflow_sends_the_claim_key_to_the_crm() -> None:
    """The CRM call carries the claim key as Idempotency-Key and its failure is classified."""
    named = by_name(load(CLAIM))
    crm = named["CRM: create follow-up task"]
    assert "/v1/" not in crm["parameters"]["url"]
    headers = {h["name"]: h["value"] for h in crm["parameters"]["headerParameters"]["parameters"]}
    assert "CLAIM_KEY" in headers["Idempotency-Key"]
    retryable = next(
        a["value"]
        for a in named["Classify CRM error"]["parameters"]["assignments"]["assignments"]
        if a["name"] == "retryable"
    )
    assert ">= 500" in retryable and "429" in retryable


# ------------------------------------------------------------------------------ (c) agent tool


def test_agent_tool_is_a_claimed_sub_workflow() -> None:
    """An agent's tool runs a sub-workflow that claims first and accepts a stored result."""
    workflow = load(AGENT_TOOL)
    types = {node["type"] for node in nodes(workflow)}
    assert "@n8n/n8n-nodes-langchain.toolWorkflow" in types
    assert "n8n-nodes-base.executeWorkflowTrigger" in types
    tool_edges = [e for e in edges(workflow) if e[1] == "ai_tool"]
    assert tool_edges
    named = by_name(workflow)
    assert all(named[t]["type"] == "@n8n/n8n-nodes-langchain.agent" for _, _, t, _, _ in tool_edges)
    found = routes(workflow)
    assert ("POST", "/v1/claims") in found
    assert ("POST", "/v1/claims/{}/complete") in found
    stored = named["Use stored result"]
    assert all(named[s]["type"].endswith("toolWorkflow") for s, *_ in tool_edges)
    values = {a["name"]: a["value"] for a in stored["parameters"]["assignments"]["assignments"]}
    assert values["status"] == "already_succeeded"
    assert "body.result" in values["result"]


def test_agent_tool_name_is_the_node_name() -> None:
    """Call n8n Workflow Tool 2.2 names the tool after its node (characters outside
    [A-Za-z0-9_-] become "_"): the node is named as the system message calls the tool."""
    workflow = load(AGENT_TOOL)
    (tool,) = [n for n in nodes(workflow) if n["type"].endswith("toolWorkflow")]
    assert tool["typeVersion"] == 2.2
    tool_name = re.sub(r"[^a-zA-Z0-9_-]+", "_", tool["name"])
    assert tool_name == tool["name"] == "create_follow_up_task"
    assert "name" not in tool["parameters"]  # ignored by 2.2; it would only mislead
    agent = next(n for n in nodes(workflow) if n["type"].endswith(".agent"))
    assert tool_name in agent["parameters"]["options"]["systemMessage"]


def test_agent_chat_has_a_production_url() -> None:
    """The chat trigger is public in webhook mode, so POST /webhook/<webhookId>/chat reaches it."""
    workflow = load(AGENT_TOOL)
    (chat,) = [n for n in nodes(workflow) if n["type"].endswith("chatTrigger")]
    assert chat["parameters"]["public"] is True
    assert chat["parameters"]["mode"] == "webhook"
    assert chat["webhookId"]


# ------------------------------------------------------------------------------ (d) the Idem node


def idem_nodes(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [node for node in nodes(workflow) if node["type"] == IDEM_NODE]


@cache
def idem_parameter_names() -> set[str]:
    """Every parameter name the Idem node declares (read from its TypeScript source)."""
    source = IDEM_NODE_SOURCE.read_text(encoding="utf-8")
    return set(re.findall(r"^\t+name: '(\w+)',$", source, re.MULTILINE))


def test_node_workflow_uses_the_idem_node_for_every_gateway_call() -> None:
    """04 talks to the gateway only through Idem nodes (claim, complete, fail), none by HTTP."""
    workflow = load(NODE_CLAIM)
    assert gateway_requests(workflow) == []
    operations = {node["name"]: node["parameters"]["operation"] for node in idem_nodes(workflow)}
    assert operations == {
        "Idem: claim": "claim",
        "Idem: complete": "complete",
        "Idem: fail": "fail",
    }


@pytest.mark.parametrize("name", NODE_WORKFLOWS)
def test_idem_nodes_use_parameters_the_node_declares(name: str) -> None:
    """Every parameter an example sets on an Idem node exists in the node's description."""
    declared = idem_parameter_names()
    assert {"operation", "key", "leaseToken", "payload", "effect", "retryable"} <= declared
    for node in idem_nodes(load(name)):
        assert set(node["parameters"]) <= declared, (
            node["name"],
            set(node["parameters"]) - declared,
        )


@pytest.mark.parametrize("name", NODE_CLAIMS)
def test_idem_nodes_take_the_credential_and_retry_transport_errors(name: str) -> None:
    """Idem nodes use the Idem API credential, Retry On Fail, and answer 503 + Retry-After from
    their error output when the gateway stays unreachable."""
    workflow = load(name)
    named = by_name(workflow)
    for node in idem_nodes(workflow):
        assert set(node["credentials"]) == {"idemApi"}, node["name"]
        assert node.get("retryOnFail") is True, node["name"]
        assert 1 < int(node.get("maxTries", 3)) <= 5, node["name"]
        assert node.get("onError") == "continueErrorOutput", node["name"]
        outputs = len(workflow["connections"][node["name"]]["main"])
        # Claim: Act, Look First, Done, Busy, Dead, Refused, then n8n's error output.
        error_output = 6 if node["parameters"]["operation"] == "claim" else 1
        assert outputs == error_output + 1, node["name"]
        (handler,) = targets(workflow, node["name"], error_output)
        options = named[handler]["parameters"]["options"]
        assert named[handler]["type"] == "n8n-nodes-base.respondToWebhook"
        assert options["responseCode"] == 503
        assert "Retry-After" in {h["name"] for h in options["responseHeaders"]["entries"]}


def test_node_claim_routes_every_outcome() -> None:
    """Act creates, Look First finds the task first, Done answers the stored result, Busy 503
    with Retry-After, Dead and Refused are answered with the gateway's status."""
    workflow = load(NODE_CLAIM)
    named = by_name(workflow)
    claim = named["Idem: claim"]
    assert claim["parameters"]["waitWhileBusy"] is True
    assert claim["parameters"]["key"] == "={{ $json.CLAIM_KEY }}"
    assert targets(workflow, "Idem: claim", 0) == ["CRM: create follow-up task"]
    assert targets(workflow, "Idem: claim", 1) == ["CRM: find task"]
    assert targets(workflow, "Idem: claim", 2) == ["Respond: stored result"]
    (busy,) = targets(workflow, "Idem: claim", 3)
    assert named[busy]["parameters"]["options"]["responseCode"] == 503
    assert targets(workflow, "Idem: claim", 4) == targets(workflow, "Idem: claim", 5)
    stored = named["Respond: stored result"]["parameters"]["options"]
    assert {"name": "Idempotent-Replayed", "value": "true"} in stored["responseHeaders"]["entries"]
    assert targets(workflow, "Found in CRM?", 0) == ["Task reference"]
    assert targets(workflow, "Not in CRM?", 0) == ["CRM: create follow-up task"]
    assert targets(workflow, "Not in CRM?", 1) == ["Classify CRM error"]


def test_node_lease_token_travels_on_the_item() -> None:
    """Complete and fail keep the default key and lease token (the item's `idem`), and the Set
    nodes before them carry the claim's `idem` onto the item."""
    workflow = load(NODE_CLAIM)
    named = by_name(workflow)
    for name in ("Idem: complete", "Idem: fail"):
        assert "key" not in named[name]["parameters"], name
        assert "leaseToken" not in named[name]["parameters"], name
    for name in ("Task reference", "Classify CRM error"):
        assert assignment(named[name], "idem") == "={{ $('Idem: claim').item.json.idem }}"
    assert targets(workflow, "Task reference", 0) == ["Idem: complete"]
    assert targets(workflow, "Classify CRM error", 0) == ["Idem: fail"]
    assert named["Idem: fail"]["parameters"]["effect"] == "={{ $json.effect }}"
    effect = assignment(named["Classify CRM error"], "effect")
    assert "'none'" in effect and "statusCode < 500" in effect


def test_node_defaults_read_the_item() -> None:
    """The node's Key and Lease Token defaults read `idem.key` and `idem.lease_token`."""
    source = IDEM_NODE_SOURCE.read_text(encoding="utf-8")
    assert "default: '={{ $json.idem.key }}'" in source
    assert "default: '={{ $json.idem.lease_token }}'" in source


def test_heartbeat_workflow_chains_claim_heartbeat_complete_with_defaults() -> None:
    """05: Act and Look First go through Heartbeat; Heartbeat, Complete and Fail keep the default
    key and lease token, Claim the default Busy settings; the Set nodes carry Heartbeat's
    `idem` (the merged answer, lease token included) past the CRM calls."""
    workflow = load(NODE_HEARTBEAT)
    named = by_name(workflow)
    operations = {node["name"]: node["parameters"]["operation"] for node in idem_nodes(workflow)}
    assert operations == {
        "Idem: claim": "claim",
        "Idem: heartbeat": "heartbeat",
        "Idem: complete": "complete",
        "Idem: fail": "fail",
    }
    assert gateway_requests(workflow) == []
    claim = named["Idem: claim"]["parameters"]
    assert not {"waitWhileBusy", "maxRounds", "maxWaitSeconds"} & set(claim)
    for name in ("Idem: heartbeat", "Idem: complete", "Idem: fail"):
        assert not {"key", "leaseToken"} & set(named[name]["parameters"]), name
    assert targets(workflow, "Idem: claim", 0) == ["Idem: heartbeat"]
    assert targets(workflow, "Idem: claim", 1) == ["Idem: heartbeat"]
    assert targets(workflow, "Idem: heartbeat", 0) == ["CRM: find task"]
    for name in ("Task reference", "Classify CRM error"):
        assert assignment(named[name], "idem") == "={{ $('Idem: heartbeat').item.json.idem }}"
    assert targets(workflow, "Task reference", 0) == ["Idem: complete"]


def test_send_event_workflow_sends_the_webhook_body() -> None:
    """06: Send Event with an empty Event Payload (the webhook's body, never its headers), the
    provider's id as External ID; a refusal is answered with its status, an unreachable
    gateway 503 + Retry-After."""
    workflow = load(NODE_SEND_EVENT)
    named = by_name(workflow)
    (send,) = idem_nodes(workflow)
    params = send["parameters"]
    assert params["operation"] == "sendEvent"
    assert "eventPayload" not in params and "envelope" not in params
    assert params["externalId"] == "={{ $json.body.id }}"
    # As in 01: the source and the provider's event id, so 01 and 06 land on one key.
    assert params["idempotencyKey"] == "=webform:{{ $json.body.id }}"
    assert set(send["credentials"]) == {"idemApi"}
    assert send.get("retryOnFail") is True and send.get("onError") == "continueErrorOutput"
    assert targets(workflow, "Webhook", 0) == [send["name"]]
    (accepted,) = targets(workflow, send["name"], 0)
    assert "duplicate" in named[accepted]["parameters"]["responseBody"]
    (check,) = targets(workflow, send["name"], 1)
    assert conditions(named[check])[0]["leftValue"] == "={{ $json.idem.status }}"
    (refused,) = targets(workflow, check, 0)
    assert (
        named[refused]["parameters"]["options"]["responseCode"] == "={{ $json.idem.http_status }}"
    )
    (unreachable,) = targets(workflow, check, 1)
    options = named[unreachable]["parameters"]["options"]
    assert options["responseCode"] == 503
    assert "Retry-After" in {h["name"] for h in options["responseHeaders"]["entries"]}


def test_trigger_workflow_is_safe_with_the_node_defaults() -> None:
    """07: the Idem Trigger starts it; Act: the CRM call (the gateway key as Idempotency-Key)
    replaces the item and Complete, its Key and Lease Token left at the defaults, still finds
    the trigger's claim; Look First: the CRM is asked first, a task found is completed, only a
    404 leads to the create, a failed lookup ends the run without an item (a retry)."""
    workflow = load(NODE_TRIGGER)
    named = by_name(workflow)
    trigger = named["Idem Trigger"]
    assert trigger["type"] == "n8n-nodes-idem.idemTrigger"
    assert set(trigger["credentials"]) == {"idemApi"}
    assert trigger["webhookId"] and trigger["parameters"]["path"]
    assert targets(workflow, "Idem Trigger", 0) == ["Config"]
    assert targets(workflow, "Idem Trigger", 1) == ["Config (look first)"]
    crm = named["CRM: create task"]
    keys = {h["name"]: h["value"] for h in crm["parameters"]["headerParameters"]["parameters"]}
    assert keys["Idempotency-Key"] == "={{ $('Idem Trigger').item.json.key }}"
    assert targets(workflow, "CRM: create task", 0) == ["Idem: complete"]
    complete = named["Idem: complete"]
    assert complete["parameters"]["operation"] == "complete"
    assert "key" not in complete["parameters"] and "leaseToken" not in complete["parameters"]
    assert "Idem: complete" not in workflow["connections"], "Complete is the last node"
    find = named["CRM: find task"]
    assert find["parameters"]["method"] == "GET"
    assert "$('Idem Trigger').item.json.key" in find["parameters"]["url"]
    assert response_options(find) == {"fullResponse": True, "neverError": True}
    assert targets(workflow, "Config (look first)", 0) == ["CRM: find task"]
    assert targets(workflow, "CRM: find task", 0) == ["Found in CRM?"]
    assert conditions(named["Found in CRM?"])[0]["rightValue"] == 200
    assert targets(workflow, "Found in CRM?", 0) == ["Task found"]
    assert targets(workflow, "Task found", 0) == ["Idem: complete"]
    assert targets(workflow, "Found in CRM?", 1) == ["Not in CRM?"]
    assert conditions(named["Not in CRM?"])[0]["rightValue"] == 404
    assert targets(workflow, "Not in CRM?", 0) == ["Config"]
    assert targets(workflow, "Not in CRM?", 1) == []


def test_fan_out_workflow_is_the_n8n_destination_of_the_invoice_route() -> None:
    """10 is the `finance-flow` destination (`kind = "n8n"`, its Webhook's path) of the fan-out
    route `stripe-invoice-paid` of examples/routes.toml, which takes Stripe's `invoice.paid`
    to three destinations; the workflow sends the delivery's own key on to the ledger and
    answers after the write: booked (its `entry_id` the route's external ref), the ledger's
    refusal with the ledger's status, an unreachable ledger 503 + Retry-After."""
    import tomllib

    example = tomllib.loads((ROOT / "examples" / "routes.toml").read_text(encoding="utf-8"))
    (route,) = [r for r in example["routes"] if r.get("name") == "stripe-invoice-paid"]
    assert (route["match"], route["sources"]) == ("invoice.paid", ["stripe"])
    assert route["fan_out"] == ["crm", "finance-flow", "slack"]
    destinations = {d["name"]: d for d in example["destinations"]}
    assert set(route["fan_out"]) <= set(destinations)
    finance = destinations["finance-flow"]
    assert (finance["kind"], finance["external_ref_pointer"]) == ("n8n", "/entry_id")
    workflow = load(FAN_OUT_FINANCE)
    named = by_name(workflow)
    webhook = named["Webhook"]
    assert webhook["parameters"]["responseMode"] == "responseNode"
    assert finance["url"].endswith("/webhook/" + webhook["parameters"]["path"])
    assert assignment(named["Config"], "KEY") == "={{ $json.headers['idempotency-key'] }}"
    ledger = named["Ledger: book payment"]
    headers = {
        h["name"]: h["value"] for h in ledger["parameters"]["headerParameters"]["parameters"]
    }
    assert headers["Idempotency-Key"] == "={{ $json.KEY }}"
    assert response_options(ledger)["neverError"] is True
    assert ledger.get("onError") == "continueErrorOutput"
    assert targets(workflow, "Ledger: book payment", 0) == ["Booked?"]
    (booked,) = targets(workflow, "Booked?", 0)
    assert "entry_id:" in named[booked]["parameters"]["responseBody"]
    (refused,) = targets(workflow, "Booked?", 1)
    assert named[refused]["parameters"]["options"]["responseCode"] == "={{ $json.statusCode }}"
    (unreachable,) = targets(workflow, "Ledger: book payment", 1)
    options = named[unreachable]["parameters"]["options"]
    assert options["responseCode"] == 503
    assert "Retry-After" in {h["name"] for h in options["responseHeaders"]["entries"]}


def test_webhook_paths_are_unique_across_examples() -> None:
    """Published together (as `make n8n-e2e` does), no two examples claim one webhook path."""
    paths = [
        node["parameters"]["path"]
        for name in EVERY_WORKFLOW
        for node in nodes(load(name))
        if node["type"] == "n8n-nodes-base.webhook"
    ]
    assert len(paths) == len(set(paths))


# ------------------------------------------------------------------------------ documentation


def test_docs_describe_every_example() -> None:
    """docs/how-to/n8n.md names each example file and examples/n8n/README.md points to it."""
    doc = DOC.read_text(encoding="utf-8")
    for name in EVERY_WORKFLOW:
        assert name in doc, name
    for needle in (
        "IDEM_URL",
        "Never Error",
        "Retry On Fail",
        "X-Idem-Signature",
        "openssl",
        "Response Format",
        "uncertain",
        "effect",
        "CLAIMS_TOKEN",
        "published",
        "Retry-After",
        "create_follow_up_task",
        "make n8n-e2e",
        "n8n-nodes-idem",
        "N8N_CUSTOM_EXTENSIONS",
        "img/n8n-idem-node.png",
    ):
        assert needle in doc, needle
    assert "docs/how-to/n8n.md" in (EXAMPLES / "README.md").read_text(encoding="utf-8")


def test_docs_signing_snippet_is_pasteable_and_sends_the_signed_string() -> None:
    """The JSON node snippet in docs/how-to/n8n.md parses, signs v2 (timestamp, Idempotency-Key and
    body) and sends the signed string as its JSON body with the signed key."""
    doc = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```json\n(.*?)```", doc, re.DOTALL)
    assert len(blocks) == 1
    snippet = json.loads(blocks[0])
    named = by_name(snippet)
    for source, _, target, _, _ in edges(snippet):
        assert source in named and target in named
    (sign,) = [n for n in nodes(snippet) if n["type"] == "n8n-nodes-base.crypto"]
    assert sign["typeVersion"] == 2 and set(sign["credentials"]) == {"crypto"}
    assert sign["parameters"]["action"] == "hmac"
    assert sign["parameters"]["type"] == "SHA256"
    assert sign["parameters"]["encoding"] == "hex"
    assert sign["parameters"]["value"] == "={{ $json.ts }}.{{ $json.key }}.{{ $json.body_text }}"
    (post,) = gateway_requests(snippet)
    headers = {h["name"]: h["value"] for h in post["parameters"]["headerParameters"]["parameters"]}
    assert headers["Idempotency-Key"] == "={{ $json.key }}"
    assert headers["X-Idem-Signature"] == "=v2={{ $json.signature }}"
    assert post["parameters"].get("contentType", "json") == "json"
    assert post["parameters"]["specifyBody"] == "json"
    assert post["parameters"]["jsonBody"] == "={{ $json.body_text }}"
    assert response_options(post)["responseFormat"] == "json"
    assert {h.lower() for h in header_names(post)} <= GATEWAY_HEADERS
    assert (method(post), url_path(post["parameters"]["url"])) == ("POST", "/v1/events")
    assert any(path_matches("/v1/events", template) for template in openapi_paths())
