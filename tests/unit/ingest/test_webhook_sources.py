"""`[[sources]]` tables and routes' `sources`: what a file may declare, where an event's id and
type are read, how a provider event becomes a key, and which source may trigger which route."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from outbox.core import keys
from outbox.core.problems import Problem
from outbox.core.routes import Route, RoutesError, RouteTable, Source, load_routes
from outbox.core.settings import Settings
from outbox.ingest import admission
from outbox.ingest.signatures import HmacSigner
from outbox.ingest.webhooks import provider_event, read_field

SECRET = "2483433c2ea714f3e48cf63e0fe5bce3"
STANDARD = "whsec_" + base64.b64encode(b"twenty-four key bytes!!!").decode()
STRIPE_BODY = json.dumps(
    {
        "id": "evt_1Abc",
        "type": "invoice.paid",
        "created": 1_800_000_000,
        "pending_webhooks": 2,
        "data": {"object": {"id": "in_1Xyz", "amount_paid": 4200}},
    }
).encode()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "routes.toml"
    path.write_text('[[routes]]\nmatch = "*"\naction = "noop"\n' + text, encoding="utf-8")
    return path


def stripe(**extra: object) -> Source:
    return Source.model_validate({"name": "Stripe", "scheme": "stripe", "secret": SECRET, **extra})


def test_existing_hmac_tables_keep_working(tmp_path: Path) -> None:
    """A table written before schemes existed (`secret`, header names) loads as `hmac`."""
    table = load_routes(
        write(
            tmp_path,
            f'[[sources]]\nname = "Shop"\nsecret = "{SECRET}"\n'
            'signature_header = "X-Shop-Signature"\ntolerance_seconds = 60\n',
        )
    )
    shop = table.sources["shop"]
    assert (shop.scheme, shop.all_secrets, shop.signature_header) == (
        "hmac",
        (SECRET,),
        "X-Shop-Signature",
    )
    signer = admission.signer_for(shop, default_tolerance=300)
    assert signer == HmacSigner((SECRET,), "X-Shop-Signature", "X-Idem-Timestamp", 60)


def test_secrets_list_and_secret_together_are_all_accepted() -> None:
    """`secret` and `secrets` may both be given; every one is a valid key (rotation)."""
    source = stripe(secrets=["3d44051857cb3c19d3429165308522c8", SECRET])
    assert source.all_secrets == (SECRET, "3d44051857cb3c19d3429165308522c8")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"secret": None}, "needs `secret` or `secrets`"),
        ({"secret": "short"}, "source 'stripe': a secret is shorter than 32 characters"),
        ({"event_id": "id"}, "JSON pointer"),
        ({"event_type": "header:"}, "JSON pointer"),
        ({"scheme": "paypal"}, "scheme"),
        ({"signature_header": "X-Other"}, "only an `hmac` source"),
        ({"scheme": "standard", "secret": "whsec_not base64 at all"}, "base64"),
    ],
    ids=["no-secret", "short", "pointer", "empty-header", "scheme", "headers", "standard-secret"],
)
def test_invalid_sources_are_refused_at_load(
    tmp_path: Path, extra: dict[str, object], message: str
) -> None:
    """Mistakes in a `[[sources]]` table stop the process at start-up, naming the problem."""
    fields = {"name": "stripe", "scheme": "stripe", "secret": SECRET, **extra}
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items() if v is not None)
    with pytest.raises(RoutesError) as raised:
        load_routes(write(tmp_path, "[[sources]]\n" + lines))
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("scheme", "event_id", "event_type"),
    [
        ("standard", "header:webhook-id", "/type"),
        ("stripe", "/id", "/type"),
        ("github", "header:X-GitHub-Delivery", "header:X-GitHub-Event"),
        ("shopify", "header:X-Shopify-Webhook-Id", "header:X-Shopify-Topic"),
        ("hmac", "/id", "/type"),
    ],
)
def test_each_scheme_has_its_providers_defaults(
    scheme: str, event_id: str, event_type: str
) -> None:
    """Without `event_id`/`event_type` a source reads them where its provider puts them."""
    secret = STANDARD if scheme == "standard" else SECRET
    source = Source(name="s", scheme=scheme, secret=secret)  # type: ignore[arg-type]
    assert (source.event_id_at, source.event_type_at) == (event_id, event_type)


def test_read_field_from_pointers_and_headers() -> None:
    """Pointers (with ~1 escapes and array indexes) and headers; only text and integers."""
    document = {"a/b": {"list": [{"id": 7}]}, "flag": True, "blank": "  ", "n": 1.5}
    headers = {"x-github-delivery": " 72d3162e "}
    assert read_field("/a~1b/list/0/id", document, headers) == "7"
    assert read_field("header:X-GitHub-Delivery", document, headers) == "72d3162e"
    for absent in ("/missing", "/flag", "/blank", "/n", "/a~1b", "header:X-None"):
        assert read_field(absent, document, headers) is None


def test_a_stripe_event_becomes_a_key_from_its_id() -> None:
    """The key is the source's and the event id's; the body is the payload; the external id
    and version come from where the source says."""
    table = RouteTable([Route(match="invoice.*", name="invoices", action="noop")])
    source = stripe(external_id="/data/object/id", version="/created")
    event, route = provider_event(source, {}, STRIPE_BODY, table)
    assert route.label == "invoices"
    assert event.key == keys.derive_key("stripe", "webhook", "evt_1Abc", "1800000000")
    assert event.key.startswith("stripe:webhook:")
    assert (event.source, event.event_type, event.external_id, event.version) == (
        "stripe",
        "invoice.paid",
        "in_1Xyz",
        "1800000000",
    )
    assert json.loads(event.payload_json) == json.loads(STRIPE_BODY)


def test_a_redelivery_with_changed_delivery_fields_is_the_same_event() -> None:
    """Stripe's pending_webhooks changes between attempts: same key, same payload hash."""
    table = RouteTable([Route(match="*", action="noop")])
    first, _ = provider_event(stripe(), {}, STRIPE_BODY, table)
    again = STRIPE_BODY.replace(b'"pending_webhooks": 2', b'"pending_webhooks": 1')
    second, _ = provider_event(stripe(), {}, again, table)
    assert (first.key, first.payload_hash) == (second.key, second.payload_hash)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b'{"type": "invoice.paid"}', "missing_event_id"),
        (b'{"id": {"nested": 1}, "type": "invoice.paid"}', "missing_event_id"),
        (b'{"id": "evt_1"}', "missing_event_type"),
        (b'{"id": "evt_1", "type": "   "}', "missing_event_type"),
    ],
    ids=["not-json", "not-an-object", "no-id", "id-not-text", "no-type", "blank-type"],
)
def test_unusable_bodies_are_400_naming_what_is_missing(body: bytes, code: str) -> None:
    """An unparseable body, or no id or type at the configured place, is a 400 with the place."""
    table = RouteTable([Route(match="*", action="noop")])
    with pytest.raises(Problem) as raised:
        provider_event(stripe(), {}, body, table)
    assert (raised.value.status, raised.value.error) == (400, code)
    if code.startswith("missing_"):
        assert raised.value.extra["location"] in raised.value.detail


def test_routes_sources_decide_who_may_trigger_them() -> None:
    """A route with `sources` takes only those sources (case and spacing do not matter)."""
    table = RouteTable(
        [
            Route(match="payment.*", action="noop", sources=[" Stripe "]),
            Route(match="*", action="noop"),
        ]
    )
    assert admission.route_for(table, "stripe", "payment.done").match == "payment.*"
    assert admission.route_for(table, "webform", "lead.new").match == "*"
    with pytest.raises(Problem) as raised:
        admission.route_for(table, "webform", "payment.done")
    assert (raised.value.status, raised.value.error) == (403, "source_not_allowed")


def test_webhook_secrets_and_the_file_make_the_sources() -> None:
    """WEBHOOK_SECRETS gives hmac sources (a name twice: two secrets; their strength is
    checked once at start, `outbox.core.tokens`); a file's table of the same name wins."""
    table = RouteTable([Route(match="*", action="noop")], [stripe()])
    settings = Settings(webhook_secrets="form=short,FORM=short2,stripe=x")
    known = admission.sources(settings, table)
    assert known["form"].all_secrets == ("short", "short2")
    assert known["stripe"].scheme == "stripe"
    assert set(admission.signers(settings, known)) == {"form", "stripe"}


def test_the_example_routes_file_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/routes.toml is valid once its secrets are in the environment, and declares the
    provider sources."""
    for name in ("BILLING", "STRIPE", "GITHUB", "ACME", "CRM"):
        standard = name in ("ACME", "CRM")
        monkeypatch.setenv(f"{name}_WEBHOOK_SECRET", STANDARD if standard else SECRET)
    monkeypatch.setenv("SHOPIFY_CLIENT_SECRET", SECRET)
    table = load_routes(Path(__file__).parents[3] / "examples" / "routes.toml")
    schemes = {name: source.scheme for name, source in table.sources.items()}
    assert schemes == {
        "billing": "hmac",
        "stripe": "stripe",
        "github": "github",
        "shopify": "shopify",
        "acme": "standard",
        "crm": "standard",
    }
