"""The console's attempt timeline in Debian's headless Chromium: a key refused twice, its answer
then lost and reconciled, shows its four attempts in order with their codes on the key page and
on its dead-letter page. The key page's screenshot is the one in
docs/how-to/replay-and-dead-letters.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.integration.operate.test_console import LAPTOP, _dead_letter_id, _fail, _sign_in
from tests.integration.operate.test_console import browser as browser  # the fixture
from tests.integration.worker.test_attempt_log import refused_twice_then_lost_then_reconciled
from tests.support import ROOT, Downstream, Stack

if TYPE_CHECKING:
    from playwright.sync_api import Browser

# docs/images/attempt-log.png is a copy of it, made by hand when the page changes: a test run
# leaves the checkout as it found it.
SCREENSHOT = ROOT / "test-artifacts" / "console" / "attempt-log.png"


def test_the_key_page_shows_the_attempts_in_order_with_their_codes(
    stack: Stack, downstream: Downstream, browser: Browser
) -> None:
    key = refused_twice_then_lost_then_reconciled(stack, downstream)
    context = browser.new_context(viewport={**LAPTOP, "width": 1400})
    page = context.new_page()
    _sign_in(page, stack, f"/console/keys?key={key}")
    page.goto(f"{stack.url}/console/keys?key={key}")
    rows = page.locator("table.attempts tbody tr")
    assert rows.count() == 4
    cells = [
        [rows.nth(i).locator("td").nth(c).inner_text().strip() for c in (0, 3, 4, 5, 8)]
        for i in range(4)
    ]
    assert cells == [
        ["1", "transient", "503", "http_503", "1"],
        ["2", "transient", "503", "http_503", "2"],
        ["3", "uncertain", "—", "timeout_read", "3"],
        ["4", "reconciled found", "200", "—", "4"],
    ]
    page.get_by_role("heading", name="Attempts").scroll_into_view_if_needed()
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.locator("section[aria-labelledby=attempts-heading]").screenshot(path=str(SCREENSHOT))

    # A dead letter's page shows its key's attempts too.
    failed = _fail(stack, downstream, "console-attempts")
    page.goto(f"{stack.url}/console/dead-letters/{_dead_letter_id(stack, failed)}")
    rows = page.locator("table.attempts tbody tr")
    assert rows.count() == 1
    assert rows.nth(0).locator("td").nth(3).inner_text().strip() == "permanent"
    assert rows.nth(0).locator("td").nth(4).inner_text().strip() == "422"
    context.close()
