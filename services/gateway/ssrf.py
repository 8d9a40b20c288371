"""Which addresses a remote image fetch may connect to (pure: no sockets).

A URL's host is resolved once; the fetch is refused when **any** resolved address is loopback,
private, link-local, multicast, reserved, unspecified or otherwise not globally routable, and
IPv6 forms that embed an IPv4 address (IPv4-mapped ``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``
and ``64:ff9b:1::/48``, 6to4 ``2002::/16``, Teredo) are judged by the address they embed. The
connection then goes to the checked address (see `images.py`), so a second DNS answer cannot
swap in another one.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address, IPv6Address, IPv6Network, ip_address

IPAddress = IPv4Address | IPv6Address
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
"""``(host, port) -> addresses``: how a host name is resolved (injectable for tests)."""

_NAT64 = (IPv6Network("64:ff9b::/96"), IPv6Network("64:ff9b:1::/48"))
_FLAGS = ("loopback", "unspecified", "link_local", "multicast", "reserved", "private")


def embedded_ipv4(ip: IPv6Address) -> tuple[str, IPv4Address] | None:
    """The IPv4 address an IPv6 address carries, with the form's name, or None."""
    if ip.ipv4_mapped is not None:
        return "IPv4-mapped", ip.ipv4_mapped
    if any(ip in net for net in _NAT64):
        return "NAT64", IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return "6to4", ip.sixtofour
    if ip.teredo is not None:
        return "Teredo", ip.teredo[1]
    return None


def blocked_reason(ip: IPAddress) -> str | None:
    """Why ``ip`` must not be fetched from ("loopback", "NAT64 form of a private address", ...),
    or None when it is a public address."""
    if isinstance(ip, IPv6Address):
        inner = embedded_ipv4(ip)
        if inner is not None:
            form, v4 = inner
            why = blocked_reason(v4)
            return f"{form} form of a {why} address" if why else None
    for flag in _FLAGS:
        if getattr(ip, f"is_{flag}"):
            return flag.replace("_", "-")
    if not ip.is_global:  # shared address space (100.64/10), documentation ranges, ...
        return "non-global"
    return None


def parse_ip(text: str) -> IPAddress | None:
    """``text`` as an IP address (brackets and an IPv6 zone are dropped), or None."""
    try:
        return ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


async def system_resolve(host: str, port: int) -> list[IPAddress]:
    """Every address the system resolver gives for ``host`` (an IP literal is returned as is)."""
    literal = parse_ip(host)
    if literal is not None:
        return [literal]
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[IPAddress] = []
    for *_, sockaddr in infos:
        ip = parse_ip(str(sockaddr[0]))
        if ip is not None and ip not in out:
            out.append(ip)
    return out
