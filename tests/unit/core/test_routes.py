"""Unit tests for outbox.core.routes: the routes file, how event types find a route, and its
errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox.core.routes import DAY, DEFAULT_ROUTES, Route, RoutesError, RouteTable, load_routes

THIRTY_DAYS_SECONDS = 30 * 24 * 60 * 60

ROUTES_TOML = """
[[routes]]
match = "crm.*"
name = "crm-glob"
action = "noop"

[[routes]]
match = "crm.lead.created"
name = "crm-lead-exact"
action = "http"
url = "https://crm.example/leads"

[[routes]]
match = "crm.lead.*"
name = "crm-lead-glob"
action = "noop"

[[routes]]
match = "Billing.Invoice.Paid"
action = "python"
function = "billing.hooks:paid"

[[routes]]
match = "SHOP.*"
name = "shop"
action = "noop"
"""


def write(tmp_path: Path, text: str, name: str = "routes.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def table(tmp_path: Path) -> RouteTable:
    return load_routes(write(tmp_path, ROUTES_TOML))


# --- no file ----------------------------------------------------------------------------------


def test_no_file_gives_the_catch_all_noop() -> None:
    """load_routes(None) sends every event type to the built-in `noop` route."""
    table = load_routes(None)
    assert table is DEFAULT_ROUTES
    for event_type in ("crm.lead.created", "x", "anything.at.all"):
        route = table.resolve(event_type)
        assert route is not None
        assert route.action == "noop"
        assert route.label == "default-noop"


# --- resolution order -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event_type", "label"),
    [
        # The exact route wins although a glob that also matches comes first in the file.
        ("crm.lead.created", "crm-lead-exact"),
        # Among globs the first in file order wins: "crm.*" is before "crm.lead.*".
        ("crm.lead.updated", "crm-glob"),
        ("crm.deal.won", "crm-glob"),
        # Patterns are case-folded; event types arrive lower-cased.
        ("billing.invoice.paid", "Billing.Invoice.Paid"),
        ("shop.order.placed", "shop"),
        # No route accepts these.
        ("billing.invoice.sent", None),
        ("crm", None),
        ("", None),
    ],
)
def test_resolve_exact_before_globs_in_file_order(
    table: RouteTable, event_type: str, label: str | None
) -> None:
    """An exact route beats any glob, globs are tried in file order, patterns match any case."""
    route = table.resolve(event_type)
    if label is None:
        assert route is None
    else:
        assert route is not None
        assert route.label == label


def test_exact_route_found_even_when_declared_after_a_matching_glob(table: RouteTable) -> None:
    """The glob `crm.*` is first in the file, yet the exact route for its event type is chosen."""
    route = table.resolve("crm.lead.created")
    assert route is not None
    assert route.action == "http"
    assert route.url == "https://crm.example/leads"


def test_duplicate_exact_routes_first_in_file_wins() -> None:
    """Two exact routes for one event type: the first one in the file is used."""
    table = RouteTable(
        [
            Route(match="a.b", name="first", action="noop"),
            Route(match="A.B", name="second", action="noop"),
        ]
    )
    route = table.resolve("a.b")
    assert route is not None
    assert route.name == "first"


@pytest.mark.parametrize(
    ("pattern", "event_type", "matches"),
    [
        ("crm.?", "crm.a", True),
        ("crm.?", "crm.ab", False),
        ("crm.[ab]", "crm.b", True),
        ("crm.[ab]", "crm.c", False),
        ("*", "", True),
        ("CRM.*", "crm.x", True),
        ("crm.*", "CRM.x", False),  # the event type is not folded here: the receiver does that
    ],
)
def test_glob_syntax(pattern: str, event_type: str, matches: bool) -> None:
    """Glob patterns use fnmatch syntax (`*`, `?`, `[...]`) against the lower-cased event type."""
    table = RouteTable([Route(match=pattern, action="noop")])
    assert (table.resolve(event_type) is not None) is matches


# --- by_label ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "expected_match"),
    [
        ("crm-lead-exact", "crm.lead.created"),  # by name
        ("shop", "SHOP.*"),  # by name
        ("Billing.Invoice.Paid", "Billing.Invoice.Paid"),  # unnamed route: by match
    ],
)
def test_by_label_finds_route_by_name_else_by_match(
    table: RouteTable, label: str, expected_match: str
) -> None:
    """by_label finds a route by its name, and an unnamed route by its match pattern."""
    route = table.by_label(label)
    assert route is not None
    assert route.match == expected_match


@pytest.mark.parametrize("label", ["crm.lead.created", "no-such-route", ""])
def test_by_label_unknown_label_is_none(table: RouteTable, label: str) -> None:
    """by_label answers None for a label no route has (a named route is not found by match)."""
    assert table.by_label(label) is None


# --- defaults ---------------------------------------------------------------------------------


def test_ttl_default_is_thirty_days(table: RouteTable) -> None:
    """A route without `ttl_days` keeps its keys 30 days."""
    route = table.resolve("shop.order.placed")
    assert route is not None
    assert DAY == 86_400
    assert route.ttl_days == 30
    assert route.ttl_seconds == THIRTY_DAYS_SECONDS


def test_ttl_days_is_configurable(tmp_path: Path) -> None:
    """`ttl_days` sets ttl_seconds, fractions included."""
    path = write(tmp_path, '[[routes]]\nmatch = "*"\naction = "noop"\nttl_days = 1.5\n')
    route = load_routes(path).resolve("x")
    assert route is not None
    assert route.ttl_seconds == 1.5 * DAY


# --- environment expansion --------------------------------------------------------------------


def test_env_reference_in_header_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`${NAME}` in a header value is replaced with the environment variable's value."""
    monkeypatch.setenv("IDEM_TEST_CRM_TOKEN", "s3cret")
    path = write(
        tmp_path,
        """
[[routes]]
match = "crm.*"
action = "http"
url = "https://crm.example/tasks"
headers = { Authorization = "Bearer ${IDEM_TEST_CRM_TOKEN}", X-Plain = "no-vars" }
""",
    )
    route = load_routes(path).resolve("crm.task")
    assert route is not None
    assert route.headers == {"Authorization": "Bearer s3cret", "X-Plain": "no-vars"}


def test_unset_env_reference_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `${NAME}` whose variable is unset is a RoutesError that names the variable."""
    monkeypatch.delenv("IDEM_TEST_UNSET_TOKEN", raising=False)
    path = write(
        tmp_path,
        """
[[routes]]
match = "crm.*"
action = "http"
url = "https://crm.example/tasks"
headers = { Authorization = "Bearer ${IDEM_TEST_UNSET_TOKEN}" }
""",
    )
    with pytest.raises(RoutesError, match=r"\$\{IDEM_TEST_UNSET_TOKEN\}"):
        load_routes(path)


# --- errors -----------------------------------------------------------------------------------


def test_missing_file_is_a_routes_error_naming_the_file(tmp_path: Path) -> None:
    """A routes file that does not exist is a RoutesError naming the path."""
    path = tmp_path / "nope.toml"
    with pytest.raises(RoutesError) as caught:
        load_routes(path)
    assert str(path) in str(caught.value)
    assert "cannot read" in str(caught.value)


@pytest.mark.parametrize(
    ("case", "text", "fragments"),
    [
        ("invalid TOML", "routes = [\n", ["not valid TOML"]),
        (
            "http without url",
            '[[routes]]\nmatch = "a"\naction = "http"\n',
            ["routes.0", "url"],
        ),
        (
            "python without function",
            '[[routes]]\nmatch = "a"\naction = "python"\n',
            ["routes.0", "function"],
        ),
        (
            "python function without module",
            '[[routes]]\nmatch = "a"\naction = "python"\nfunction = "no_colon"\n',
            ["routes.0", "function"],
        ),
        (
            "unknown action",
            '[[routes]]\nmatch = "a"\naction = "smtp"\n',
            ["routes.0.action"],
        ),
        (
            "unknown key in a route",
            '[[routes]]\nmatch = "a"\naction = "noop"\nretries = 3\n',
            ["routes.0.retries", "Extra inputs"],
        ),
        (
            "unknown top-level key",
            '[[routes]]\nmatch = "a"\naction = "noop"\n[extra]\nx = 1\n',
            ["extra", "Extra inputs"],
        ),
        (
            "bad external_ref_pointer",
            '[[routes]]\nmatch = "a"\naction = "http"\nurl = "http://x"\n'
            'external_ref_pointer = "id"\n',
            ["routes.0", "external_ref_pointer"],
        ),
        ("empty routes list", "routes = []\n", ["routes", "at least 1"]),
        ("no routes at all", "", ["routes", "Field required"]),
        (
            "empty match",
            '[[routes]]\nmatch = ""\naction = "noop"\n',
            ["routes.0.match"],
        ),
        (
            "error in the second route",
            '[[routes]]\nmatch = "a"\naction = "noop"\n'
            '[[routes]]\nmatch = "b"\naction = "noop"\nttl_days = 0\n',
            ["routes.1.ttl_days"],
        ),
    ],
)
def test_invalid_file_is_a_routes_error_naming_file_and_field(
    tmp_path: Path, case: str, text: str, fragments: list[str]
) -> None:
    """Every invalid routes file is a RoutesError whose message names the file and the field."""
    path = write(tmp_path, text)
    with pytest.raises(RoutesError) as caught:
        load_routes(path)
    message = str(caught.value)
    assert str(path) in message, case
    for fragment in fragments:
        assert fragment in message, (case, fragment, message)


@pytest.mark.parametrize("pointer", ["", "/id", "/data/0/id", "/a~1b"])
def test_valid_external_ref_pointers_are_accepted(tmp_path: Path, pointer: str) -> None:
    """An empty pointer (the whole document) and any pointer starting with "/" are accepted."""
    path = write(
        tmp_path,
        '[[routes]]\nmatch = "a"\naction = "http"\nurl = "http://x"\n'
        f'external_ref_pointer = "{pointer}"\n',
    )
    route = load_routes(path).resolve("a")
    assert route is not None
    assert route.external_ref_pointer == pointer


def test_non_utf8_file_is_a_routes_error(tmp_path: Path) -> None:
    """A routes file that is not UTF-8 is a RoutesError naming the file, like any unreadable one."""
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[[routes]]\nmatch = "caf\xe9"\naction = "noop"\n')
    with pytest.raises(RoutesError, match=str(path)):
        load_routes(path)


def test_route_protection_defaults_and_bounds() -> None:
    """A route has no limits by default and a breaker that opens at half of 20 calls in 30 s
    failing, tries 3 calls half-open, and cools down 10 s doubling to 300 s; nonsensical limits
    and a cap below the cool-down are refused."""
    route = Route(match="a.*", action="noop")
    assert (route.max_in_flight, route.rate_per_second, route.burst) == (None, None, 1)
    assert (route.circuit_failure_rate, route.circuit_minimum_calls) == (0.5, 20)
    assert (route.circuit_window_seconds, route.circuit_half_open_calls) == (30.0, 3)
    assert (route.circuit_cooldown_seconds, route.circuit_cooldown_cap_seconds) == (10.0, 300.0)
    for bad in (
        {"max_in_flight": 0},
        {"rate_per_second": 0},
        {"burst": 0},
        {"circuit_minimum_calls": 0},
        {"circuit_failure_rate": 0},
        {"circuit_failure_rate": 1.5},
        {"circuit_half_open_calls": 0},
        {"circuit_cooldown_seconds": 20, "circuit_cooldown_cap_seconds": 10},
    ):
        with pytest.raises(ValueError):
            Route(match="a.*", action="noop", **bad)


def test_the_earlier_threshold_name_sets_the_minimum_of_calls() -> None:
    """A routes file written for the streak breaker keeps loading: its
    `circuit_failure_threshold` is read as `circuit_minimum_calls`."""
    route = Route.model_validate({"match": "a.*", "action": "noop", "circuit_failure_threshold": 4})
    assert route.circuit_minimum_calls == 4


# A routes file whose provider source takes its secret from a variable nobody set.
UNSET_SOURCE_SECRET = """
[[routes]]
match = "*"
action = "noop"

[[sources]]
name = "stripe"
scheme = "stripe"
secret = "${IDEM_TEST_UNSET_SECRET}"
"""


def test_routes_without_sources_leave_the_sources_secrets_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sources=False` (the worker) reads the routes and skips `[[sources]]`, so a source
    secret missing from the environment stops only a process that verifies signatures."""
    monkeypatch.delenv("IDEM_TEST_UNSET_SECRET", raising=False)
    table = load_routes(write(tmp_path, UNSET_SOURCE_SECRET), sources=False)
    assert table.resolve("anything") is not None
    assert table.sources == {}
    with pytest.raises(RoutesError, match=r"\$\{IDEM_TEST_UNSET_SECRET\}"):
        load_routes(write(tmp_path, UNSET_SOURCE_SECRET))


def test_a_superseding_route_open_to_any_source_is_warned_about_at_start(tmp_path: Path) -> None:
    """The receiver warns at start about each route that supersedes lanes while open to any
    source, naming the fix (`sources`); a route that names its sources is not warned about."""
    from structlog.testing import capture_logs

    from outbox.app import create_app
    from outbox.core.settings import Settings

    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes]]\nmatch = "contact.*"\nname = "contacts"\naction = "noop"\n'
        'order_by = "/id"\nversions = "supersede"\n\n'
        '[[routes]]\nmatch = "account.*"\nname = "accounts"\naction = "noop"\n'
        'order_by = "/id"\nversions = "supersede"\nsources = ["crm", "erp"]\n',
        encoding="utf-8",
    )
    routes = load_routes(path)
    assert routes.open_superseding() == ["contacts"]
    with capture_logs() as logs:
        create_app(Settings(database_url="postgresql://idem@127.0.0.1:1/idem"), routes)
    warned = [e for e in logs if e["event"] == "routes.lanes_per_source"]
    assert [(e["log_level"], e["route"]) for e in warned] == [("warning", "contacts")]
    assert 'sources = ["crm", "erp"]' in warned[0]["fix"]


def test_max_version_ahead_needs_order_by() -> None:
    """`max_version_ahead_seconds` belongs to an ordered route, like `versions`."""
    with pytest.raises(ValueError, match="max_version_ahead_seconds"):
        Route(match="x", action="noop", max_version_ahead_seconds=60)
