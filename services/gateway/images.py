"""Image sources for chat requests: data URLs, allowlisted local files, optional remote fetch.

Every image is checked before it leaves the gateway: encoded size, format (from the header),
pixel count (from the header, so a decompression bomb is refused before it is decoded).
Remote http(s) fetch is off by default (SSRF); when on, only listed hosts are fetched.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
from PIL import Image

from services.gateway.config import GatewayConfig
from services.gateway.core import ApiError


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
    allowed = {f.strip().upper() for f in cfg.image_formats.split(",") if f.strip()}
    if (fmt or "").upper() not in allowed:
        raise _bad(f"image format {fmt} is not accepted (allowed: {', '.join(sorted(allowed))})")
    if w * h > cfg.max_image_pixels:
        raise _bad(f"image is {w}x{h} = {w * h} pixels; the limit is {cfg.max_image_pixels}")


async def load_image(url: str, cfg: GatewayConfig) -> bytes:
    """Raw bytes of one ``image_url`` (checked against every image limit)."""
    if url.startswith("data:"):
        raw = _data_url(url, cfg)
    elif url.startswith(("http://", "https://")):
        raw = await _fetch(url, cfg)
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
        raise ApiError("forbidden", "image path is outside the allowed image folder",
                       param="messages")  # fmt: skip
    if not path.is_file():
        raise _bad("image file does not exist")
    if path.stat().st_size > cfg.max_image_bytes:
        raise _bad(f"image file is larger than the limit of {cfg.max_image_bytes} bytes")
    return path.read_bytes()


async def _fetch(url: str, cfg: GatewayConfig) -> bytes:
    if not cfg.allow_remote_images:
        raise ApiError("forbidden", "fetching remote image URLs is disabled on this server",
                       param="messages")  # fmt: skip
    hosts = {h.strip().lower() for h in cfg.remote_image_hosts.split(",") if h.strip()}
    host = (urlparse(url).hostname or "").lower()
    if hosts and host not in hosts:
        raise ApiError("forbidden", f"image host {host!r} is not allowed", param="messages")
    try:
        async with httpx.AsyncClient(timeout=cfg.bus_timeout, follow_redirects=False) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise _bad(f"image URL returned HTTP {resp.status_code}")
                buf = bytearray()
                async for chunk in resp.aiter_bytes():
                    buf += chunk
                    if len(buf) > cfg.max_image_bytes:
                        raise _bad(f"image is larger than the limit of {cfg.max_image_bytes} bytes")
                return bytes(buf)
    except httpx.HTTPError as exc:
        raise _bad(f"could not fetch image: {type(exc).__name__}") from None
