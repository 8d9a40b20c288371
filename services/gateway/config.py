"""`GatewayConfig`: every gateway setting, from ``STRATA_*`` env vars or ``--flags``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from shared.config import ServiceConfig


class GatewayConfig(ServiceConfig):
    """Frozen gateway settings; limits apply per request and each has a clear 4xx."""

    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = pick a free port)")
    model: str = Field("", description="Checkpoint directory (token strings for logprobs)")
    model_name: str = Field("", description="Served model name (default: directory name)")
    # auth
    api_keys: list[str] = Field([], description="Comma-separated API keys allowed for every model")
    api_key_file: str = Field("", description="JSON/YAML file: key -> {models, rpm, tpm}")
    tenant_weights: list[str] = Field(
        [],
        description="Fair-queuing weights 'keyname:weight' (comma-separated; a key's name: "
        "env-<i> for STRATA_API_KEYS, its 'name' in the key file; 'default' with auth off); "
        "a tenant not listed has weight 1",
    )
    cache_isolation: Literal["none", "tenant"] = Field(
        "none",
        description="'tenant': each tenant's prompts hash under its own salt, so cached KV "
        "(prefix cache, pool) is never shared between tenants (no cross-tenant prefix-cache "
        "timing signal; a request's cache_salt splits it further); 'none': shared by content",
    )
    prefilter_lists: list[str] = Field(
        [],
        description="Pre-filter pattern lists 'refuse:CODE:PATH' or 'mask:CODE:PATH' "
        "(comma-separated; one UTF-8 pattern a line, reloaded when the file changes)",
    )
    prefilter_reload_s: float = Field(
        1.0, gt=0, description="Seconds between checks of the pattern files for changes"
    )
    # audit log (services/gateway/audit.py)
    audit_file: str = Field("", description="Append one JSON line per API request here ('' = off)")
    audit_stream: bool = Field(
        True, description="Also publish each audit line to the JetStream stream STRATA_AUDIT"
    )
    audit_prompts: bool = Field(
        False, description="Put the prompt (messages / prompt) in audit entries (opt-in)"
    )
    audit_max_age: float = Field(
        7 * 86400.0, ge=0, description="Seconds STRATA_AUDIT keeps an entry (0 = no age limit)"
    )
    audit_max_bytes: int = Field(
        256 << 20, ge=0, description="Bytes STRATA_AUDIT keeps, oldest dropped (0 = unbounded)"
    )
    # limits
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest accepted request body")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when the request has none")
    max_n: int = Field(8, ge=1, le=128, description="Largest n (choices per request)")
    max_images: int = Field(4, ge=0, description="Most images per request")
    max_image_bytes: int = Field(4 << 20, ge=1, description="Largest encoded image")
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="Most pixels per image")
    image_formats: list[str] = Field(
        ["PNG", "JPEG", "WEBP", "GIF", "BMP"],
        description="Accepted image formats (comma-separated)",
    )
    image_dir: str = Field("", description="Folder local image paths must be under ('' = none)")
    allow_remote_images: bool = Field(
        False, description="Fetch http(s) image URLs (only from public addresses, see ssrf.py)"
    )
    remote_image_hosts: list[str] = Field(
        [],
        description="Comma-separated hosts allowed for fetching ('' = any public host); a "
        "host named here may be private",
    )
    # HTTPS
    tls_cert: str = Field("", description="Certificate (PEM) to serve HTTPS with ('' = plain HTTP)")
    tls_key: str = Field("", validate_default=True, description="Key of tls_cert")
    tls_client_ca: str = Field(
        "", description="Require client certificates signed by this CA (mutual TLS; '' = off)"
    )
    reasoning_parser: str = Field(
        "",
        description="Split chat answers' reasoning at <think> tags into reasoning_content: "
        "'qwen3', 'deepseek_r1' or 'think' (one rule; vLLM's names), '' or 'none' = off",
    )
    # timeouts
    bus_timeout: float = Field(10.0, gt=0, description="Seconds to wait for a bus reply")
    first_token_timeout: float = Field(60.0, gt=0, description="Seconds to wait for token one")
    stall_timeout: float = Field(15.0, gt=0, description="Seconds without tokens -> failover")
    max_failovers: int = Field(2, ge=0, description="Re-routes of one stream before giving up")
    health_timeout: float = Field(1.0, gt=0, description="Seconds a readiness probe waits per role")
    ready_cache_s: float = Field(
        1.0, ge=0, description="Seconds a readiness verdict is reused (/health, request path)"
    )
    unready_retry_after: float = Field(
        2.0, gt=0, description="Retry-After seconds on 503 while the cluster cannot serve"
    )
    sse_header_hold: float = Field(
        0.05, ge=0, description="Seconds a stream's headers wait for token one (one write for both)"
    )
    # response cache (services/gateway/response_cache.py; docs/api.md)
    response_cache: bool = Field(
        False,
        description="Serve repeated deterministic requests that ask for it (body 'cache': true "
        "or X-Strata-Cache: use) from a response cache",
    )
    response_cache_bytes: int = Field(
        256 << 20, ge=0, description="Byte budget of the response cache's in-memory (hot) tier"
    )
    response_cache_max_entry_bytes: int = Field(
        4 << 20, ge=1, description="Largest stored response (bigger ones are not cached)"
    )
    kvstore_addrs: list[str] = Field(
        [],
        description="Comma-separated kvstore gRPC addresses: the response cache's warm (DRAM) "
        "and cold (MinIO) tiers ('' = in-memory tier only)",
    )
    response_cache_timeout: float = Field(
        2.0, gt=0, description="Seconds a kvstore read or write of the response cache may take"
    )
    # Degradation: the level and its rules (caps, top priority, Retry-After) come from the
    # scheduler's state (`SchedulerState.rules`); the gateway has no numbers of its own.

    @field_validator("tls_key", "tls_client_ca", mode="after")
    @classmethod
    def _tls_pair(cls, v: str, info: ValidationInfo) -> str:
        cert = info.data.get("tls_cert", "")
        if info.field_name == "tls_key" and bool(cert) != bool(v):
            raise ValueError("give STRATA_TLS_CERT and STRATA_TLS_KEY both, or neither")
        if info.field_name == "tls_client_ca" and v and not cert:
            raise ValueError("needs STRATA_TLS_CERT and STRATA_TLS_KEY (HTTPS)")
        return v

    @field_validator("reasoning_parser", mode="after")
    @classmethod
    def _reasoning_parser(cls, v: str) -> str:
        from services.gateway.reasoning import PARSERS

        if v not in PARSERS:
            names = ", ".join(repr(k) for k in PARSERS if k)
            raise ValueError(f"unknown reasoning parser {v!r} (one of {names}, or '')")
        return v
