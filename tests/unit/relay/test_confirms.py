"""Unit tests for outbox.relay.publisher.Confirms: which of a batch's publishes the broker acked,
from RabbitMQ's acks and nacks (each for one delivery tag, or every tag up to it)."""

from __future__ import annotations

from outbox.relay.publisher import Confirms


def test_single_acks_settle_their_own_tags_only() -> None:
    """Acks for 1 and 3 leave 2 open: the batch is not settled until 2 is answered."""
    confirms = Confirms()
    confirms.ack(1, False)
    confirms.ack(3, False)
    assert confirms.acked == {1, 3}
    assert not confirms.all_settled(3)
    confirms.ack(2, False)
    assert confirms.all_settled(3)


def test_a_multiple_ack_settles_every_open_tag_up_to_its_own() -> None:
    """An ack of 5 with `multiple` settles 1 to 5, but not 6."""
    confirms = Confirms()
    confirms.ack(5, True)
    assert confirms.acked == {1, 2, 3, 4, 5}
    assert confirms.all_settled(5) and not confirms.all_settled(6)


def test_a_multiple_ack_after_a_nack_leaves_the_nacked_tag_nacked() -> None:
    """Tag 2 nacked, then an ack of 4 with `multiple`: 1, 3 and 4 are acked, 2 stays nacked."""
    confirms = Confirms()
    confirms.nack(2, False)
    confirms.ack(4, True)
    assert confirms.acked == {1, 3, 4}
    assert confirms.nacked == {2}
    assert confirms.all_settled(4)


def test_a_multiple_nack_refuses_every_open_tag_up_to_its_own() -> None:
    """An ack of 1, then a nack of 3 with `multiple`: 2 and 3 are nacked, 1 stays acked."""
    confirms = Confirms()
    confirms.ack(1, False)
    confirms.nack(3, True)
    assert confirms.acked == {1}
    assert confirms.nacked == {2, 3}
    assert confirms.all_settled(3)
