"""Which FORWARDED_ALLOW_IPS values trust every address (and stop `idem serve`)."""

from __future__ import annotations

import pytest

from outbox.core.connections import trusts_everyone


@pytest.mark.parametrize(
    "value",
    [
        "*",
        "0.0.0.0/0",
        "::/0",
        "0/0",
        "10.0.0.5, ::/00",
        "0.0.0.0/1,128.0.0.0/1",
        "::/1, 8000::/1",
        "127.0.0.1,0.0.0.0/0",
    ],
)
def test_networks_holding_every_address_are_recognised(value: str) -> None:
    """A wildcard, a prefix length of 0 in any spelling, or networks that together hold every
    IPv4 or every IPv6 address trust everyone."""
    assert trusts_everyone(value)


@pytest.mark.parametrize(
    "value",
    ["127.0.0.1", "172.30.83.10", "10.0.0.0/8, 192.168.0.0/16", "::1", "0.0.0.0/1", "unix:/run/x"],
)
def test_proxy_addresses_and_networks_are_kept(value: str) -> None:
    """Addresses, private networks and half of the address space are proxies, not everyone."""
    assert not trusts_everyone(value)
