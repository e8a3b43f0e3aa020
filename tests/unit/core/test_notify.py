"""`[[notify]]` targets: read from the routes file, secrets from the environment and checked,
never shown in an error; the retry delay of a notice."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from outbox.core.notify import summary
from outbox.core.routes import RoutesError, load_routes
from outbox.maintenance.notify import RETRY_BASE_SECONDS, RETRY_CAP_SECONDS, retry_delay

ROUTE = '[[routes]]\nmatch = "*"\naction = "noop"\n'
STRONG = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SLACK_URL = "https://hooks.slack.com/services/T000/B000/very-secret-path"


def write(tmp_path: Path, notify: str) -> Path:
    path = tmp_path / "routes.toml"
    path.write_text(ROUTE + notify, encoding="utf-8")
    return path


def test_targets_are_read_with_their_secrets_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """URL and secret come from `${ENV}`; defaults: a 60 s window, one stuck key."""
    monkeypatch.setenv("SLACK_URL", SLACK_URL)
    monkeypatch.setenv("HOOK_SECRET", STRONG)
    table = load_routes(
        write(
            tmp_path,
            '[[notify]]\nname = "ops"\nurl = "${SLACK_URL}"\nformat = "slack"\n'
            'on = ["dead_letters", "circuit"]\n'
            '[[notify]]\nname = "hook"\nurl = "https://example.com/n"\nformat = "json"\n'
            'secret = "${HOOK_SECRET}"\non = ["stuck"]\n',
        ),
        sources=False,
    )
    ops, hook = table.notify
    assert ops.url.get_secret_value() == SLACK_URL and SLACK_URL not in repr(ops)
    assert ops.window_seconds == 60 and ops.signing_key is None
    assert hook.signing_key is not None and hook.stuck_threshold == 1
    assert hook.wants("stuck") and not hook.wants("dead_letters")


@pytest.mark.parametrize(
    ("notify", "says"),
    [
        (
            'name = "a"\nurl = "URL"\nformat = "json"\nsecret = "whsec_c2hvcnQ="\non = ["pause"]',
            "secret",
        ),
        (
            'name = "a"\nurl = "URL"\nformat = "slack"\nsecret = "SECRET"\non = ["pause"]',
            'format = "json"',
        ),
        ('name = "a"\nurl = "URL"\non = []', "on"),
        ('name = "a"\nurl = "URL"\non = ["fire"]', "on"),
        ('name = "a"\nurl = "ftp://x"\non = ["pause"]', "http(s)"),
    ],
)
def test_a_bad_target_is_refused_without_showing_its_url_or_secret(
    tmp_path: Path, notify: str, says: str
) -> None:
    """A weak secret, a secret on Slack, no or unknown conditions, a non-HTTP URL: refused at
    load, naming the problem, never the URL or the secret."""
    text = "[[notify]]\n" + notify.replace("URL", SLACK_URL).replace("SECRET", STRONG) + "\n"
    with pytest.raises(RoutesError) as refused:
        load_routes(write(tmp_path, text), sources=False)
    assert says in str(refused.value)
    assert SLACK_URL not in str(refused.value) and STRONG not in str(refused.value)


def test_two_targets_of_one_name_are_refused(tmp_path: Path) -> None:
    """A notice names its target: two of one name are refused."""
    one = f'[[notify]]\nname = "ops"\nurl = "{SLACK_URL}"\non = ["pause"]\n'
    with pytest.raises(RoutesError, match="same `name`"):
        load_routes(write(tmp_path, one + one), sources=False)


def test_retry_delay_is_full_jitter_doubling_to_the_cap() -> None:
    """Uniform in [0, base * 2^(tries-1)], never past the cap, however many tries."""
    rng = random.Random(7)
    for tries, ceiling in [(1, RETRY_BASE_SECONDS), (3, 4 * RETRY_BASE_SECONDS)]:
        delays = [retry_delay(tries, rng) for _ in range(200)]
        assert min(delays) >= 0 and max(delays) <= ceiling and max(delays) > ceiling / 2
    assert max(retry_delay(10_000, rng) for _ in range(200)) <= RETRY_CAP_SECONDS


def test_slack_text_shows_what_operators_and_senders_wrote_as_text() -> None:
    """A pause reason with `<!channel>` and a `<url|label>` link, and a key with `&`, reach
    Slack escaped (`&lt;`, `&gt;`, `&amp;`): no mention, no disguised link. The JSON notice's
    text keeps them as written."""
    reason = "<!channel> <https://evil.example|Re-authenticate> & <@U123>"
    facts = {"route": "crm", "by": "ops<!here>", "reason": reason}
    text = summary("pause", facts, slack=True)
    assert "<" not in text and ">" not in text
    assert (
        "&lt;!channel&gt; &lt;https://evil.example|Re-authenticate&gt; &amp; &lt;@U123&gt;" in text
    )
    assert "ops&lt;!here&gt;" in text
    assert summary("pause", facts) == f"route crm paused by ops<!here>: {reason}"
    keys = {
        "total": 1,
        "counts": [{"route": "crm", "error_code": "x", "count": 1}],
        "keys": ["<k>"],
    }
    assert summary("dead_letters", keys, slack=True).endswith("first keys: &lt;k&gt;")
