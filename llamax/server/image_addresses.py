"""Which addresses an image URL may be fetched from (``--allow-image-urls``): public
unicast ones, and any in the networks the operator lists (``--image-url-allow-network``).

Loopback, private (RFC 1918, CGNAT ``100.64/10``, ULA ``fc00::/7``), link-local,
site-local, multicast, unspecified, reserved and documentation ranges are refused, v4 and
v6, and so is a v6 address that carries such a v4 one (mapped, 6to4, Teredo, NAT64).
``ipaddress``' own properties are checked, and an explicit table besides, since its
tables differ between Python versions.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

__all__ = ["IPAddress", "Network", "is_address_allowed", "parse_networks"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_REFUSED = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
        "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16",
        "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
        "::/96", "::ffff:0:0/96", "64:ff9b:1::/48", "100::/64", "2001:db8::/32",
        "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
    )
)  # fmt: skip
"""Refused whatever ``ipaddress`` says of them (its tables vary between Python versions)."""
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def parse_networks(networks: Iterable[str]) -> tuple[Network, ...]:
    """``networks`` (CIDR strings, ``"10.0.0.0/8"``, or single addresses) parsed.

    Raises:
        ValueError: one is not a network.
    """
    return tuple(ipaddress.ip_network(n.strip(), strict=False) for n in networks)


def is_address_allowed(address: IPAddress, allowed: Sequence[Network] = ()) -> bool:
    """Whether a fetch may connect to ``address``: it is in ``allowed``, or it is a public
    unicast address (and a v6 one embeds no v4 address that is not)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address in network for network in allowed if network.version == address.version):
        return True
    return _is_public(address)


def _is_public(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_v4(address)
        if embedded is not None and not _is_public(embedded):
            return False
        if address.is_site_local:
            return False
    if any(address in network for network in _REFUSED if network.version == address.version):
        return False
    return address.is_global and not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_unspecified
        or address.is_reserved
    )


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The v4 address a v6 one carries (mapped, 6to4, Teredo's client, NAT64), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None
