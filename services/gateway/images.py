"""Image sources for chat requests: data URLs, allowlisted local files, optional remote fetch.

Every image is checked before it leaves the gateway: encoded size, format (from the header),
pixel count (from the header, so a decompression bomb is refused before it is decoded).
Remote http(s) fetch is off by default; when on, `fetch_image` guards against SSRF: only listed
hosts when a list is set, otherwise only hosts that resolve to public addresses (`ssrf.py`),
at every redirect hop, connecting to the address that was checked.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse, urlsplit, urlunsplit

import httpx
from PIL import Image

from services.gateway.config import GatewayConfig
from services.gateway.core import ApiError
from services.gateway.ssrf import IPAddress, Resolver, blocked_reason, system_resolve


def _bad(msg: str) -> ApiError:
    return ApiError("bad_request", msg, param="messages")


def check_image(raw: bytes, cfg: GatewayConfig) -> None:
    """Size, format and pixel limits, reading only the image header."""
    if len(raw) > cfg.max_image_bytes:
        raise _bad(f"image is {len(raw)} bytes; the limit is {cfg.max_image_bytes}")
    try:
        with Image.open(io.BytesIO(raw)) as img:
            fmt, (w, h) = img.format, img.size
    except Exception:  # noqa: BLE001 - PIL raises many types for junk
        raise _bad("image data is not a decodable image") from None
    allowed = {f.upper() for f in cfg.image_formats}
    if (fmt or "").upper() not in allowed:
        raise _bad(f"image format {fmt} is not accepted (allowed: {', '.join(sorted(allowed))})")
    if w * h > cfg.max_image_pixels:
        raise _bad(f"image is {w}x{h} = {w * h} pixels; the limit is {cfg.max_image_pixels}")


async def load_image(url: str, cfg: GatewayConfig) -> bytes:
    """Raw bytes of one ``image_url`` (checked against every image limit)."""
    if url.startswith("data:"):
        raw = _data_url(url, cfg)
    elif url.startswith(("http://", "https://")):
        raw = await fetch_image(url, cfg)
    else:
        raw = _local(url, cfg)
    check_image(raw, cfg)
    return raw


def _data_url(url: str, cfg: GatewayConfig) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _bad("image data URLs must look like data:image/<fmt>;base64,<data>")
    if len(payload) > cfg.max_image_bytes * 4 // 3 + 8:
        raise _bad(f"image is larger than the limit of {cfg.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("image data URL is not valid base64") from None


def _local(url: str, cfg: GatewayConfig) -> bytes:
    path_str = unquote(urlparse(url).path) if url.startswith("file://") else url
    if not cfg.image_dir:
        raise _bad("local image files are disabled (set --image-dir to allow a folder)")
    root = Path(cfg.image_dir).resolve()
    path = Path(path_str)
    path = (path if path.is_absolute() else root / path).resolve()
    if not path.is_relative_to(root):
        raise ApiError(
            "forbidden", "image path is outside the allowed image folder", param="messages"
        )
    if not path.is_file():
        raise _bad("image file does not exist")
    if path.stat().st_size > cfg.max_image_bytes:
        raise _bad(f"image file is larger than the limit of {cfg.max_image_bytes} bytes")
    return path.read_bytes()


_REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 5


async def fetch_image(
    url: str,
    cfg: GatewayConfig,
    resolve: Resolver = system_resolve,
    blocked: Callable[[IPAddress], str | None] = blocked_reason,
) -> bytes:
    """GET a remote image with SSRF checks at every hop: the host must be on
    ``remote_image_hosts`` when that is set; a host not named there must resolve only to public
    addresses (``blocked``). The connection goes to the checked address (original Host header
    and TLS SNI), and redirects are followed here, each hop checked the same way (403 naming the
    host and why)."""
    if not cfg.allow_remote_images:
        raise ApiError(
            "forbidden", "fetching remote image URLs is disabled on this server", param="messages"
        )
    hosts = {h.lower() for h in cfg.remote_image_hosts}
    try:
        async with httpx.AsyncClient(
            timeout=cfg.bus_timeout, follow_redirects=False, trust_env=False
        ) as client:
            for _ in range(MAX_REDIRECTS + 1):
                target, headers, ext = await _pin(url, hosts, resolve, blocked)
                async with client.stream("GET", target, headers=headers, extensions=ext) as resp:
                    if resp.status_code in _REDIRECTS and resp.headers.get("location"):
                        url = urljoin(url, resp.headers["location"])
                        continue
                    if resp.status_code != 200:
                        raise _bad(f"image URL returned HTTP {resp.status_code}")
                    buf = bytearray()
                    async for chunk in resp.aiter_bytes():
                        buf += chunk
                        if len(buf) > cfg.max_image_bytes:
                            raise _bad(
                                f"image is larger than the limit of {cfg.max_image_bytes} bytes"
                            )
                    return bytes(buf)
    except httpx.HTTPError as exc:
        raise _bad(f"could not fetch image: {type(exc).__name__}") from None
    raise _bad(f"image URL redirected more than {MAX_REDIRECTS} times")


async def _pin(
    url: str, hosts: set[str], resolve: Resolver, blocked: Callable[[IPAddress], str | None]
) -> tuple[str, dict, dict]:
    """The URL to connect to (the host replaced by its checked address), the Host header and
    the TLS SNI extension; `ApiError` 403 for a host that may not be fetched."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise _bad(f"image URL {url[:200]!r} is not an http(s) URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise _bad("image URL has an invalid port") from None
    if hosts and host not in hosts:
        raise ApiError("forbidden", f"image host {host!r} is not allowed", param="messages")
    try:
        addrs = await resolve(host, port)
    except OSError:
        raise _bad(f"image host {host!r} does not resolve") from None
    if not addrs:
        raise _bad(f"image host {host!r} does not resolve")
    if host not in hosts:  # a host the operator named may be private; any other must be public
        for ip in addrs:
            why = blocked(ip)
            if why:
                raise ApiError(
                    "forbidden",
                    f"image host {host!r} resolves to {ip}, a {why} "
                    "address; remote images must come from public addresses",
                    param="messages",
                )
    ip = addrs[0]
    netloc = f"[{ip}]" if ip.version == 6 else str(ip)
    target = urlunsplit((parts.scheme, f"{netloc}:{port}", parts.path or "/", parts.query, ""))
    host_header = f"[{host}]" if ":" in host else host
    if parts.port:
        host_header += f":{parts.port}"
    ext = {"sni_hostname": host} if parts.scheme == "https" else {}
    return target, {"Host": host_header}, ext
