"""The one codec of the bus: pydantic model <-> msgpack bytes.

An error reply is the map ``{"__error__": {...}}`` (see `errors.ErrorInfo`), so a requester can tell
it from a normal reply without knowing the reply type in advance.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel

from shared.protocol.errors import ERROR_KEY, ErrorInfo, StrataError

M = TypeVar("M", bound=BaseModel)


def encode(msg: BaseModel) -> bytes:
    """Serialise a message model (bytes fields stay raw bytes)."""
    return msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)


def decode(data: bytes, model: type[M]) -> M:
    """Parse bytes into ``model``; raises `StrataError` if the bytes carry an error reply."""
    obj = _unpack(data)
    if isinstance(obj, dict) and ERROR_KEY in obj:
        raise ErrorInfo.model_validate(obj[ERROR_KEY]).to_exception()
    return model.model_validate(obj)


def encode_error(err: StrataError) -> bytes:
    return msgpack.packb({ERROR_KEY: err.info().model_dump()}, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except msgpack.StackError:
        raise StrataError(
            "bad_request", "message is not valid msgpack: nested too deeply"
        ) from None
    except Exception as exc:  # msgpack raises several unrelated types
        why = str(exc) or type(exc).__name__
        raise StrataError("bad_request", f"message is not valid msgpack: {why}") from exc
