"""Remote image fetch cannot reach internal addresses (SSRF): every blocked form is refused
before connecting, redirects are re-checked per hop, the connection goes to the checked address.

All traffic stays on loopback: a decoy HTTP server on 127.0.0.1 counts hits, and a "public"
server on 127.0.0.2 is made to look public by an injected resolver and address policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from ipaddress import ip_address

import httpx
import pytest
from PIL import Image

from services.gateway.config import GatewayConfig
from services.gateway.core import ApiError
from services.gateway.images import fetch_image
from services.gateway.ssrf import blocked_reason, parse_ip, system_resolve
from tests.gateway.harness import gateway


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


class Server:
    """A tiny HTTP/1.1 server: ``routes`` path -> (status, headers, body); counts hits and
    records the Host header of each."""

    def __init__(self, host: str, routes: dict[str, tuple[int, dict, bytes]]):
        self.host, self.routes = host, routes
        self.hits: list[tuple[str, str]] = []  # (path, Host header)
        self.port = 0

    async def _handle(self, reader, writer) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split(" ")[1]
        host = next(
            (ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.lower().startswith("host:")), ""
        )
        self.hits.append((path, host))
        status, headers, body = self.routes.get(path, (404, {}, b""))
        hdr = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{hdr}"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    @contextlib.asynccontextmanager
    async def running(self):
        srv = await asyncio.start_server(self._handle, self.host, 0)
        self.port = srv.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            srv.close()
            await srv.wait_closed()


def cfg(**kw) -> GatewayConfig:
    return GatewayConfig.load([], role="gateway", **{"allow_remote_images": True, **kw})


@pytest.mark.parametrize(
    "text,reason",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("10.1.2.3", "private"),
        ("192.168.0.1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("224.0.0.1", "multicast"),
        ("fc00::1", "private"),
        ("100.64.0.1", "non-global"),
        ("240.0.0.1", "reserved"),
        ("::ffff:127.0.0.1", "IPv4-mapped form of a loopback address"),
        ("[::ffff:10.0.0.1]", "IPv4-mapped form of a private address"),
        ("64:ff9b::7f00:1", "NAT64 form of a loopback address"),
        ("64:ff9b:1::a9fe:a9fe", "NAT64 form of a link-local address"),
        ("2002:7f00:1::1", "6to4 form of a loopback address"),
        ("8.8.8.8", None),
        ("2001:4860:4860::8888", None),
        ("::ffff:8.8.8.8", None),
        ("64:ff9b::808:808", None),
        ("2002:808:808::1", None),
    ],
)
def test_address_policy(text, reason):
    why = blocked_reason(parse_ip(text))
    assert why == reason


async def test_blocked_forms_never_reach_the_decoy():
    async with Server("127.0.0.1", {"/cat.png": (200, {}, png())}).running() as decoy:
        p = decoy.port
        for url in (
            f"http://127.0.0.1:{p}/cat.png",
            f"http://localhost:{p}/cat.png",
            f"http://[::1]:{p}/cat.png",
            f"http://[::ffff:127.0.0.1]:{p}/cat.png",
            f"http://0.0.0.0:{p}/cat.png",
            f"http://2130706433:{p}/cat.png",
            f"http://[64:ff9b::7f00:1]:{p}/cat.png",
        ):
            with pytest.raises(ApiError) as ei:
                await fetch_image(url, cfg())
            assert ei.value.http_status == 403, url
            assert "public addresses" in ei.value.message and "resolves to" in ei.value.message
        assert decoy.hits == []
        # the control: the operator names the host, so this private host may be fetched
        assert (
            await fetch_image(f"http://127.0.0.1:{p}/cat.png", cfg(remote_image_hosts="127.0.0.1"))
            == png()
        )
        assert decoy.hits == [("/cat.png", f"127.0.0.1:{p}")]


async def test_redirects_are_checked_per_hop_and_the_checked_address_is_used():
    """``images.test`` "resolves" to 127.0.0.2, which the injected policy treats as public; it
    redirects to the decoy on 127.0.0.1, and that hop is refused."""
    public = ip_address("127.0.0.2")
    resolved: list[str] = []

    async def resolve(host: str, port: int):
        resolved.append(host)
        return [public] if host == "images.test" else await system_resolve(host, port)

    def blocked(ip):
        return None if ip == public else blocked_reason(ip)

    async with Server("127.0.0.1", {"/cat.png": (200, {}, png())}).running() as decoy:
        to_decoy = {"location": f"http://127.0.0.1:{decoy.port}/cat.png"}
        to_local = {"location": f"http://localhost:{decoy.port}/cat.png"}
        routes = {
            "/ok.png": (200, {}, png()),
            "/hop": (302, {"location": "/ok.png"}, b""),
            "/r1": (302, to_decoy, b""),
            "/r2": (301, to_local, b""),
            "/loop": (302, {"location": "/loop"}, b""),
        }
        async with Server("127.0.0.2", routes).running() as pub:
            base = f"http://images.test:{pub.port}"
            # allowed: fetched from the checked address with the original Host header, even
            # though the name does not resolve anywhere else (no second lookup at connect)
            assert await fetch_image(f"{base}/hop", cfg(), resolve, blocked) == png()
            assert pub.hits == [
                ("/hop", f"images.test:{pub.port}"),
                ("/ok.png", f"images.test:{pub.port}"),
            ]
            assert resolved == ["images.test", "images.test"]  # once per hop
            for path in ("/r1", "/r2"):
                with pytest.raises(ApiError) as ei:
                    await fetch_image(f"{base}{path}", cfg(), resolve, blocked)
                assert ei.value.http_status == 403 and "loopback" in ei.value.message
            with pytest.raises(ApiError, match="redirected more than 5 times"):
                await fetch_image(f"{base}/loop", cfg(), resolve, blocked)
            # an allow-list refuses a redirect to a host it does not name
            with pytest.raises(ApiError, match="'127.0.0.1' is not allowed"):
                await fetch_image(f"{base}/r1", cfg(remote_image_hosts="images.test"), resolve)
        assert decoy.hits == []


async def test_rest_refuses_internal_image_urls(nats_url):
    async with Server("127.0.0.1", {"/cat.png": (200, {}, png())}).running() as decoy:
        p = decoy.port
        async with gateway(nats_url, allow_remote_images=True, peers_kw={"max_model_len": 256}) as (
            url,
            peers,
            _s,
        ):
            async with httpx.AsyncClient(base_url=url) as c:
                for img in (
                    f"http://127.0.0.1:{p}/cat.png",
                    f"http://localhost:{p}/cat.png",
                    f"http://[::1]:{p}/cat.png",
                    f"http://[::ffff:127.0.0.1]:{p}/a",
                    f"http://0.0.0.0:{p}/cat.png",
                ):
                    msg = [
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": img}}],
                        }
                    ]
                    r = await c.post(
                        "/v1/chat/completions",
                        json={"model": "tiny", "messages": msg, "max_tokens": 1},
                    )
                    assert r.status_code == 403, r.text
                    assert "public addresses" in r.json()["error"]["message"]
            assert peers.items == []
        assert decoy.hits == []
