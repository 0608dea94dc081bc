from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("version", "model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    version: int
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, version: _Optional[int] = ..., model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("layout", "block_hashes", "encoding", "socket")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    encoding: str
    socket: bool
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., encoding: _Optional[str] = ..., socket: _Optional[bool] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("layout", "num_blocks", "bytes_per_block", "encoding", "checksum", "socket_port", "ticket")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    num_blocks: int
    bytes_per_block: int
    encoding: str
    checksum: str
    socket_port: int
    ticket: bytes
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., encoding: _Optional[str] = ..., checksum: _Optional[str] = ..., socket_port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class KVData(_message.Message):
    __slots__ = ("first_block", "num_blocks", "payload", "checksum")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    num_blocks: int
    payload: bytes
    checksum: int
    def __init__(self, first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., payload: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class KVMessage(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: KVData
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[_Union[KVData, _Mapping]] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("num_bytes", "chunk_bytes")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    chunk_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("num_requests",)
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    def __init__(self, num_requests: _Optional[int] = ...) -> None: ...
