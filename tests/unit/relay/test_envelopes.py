"""How the relay packs a batch's rows into messages (`outbox.relay.publisher.envelopes`)."""

from __future__ import annotations

from outbox.core.settings import Settings
from outbox.core.wire import PROCESS_TASK
from outbox.relay.publisher import Envelope, OutboxMessage, envelopes


def _row(
    outbox_id: int,
    key: str | None = None,
    *,
    event: str | None = None,
    correlation: str | None = None,
    traced: bool = False,
    task: str = PROCESS_TASK,
) -> OutboxMessage:
    return OutboxMessage(
        outbox_id,
        key or f"k-{outbox_id}",
        task,
        correlation or f"c-{outbox_id}",
        "00-trace" if traced else None,
        event,
    )


def _keys(packed: list[Envelope]) -> list[list[str]]:
    return [[row.key for row in envelope.rows] for envelope in packed]


def test_one_key_per_message_unless_asked_to_pack() -> None:
    rows = [_row(i) for i in range(1, 4)]
    assert _keys(envelopes(rows)) == [["k-1"], ["k-2"], ["k-3"]]


def test_consecutive_rows_are_packed_up_to_the_limit_in_order() -> None:
    rows = [_row(i) for i in range(1, 11)]

    packed = envelopes(rows, keys_per_message=4)

    assert _keys(packed) == [
        ["k-1", "k-2", "k-3", "k-4"],
        ["k-5", "k-6", "k-7", "k-8"],
        ["k-9", "k-10"],
    ]
    assert [e.task_id for e in packed] == ["outbox-1+2+3+4", "outbox-5+6+7+8", "outbox-9+10"]
    # Unrelated keys: the message names no correlation id (each attempt logs its key's own).
    assert {e.correlation_id for e in packed} == {None}


def test_an_events_deliveries_are_never_split_and_keep_their_correlation_id() -> None:
    siblings = [_row(i, event="ev", correlation="c-ev") for i in (2, 3, 4)]
    rows = [_row(1), *siblings, _row(5)]

    packed = envelopes(rows, keys_per_message=3)

    # The three deliveries do not fit beside k-1, so they travel alone, together.
    assert _keys(packed) == [["k-1"], ["k-2", "k-3", "k-4"], ["k-5"]]
    assert packed[1].correlation_id == "c-ev"


def test_the_default_limit_carries_four_whole_events_of_three_destinations() -> None:
    """RELAY_KEYS_PER_MESSAGE's default fills with whole three-way fan-outs: four events in
    one message, the fifth in the next (a limit of 8 would carry two events, six keys)."""
    limit = Settings.model_fields["relay_keys_per_message"].default
    rows = [
        _row(3 * n + d, event=f"ev-{n}", correlation=f"c-{n}") for n in range(5) for d in range(3)
    ]

    packed = envelopes(rows, keys_per_message=limit)

    assert [len(envelope.rows) for envelope in packed] == [12, 3]


def test_traced_rows_travel_only_with_their_own_events_deliveries() -> None:
    """A message is one span in one trace: an untraced key never joins a traced one."""
    siblings = [_row(i, event="ev", correlation="c-ev", traced=True) for i in (3, 4)]
    rows = [_row(1), _row(2, traced=True), *siblings, _row(5), _row(6)]

    packed = envelopes(rows, keys_per_message=8)

    assert _keys(packed) == [["k-1"], ["k-2"], ["k-3", "k-4"], ["k-5", "k-6"]]


def test_a_key_appears_once_per_message() -> None:
    """Two rows of one key in a batch (a retry beside a replay) go in different messages, so
    each message's claim names distinct keys."""
    rows = [_row(1, "a"), _row(2, "b"), _row(3, "a"), _row(4, "c")]

    assert _keys(envelopes(rows, keys_per_message=8)) == [["a", "b"], ["a", "c"]]


def test_other_tasks_go_alone() -> None:
    rows = [_row(1), _row(2, task="idem.other"), _row(3), _row(4)]

    assert _keys(envelopes(rows, keys_per_message=8)) == [["k-1"], ["k-2"], ["k-3", "k-4"]]
