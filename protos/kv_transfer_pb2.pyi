from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class BlockFrame(_message.Message):
    __slots__ = ("request_id", "key", "layer_start", "layer_end", "token_start", "num_tokens", "dtype", "shape", "data", "scales", "fingerprint", "total_tokens", "last", "chunk_index", "num_chunks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    key: str
    layer_start: int
    layer_end: int
    token_start: int
    num_tokens: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    scales: bytes
    fingerprint: str
    total_tokens: int
    last: bool
    chunk_index: int
    num_chunks: int
    def __init__(self, request_id: _Optional[str] = ..., key: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., token_start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., fingerprint: _Optional[str] = ..., total_tokens: _Optional[int] = ..., last: _Optional[bool] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("frames", "bytes", "stored", "error")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    frames: int
    bytes: int
    stored: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, frames: _Optional[int] = ..., bytes: _Optional[int] = ..., stored: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("keys", "fingerprint", "request_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: str
    request_id: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("keys", "fingerprint")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class QueryReply(_message.Message):
    __slots__ = ("present", "tiers")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[str]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, present: _Optional[_Iterable[str]] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...
