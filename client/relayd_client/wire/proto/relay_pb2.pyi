from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_VERSION_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_DAEMON_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_PERMISSION_DENIED: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_STALE_REF: _ClassVar[ErrorCode]
    ERROR_CODE_STALE_EPOCH: _ClassVar[ErrorCode]
    ERROR_CODE_CORRUPT_REF: _ClassVar[ErrorCode]
    ERROR_CODE_ABORTED: _ClassVar[ErrorCode]
    ERROR_CODE_DRAINING: _ClassVar[ErrorCode]
    ERROR_CODE_TIMEOUT: _ClassVar[ErrorCode]
    ERROR_CODE_UNSAFE_PAYLOAD: _ClassVar[ErrorCode]
    ERROR_CODE_SESSION_CLOSED: _ClassVar[ErrorCode]
    ERROR_CODE_PEER_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_STREAM_ERROR: _ClassVar[ErrorCode]
    ERROR_CODE_KEY_EXISTS: _ClassVar[ErrorCode]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_INLINE: _ClassVar[Transport]
    TRANSPORT_LOCAL_OBJECT: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC_DIRECT: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC_POOL: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_MOONCAKE: _ClassVar[Transport]
    TRANSPORT_SOCKET: _ClassVar[Transport]

class LeaseState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATE_UNSPECIFIED: _ClassVar[LeaseState]
    LEASE_STATE_RESERVED: _ClassVar[LeaseState]
    LEASE_STATE_PUBLISHED: _ClassVar[LeaseState]
    LEASE_STATE_CLAIMED: _ClassVar[LeaseState]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_BOUND: _ClassVar[EventKind]
    EVENT_KIND_REGISTRY: _ClassVar[EventKind]
    EVENT_KIND_DRAINING: _ClassVar[EventKind]
    EVENT_KIND_RECLAIM: _ClassVar[EventKind]
    EVENT_KIND_ERROR: _ClassVar[EventKind]

class DaemonState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DAEMON_STATE_UNSPECIFIED: _ClassVar[DaemonState]
    DAEMON_STATE_STARTING: _ClassVar[DaemonState]
    DAEMON_STATE_SERVING: _ClassVar[DaemonState]
    DAEMON_STATE_DRAINING: _ClassVar[DaemonState]
    DAEMON_STATE_STOPPED: _ClassVar[DaemonState]

class HeaderCodec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEADER_CODEC_UNSPECIFIED: _ClassVar[HeaderCodec]
    HEADER_CODEC_SAFE: _ClassVar[HeaderCodec]
    HEADER_CODEC_PICKLE: _ClassVar[HeaderCodec]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_VERSION_MISMATCH: ErrorCode
ERROR_CODE_DAEMON_UNAVAILABLE: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_PERMISSION_DENIED: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode
ERROR_CODE_STALE_REF: ErrorCode
ERROR_CODE_STALE_EPOCH: ErrorCode
ERROR_CODE_CORRUPT_REF: ErrorCode
ERROR_CODE_ABORTED: ErrorCode
ERROR_CODE_DRAINING: ErrorCode
ERROR_CODE_TIMEOUT: ErrorCode
ERROR_CODE_UNSAFE_PAYLOAD: ErrorCode
ERROR_CODE_SESSION_CLOSED: ErrorCode
ERROR_CODE_PEER_UNAVAILABLE: ErrorCode
ERROR_CODE_STREAM_ERROR: ErrorCode
ERROR_CODE_KEY_EXISTS: ErrorCode
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_INLINE: Transport
TRANSPORT_LOCAL_OBJECT: Transport
TRANSPORT_CUDA_IPC_DIRECT: Transport
TRANSPORT_CUDA_IPC_POOL: Transport
TRANSPORT_SHM: Transport
TRANSPORT_MOONCAKE: Transport
TRANSPORT_SOCKET: Transport
LEASE_STATE_UNSPECIFIED: LeaseState
LEASE_STATE_RESERVED: LeaseState
LEASE_STATE_PUBLISHED: LeaseState
LEASE_STATE_CLAIMED: LeaseState
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_BOUND: EventKind
EVENT_KIND_REGISTRY: EventKind
EVENT_KIND_DRAINING: EventKind
EVENT_KIND_RECLAIM: EventKind
EVENT_KIND_ERROR: EventKind
DAEMON_STATE_UNSPECIFIED: DaemonState
DAEMON_STATE_STARTING: DaemonState
DAEMON_STATE_SERVING: DaemonState
DAEMON_STATE_DRAINING: DaemonState
DAEMON_STATE_STOPPED: DaemonState
HEADER_CODEC_UNSPECIFIED: HeaderCodec
HEADER_CODEC_SAFE: HeaderCodec
HEADER_CODEC_PICKLE: HeaderCodec

class TensorLayout(_message.Message):
    __slots__ = ("index", "shape", "dtype", "offset", "nbytes", "device", "cuda_ipc")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    index: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offset: int
    nbytes: int
    device: str
    cuda_ipc: CudaIpcHandle
    def __init__(self, index: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., device: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("handle", "storage_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "stride", "storage_offset")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    def __init__(self, handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ...) -> None: ...

class Origin(_message.Message):
    __slots__ = ("node_id", "daemon_epoch", "peer_address", "mooncake_session", "stage")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_SESSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    daemon_epoch: str
    peer_address: str
    mooncake_session: str
    stage: str
    def __init__(self, node_id: _Optional[str] = ..., daemon_epoch: _Optional[str] = ..., peer_address: _Optional[str] = ..., mooncake_session: _Optional[str] = ..., stage: _Optional[str] = ...) -> None: ...

class LeaseRef(_message.Message):
    __slots__ = ("pool", "segment", "slot", "nslots", "offset", "length", "generation", "lease_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    segment: int
    slot: int
    nslots: int
    offset: int
    length: int
    generation: int
    lease_id: int
    def __init__(self, pool: _Optional[str] = ..., segment: _Optional[int] = ..., slot: _Optional[int] = ..., nslots: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., generation: _Optional[int] = ..., lease_id: _Optional[int] = ...) -> None: ...

class DataRef(_message.Message):
    __slots__ = ("version", "object_id", "request_id", "chunk_id", "transport", "origin", "lease", "tensors", "header_codec", "header", "inline_data", "to_stage", "kind", "message", "cuda_event", "refs", "push")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    HEADER_CODEC_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENT_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    version: int
    object_id: str
    request_id: str
    chunk_id: int
    transport: Transport
    origin: Origin
    lease: LeaseRef
    tensors: _containers.RepeatedCompositeFieldContainer[TensorLayout]
    header_codec: HeaderCodec
    header: bytes
    inline_data: bytes
    to_stage: str
    kind: int
    message: str
    cuda_event: bytes
    refs: _containers.RepeatedCompositeFieldContainer[DataRef]
    push: bool
    def __init__(self, version: _Optional[int] = ..., object_id: _Optional[str] = ..., request_id: _Optional[str] = ..., chunk_id: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ..., origin: _Optional[_Union[Origin, _Mapping]] = ..., lease: _Optional[_Union[LeaseRef, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorLayout, _Mapping]]] = ..., header_codec: _Optional[_Union[HeaderCodec, str]] = ..., header: _Optional[bytes] = ..., inline_data: _Optional[bytes] = ..., to_stage: _Optional[str] = ..., kind: _Optional[int] = ..., message: _Optional[str] = ..., cuda_event: _Optional[bytes] = ..., refs: _Optional[_Iterable[_Union[DataRef, _Mapping]]] = ..., push: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("protocol_version", "stages", "pid", "node_hint", "namespaces", "gpu_uuids")
    class NamespacesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NODE_HINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    stages: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    node_hint: str
    namespaces: _containers.ScalarMap[str, str]
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., stages: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ..., node_hint: _Optional[str] = ..., namespaces: _Optional[_Mapping[str, str]] = ..., gpu_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("name", "size", "index")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    index: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("protocol_version", "session_id", "session_token", "session_socket", "node_id", "daemon_epoch", "slot_size", "header_offset", "header_stride", "data_offset", "segments", "default_grant_bytes", "lease_ttl_seconds", "peer_address", "mooncake_session", "cuda_pools", "pin_host_memory", "probe_offset", "reserve_publishes", "compact_refs", "reserve_over_read")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEADER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HEADER_STRIDE_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_GRANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_SESSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_POOLS_FIELD_NUMBER: _ClassVar[int]
    PIN_HOST_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PROBE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RESERVE_PUBLISHES_FIELD_NUMBER: _ClassVar[int]
    COMPACT_REFS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_OVER_READ_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    session_id: str
    session_token: bytes
    session_socket: str
    node_id: str
    daemon_epoch: str
    slot_size: int
    header_offset: int
    header_stride: int
    data_offset: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    default_grant_bytes: int
    lease_ttl_seconds: float
    peer_address: str
    mooncake_session: str
    cuda_pools: _containers.RepeatedCompositeFieldContainer[CudaPool]
    pin_host_memory: str
    probe_offset: int
    reserve_publishes: bool
    compact_refs: bool
    reserve_over_read: bool
    def __init__(self, protocol_version: _Optional[int] = ..., session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ..., session_socket: _Optional[str] = ..., node_id: _Optional[str] = ..., daemon_epoch: _Optional[str] = ..., slot_size: _Optional[int] = ..., header_offset: _Optional[int] = ..., header_stride: _Optional[int] = ..., data_offset: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., default_grant_bytes: _Optional[int] = ..., lease_ttl_seconds: _Optional[float] = ..., peer_address: _Optional[str] = ..., mooncake_session: _Optional[str] = ..., cuda_pools: _Optional[_Iterable[_Union[CudaPool, _Mapping]]] = ..., pin_host_memory: _Optional[str] = ..., probe_offset: _Optional[int] = ..., reserve_publishes: _Optional[bool] = ..., compact_refs: _Optional[bool] = ..., reserve_over_read: _Optional[bool] = ...) -> None: ...

class CudaPool(_message.Message):
    __slots__ = ("name", "gpu_uuid", "nslots", "slot_size", "storage", "headers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    gpu_uuid: str
    nslots: int
    slot_size: int
    storage: CudaIpcHandle
    headers: Segment
    def __init__(self, name: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., nslots: _Optional[int] = ..., slot_size: _Optional[int] = ..., storage: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., headers: _Optional[_Union[Segment, _Mapping]] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("session_id", "session_token", "min_bytes", "timeout_seconds", "pool")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: bytes
    min_bytes: int
    timeout_seconds: float
    pool: str
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ..., min_bytes: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., pool: _Optional[str] = ...) -> None: ...

class GrantResponse(_message.Message):
    __slots__ = ("grant_id", "segment", "slot", "nslots", "generation_base", "pool")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_BASE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    segment: int
    slot: int
    nslots: int
    generation_base: int
    pool: str
    def __init__(self, grant_id: _Optional[int] = ..., segment: _Optional[int] = ..., slot: _Optional[int] = ..., nslots: _Optional[int] = ..., generation_base: _Optional[int] = ..., pool: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session_id", "session_token", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: bytes
    request_id: str
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("leases_freed", "bytes_freed")
    LEASES_FREED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    leases_freed: int
    bytes_freed: int
    def __init__(self, leases_freed: _Optional[int] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("session_id", "session_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: bytes
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "granted_bytes", "largest_free_run_bytes", "slot_size", "slots", "free_slots")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_RUN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    granted_bytes: int
    largest_free_run_bytes: int
    slot_size: int
    slots: int
    free_slots: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., granted_bytes: _Optional[int] = ..., largest_free_run_bytes: _Optional[int] = ..., slot_size: _Optional[int] = ..., slots: _Optional[int] = ..., free_slots: _Optional[int] = ...) -> None: ...

class LeaseStatus(_message.Message):
    __slots__ = ("lease_id", "state", "pool", "bytes", "request_id", "from_stage", "to_stage", "age_seconds", "session_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    state: LeaseState
    pool: str
    bytes: int
    request_id: str
    from_stage: str
    to_stage: str
    age_seconds: float
    session_id: str
    def __init__(self, lease_id: _Optional[int] = ..., state: _Optional[_Union[LeaseState, str]] = ..., pool: _Optional[str] = ..., bytes: _Optional[int] = ..., request_id: _Optional[str] = ..., from_stage: _Optional[str] = ..., to_stage: _Optional[str] = ..., age_seconds: _Optional[float] = ..., session_id: _Optional[str] = ...) -> None: ...

class SessionStatus(_message.Message):
    __slots__ = ("session_id", "pid", "stages", "granted_bytes", "leases", "age_seconds", "uid", "data_path")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pid: int
    stages: _containers.RepeatedScalarFieldContainer[str]
    granted_bytes: int
    leases: int
    age_seconds: float
    uid: int
    data_path: str
    def __init__(self, session_id: _Optional[str] = ..., pid: _Optional[int] = ..., stages: _Optional[_Iterable[str]] = ..., granted_bytes: _Optional[int] = ..., leases: _Optional[int] = ..., age_seconds: _Optional[float] = ..., uid: _Optional[int] = ..., data_path: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("node_id", "daemon_epoch", "state", "uptime_seconds", "pools", "leases", "sessions", "leases_by_state", "transfers_by_transport", "reclaimed_by_reason", "version", "peers", "registry_version", "stages", "edges", "edge_traffic", "latency_bucket_bounds")
    class LeasesByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TransfersByTransportEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ReclaimedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASES_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_BY_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
    EDGE_TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    LATENCY_BUCKET_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    daemon_epoch: str
    state: DaemonState
    uptime_seconds: float
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseStatus]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStatus]
    leases_by_state: _containers.ScalarMap[str, int]
    transfers_by_transport: _containers.ScalarMap[str, int]
    reclaimed_by_reason: _containers.ScalarMap[str, int]
    version: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    registry_version: int
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    edges: _containers.RepeatedCompositeFieldContainer[EdgeStatus]
    edge_traffic: _containers.RepeatedCompositeFieldContainer[EdgeTraffic]
    latency_bucket_bounds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, node_id: _Optional[str] = ..., daemon_epoch: _Optional[str] = ..., state: _Optional[_Union[DaemonState, str]] = ..., uptime_seconds: _Optional[float] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[LeaseStatus, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionStatus, _Mapping]]] = ..., leases_by_state: _Optional[_Mapping[str, int]] = ..., transfers_by_transport: _Optional[_Mapping[str, int]] = ..., reclaimed_by_reason: _Optional[_Mapping[str, int]] = ..., version: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., registry_version: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., edges: _Optional[_Iterable[_Union[EdgeStatus, _Mapping]]] = ..., edge_traffic: _Optional[_Iterable[_Union[EdgeTraffic, _Mapping]]] = ..., latency_bucket_bounds: _Optional[_Iterable[float]] = ...) -> None: ...

class EdgeTraffic(_message.Message):
    __slots__ = ("from_stage", "to_stage", "transport", "transfers", "bytes", "put_buckets", "get_buckets", "put_p50_seconds", "put_p99_seconds", "get_p50_seconds", "get_p99_seconds", "put_sum_seconds", "get_sum_seconds")
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PUT_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GET_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PUT_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUT_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GET_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GET_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUT_SUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GET_SUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    from_stage: str
    to_stage: str
    transport: Transport
    transfers: int
    bytes: int
    put_buckets: _containers.RepeatedScalarFieldContainer[int]
    get_buckets: _containers.RepeatedScalarFieldContainer[int]
    put_p50_seconds: float
    put_p99_seconds: float
    get_p50_seconds: float
    get_p99_seconds: float
    put_sum_seconds: float
    get_sum_seconds: float
    def __init__(self, from_stage: _Optional[str] = ..., to_stage: _Optional[str] = ..., transport: _Optional[_Union[Transport, str]] = ..., transfers: _Optional[int] = ..., bytes: _Optional[int] = ..., put_buckets: _Optional[_Iterable[int]] = ..., get_buckets: _Optional[_Iterable[int]] = ..., put_p50_seconds: _Optional[float] = ..., put_p99_seconds: _Optional[float] = ..., get_p50_seconds: _Optional[float] = ..., get_p99_seconds: _Optional[float] = ..., put_sum_seconds: _Optional[float] = ..., get_sum_seconds: _Optional[float] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("stage", "session_id", "node_id", "process_key", "can_map_shm", "gpu_uuids", "pid")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_KEY_FIELD_NUMBER: _ClassVar[int]
    CAN_MAP_SHM_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    stage: str
    session_id: str
    node_id: str
    process_key: str
    can_map_shm: bool
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    def __init__(self, stage: _Optional[str] = ..., session_id: _Optional[str] = ..., node_id: _Optional[str] = ..., process_key: _Optional[str] = ..., can_map_shm: _Optional[bool] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ...) -> None: ...

class EdgeStatus(_message.Message):
    __slots__ = ("from_stage", "to_stage", "transport", "reason", "count")
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    from_stage: str
    to_stage: str
    transport: Transport
    reason: str
    count: int
    def __init__(self, from_stage: _Optional[str] = ..., to_stage: _Optional[str] = ..., transport: _Optional[_Union[Transport, str]] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("session_id", "session_token", "from_stage", "to_stage", "encoded_bytes", "inline_meta_bytes", "cuda_uuids", "has_cpu_tensors", "is_chunk", "chunk_meta_has_tensor", "allow_cuda_ipc_direct")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_META_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_UUIDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CPU_TENSORS_FIELD_NUMBER: _ClassVar[int]
    IS_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_META_HAS_TENSOR_FIELD_NUMBER: _ClassVar[int]
    ALLOW_CUDA_IPC_DIRECT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: bytes
    from_stage: str
    to_stage: str
    encoded_bytes: int
    inline_meta_bytes: int
    cuda_uuids: _containers.RepeatedScalarFieldContainer[str]
    has_cpu_tensors: bool
    is_chunk: bool
    chunk_meta_has_tensor: bool
    allow_cuda_ipc_direct: bool
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ..., from_stage: _Optional[str] = ..., to_stage: _Optional[str] = ..., encoded_bytes: _Optional[int] = ..., inline_meta_bytes: _Optional[int] = ..., cuda_uuids: _Optional[_Iterable[str]] = ..., has_cpu_tensors: _Optional[bool] = ..., is_chunk: _Optional[bool] = ..., chunk_meta_has_tensor: _Optional[bool] = ..., allow_cuda_ipc_direct: _Optional[bool] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("transport", "reason", "registry_version")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_VERSION_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    reason: str
    registry_version: int
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., reason: _Optional[str] = ..., registry_version: _Optional[int] = ...) -> None: ...

class PutBytesRequest(_message.Message):
    __slots__ = ("session_id", "session_token", "request_id", "to_stage", "from_stage", "data", "timeout_seconds", "ref", "trace_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: bytes
    request_id: str
    to_stage: str
    from_stage: str
    data: bytes
    timeout_seconds: float
    ref: bool
    trace_id: str
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ..., request_id: _Optional[str] = ..., to_stage: _Optional[str] = ..., from_stage: _Optional[str] = ..., data: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ..., ref: _Optional[bool] = ..., trace_id: _Optional[str] = ...) -> None: ...

class PutBytesResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: LeaseRef
    def __init__(self, lease: _Optional[_Union[LeaseRef, _Mapping]] = ...) -> None: ...

class GetBytesRequest(_message.Message):
    __slots__ = ("session_id", "session_token", "lease", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: bytes
    lease: LeaseRef
    request_id: str
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ..., lease: _Optional[_Union[LeaseRef, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetBytesResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("address", "node_id", "up", "daemon_epoch", "mooncake_session", "credits_in_use", "credits_capacity", "pulls_in_flight_max", "last_error", "stages", "pushes_out", "pushes_declined", "pushes_in", "push_grant_bytes", "reads_landed", "reads_awaited", "reads_pulled", "pull_phases", "notice_channel", "notice_batches", "pushes_attached", "reads_attached", "pushes_unreceived", "pushes_announced", "reads_announced")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_SESSION_FIELD_NUMBER: _ClassVar[int]
    CREDITS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    CREDITS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PULLS_IN_FLIGHT_MAX_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    PUSHES_OUT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DECLINED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_IN_FIELD_NUMBER: _ClassVar[int]
    PUSH_GRANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    READS_LANDED_FIELD_NUMBER: _ClassVar[int]
    READS_AWAITED_FIELD_NUMBER: _ClassVar[int]
    READS_PULLED_FIELD_NUMBER: _ClassVar[int]
    PULL_PHASES_FIELD_NUMBER: _ClassVar[int]
    NOTICE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    NOTICE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PUSHES_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    READS_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_UNRECEIVED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_ANNOUNCED_FIELD_NUMBER: _ClassVar[int]
    READS_ANNOUNCED_FIELD_NUMBER: _ClassVar[int]
    address: str
    node_id: str
    up: bool
    daemon_epoch: str
    mooncake_session: str
    credits_in_use: int
    credits_capacity: int
    pulls_in_flight_max: int
    last_error: str
    stages: _containers.RepeatedScalarFieldContainer[str]
    pushes_out: int
    pushes_declined: int
    pushes_in: int
    push_grant_bytes: int
    reads_landed: int
    reads_awaited: int
    reads_pulled: int
    pull_phases: int
    notice_channel: bool
    notice_batches: int
    pushes_attached: int
    reads_attached: int
    pushes_unreceived: int
    pushes_announced: int
    reads_announced: int
    def __init__(self, address: _Optional[str] = ..., node_id: _Optional[str] = ..., up: _Optional[bool] = ..., daemon_epoch: _Optional[str] = ..., mooncake_session: _Optional[str] = ..., credits_in_use: _Optional[int] = ..., credits_capacity: _Optional[int] = ..., pulls_in_flight_max: _Optional[int] = ..., last_error: _Optional[str] = ..., stages: _Optional[_Iterable[str]] = ..., pushes_out: _Optional[int] = ..., pushes_declined: _Optional[int] = ..., pushes_in: _Optional[int] = ..., push_grant_bytes: _Optional[int] = ..., reads_landed: _Optional[int] = ..., reads_awaited: _Optional[int] = ..., reads_pulled: _Optional[int] = ..., pull_phases: _Optional[int] = ..., notice_channel: _Optional[bool] = ..., notice_batches: _Optional[int] = ..., pushes_attached: _Optional[int] = ..., reads_attached: _Optional[int] = ..., pushes_unreceived: _Optional[int] = ..., pushes_announced: _Optional[int] = ..., reads_announced: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("session_id", "session_token", "data_ref", "timeout_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_REF_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: bytes
    data_ref: bytes
    timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ..., data_ref: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("lease", "node_id", "daemon_epoch")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease: LeaseRef
    node_id: str
    daemon_epoch: str
    def __init__(self, lease: _Optional[_Union[LeaseRef, _Mapping]] = ..., node_id: _Optional[str] = ..., daemon_epoch: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_seconds", "session_id", "session_token")
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    session_id: str
    session_token: bytes
    def __init__(self, grace_seconds: _Optional[float] = ..., session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("accepted", "grace_seconds")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    grace_seconds: float
    def __init__(self, accepted: _Optional[bool] = ..., grace_seconds: _Optional[float] = ...) -> None: ...

class Bind(_message.Message):
    __slots__ = ("session_id", "session_token", "shm_nonce", "operator", "freed_ring", "release_ring", "announcements")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_FIELD_NUMBER: _ClassVar[int]
    FREED_RING_FIELD_NUMBER: _ClassVar[int]
    RELEASE_RING_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCEMENTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_token: bytes
    shm_nonce: bytes
    operator: bool
    freed_ring: bool
    release_ring: bool
    announcements: bool
    def __init__(self, session_id: _Optional[str] = ..., session_token: _Optional[bytes] = ..., shm_nonce: _Optional[bytes] = ..., operator: _Optional[bool] = ..., freed_ring: _Optional[bool] = ..., release_ring: _Optional[bool] = ..., announcements: _Optional[bool] = ...) -> None: ...

class Reserve(_message.Message):
    __slots__ = ("lease_id", "grant_id", "slot", "nslots", "generation", "request_id", "to_stage", "from_stage", "trace_id", "publish")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    grant_id: int
    slot: int
    nslots: int
    generation: int
    request_id: str
    to_stage: str
    from_stage: str
    trace_id: str
    publish: Publish
    def __init__(self, lease_id: _Optional[int] = ..., grant_id: _Optional[int] = ..., slot: _Optional[int] = ..., nslots: _Optional[int] = ..., generation: _Optional[int] = ..., request_id: _Optional[str] = ..., to_stage: _Optional[str] = ..., from_stage: _Optional[str] = ..., trace_id: _Optional[str] = ..., publish: _Optional[_Union[Publish, _Mapping]] = ...) -> None: ...

class Publish(_message.Message):
    __slots__ = ("lease_id", "nbytes", "transport", "ref", "push")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    nbytes: int
    transport: Transport
    ref: bool
    push: bool
    def __init__(self, lease_id: _Optional[int] = ..., nbytes: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ..., ref: _Optional[bool] = ..., push: _Optional[bool] = ...) -> None: ...

class Claim(_message.Message):
    __slots__ = ("lease_id", "generation")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    generation: int
    def __init__(self, lease_id: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("lease_id", "generation")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    generation: int
    def __init__(self, lease_id: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReturnGrant(_message.Message):
    __slots__ = ("grant_id",)
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    def __init__(self, grant_id: _Optional[int] = ...) -> None: ...

class TransferReport(_message.Message):
    __slots__ = ("transport", "count", "bytes", "from_stage", "to_stage")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    count: int
    bytes: int
    from_stage: str
    to_stage: str
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., count: _Optional[int] = ..., bytes: _Optional[int] = ..., from_stage: _Optional[str] = ..., to_stage: _Optional[str] = ...) -> None: ...

class EdgeLatencyReport(_message.Message):
    __slots__ = ("from_stage", "to_stage", "transport", "put_buckets", "get_buckets", "put_sum_ns", "get_sum_ns")
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PUT_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GET_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PUT_SUM_NS_FIELD_NUMBER: _ClassVar[int]
    GET_SUM_NS_FIELD_NUMBER: _ClassVar[int]
    from_stage: str
    to_stage: str
    transport: Transport
    put_buckets: _containers.RepeatedScalarFieldContainer[int]
    get_buckets: _containers.RepeatedScalarFieldContainer[int]
    put_sum_ns: int
    get_sum_ns: int
    def __init__(self, from_stage: _Optional[str] = ..., to_stage: _Optional[str] = ..., transport: _Optional[_Union[Transport, str]] = ..., put_buckets: _Optional[_Iterable[int]] = ..., get_buckets: _Optional[_Iterable[int]] = ..., put_sum_ns: _Optional[int] = ..., get_sum_ns: _Optional[int] = ...) -> None: ...

class Freed(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Aborted(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("kind", "code", "message", "registry_version", "answers_probes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_PROBES_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    code: ErrorCode
    message: str
    registry_version: int
    answers_probes: bool
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., registry_version: _Optional[int] = ..., answers_probes: _Optional[bool] = ...) -> None: ...

class FetchCall(_message.Message):
    __slots__ = ("call_id", "data_ref", "timeout_seconds")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_REF_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    data_ref: bytes
    timeout_seconds: float
    def __init__(self, call_id: _Optional[int] = ..., data_ref: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class FetchResult(_message.Message):
    __slots__ = ("call_id", "response", "code", "message")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: FetchResponse
    code: ErrorCode
    message: str
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[FetchResponse, _Mapping]] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class LandedPush(_message.Message):
    __slots__ = ("origin_node_id", "origin_daemon_epoch", "lease_id", "generation", "lease", "request_id", "to_stage")
    ORIGIN_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    origin_node_id: str
    origin_daemon_epoch: str
    lease_id: int
    generation: int
    lease: LeaseRef
    request_id: str
    to_stage: str
    def __init__(self, origin_node_id: _Optional[str] = ..., origin_daemon_epoch: _Optional[str] = ..., lease_id: _Optional[int] = ..., generation: _Optional[int] = ..., lease: _Optional[_Union[LeaseRef, _Mapping]] = ..., request_id: _Optional[str] = ..., to_stage: _Optional[str] = ...) -> None: ...

class KeyedPut(_message.Message):
    __slots__ = ("call_id", "key", "data_ref", "timeout_seconds")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_REF_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    key: str
    data_ref: bytes
    timeout_seconds: float
    def __init__(self, call_id: _Optional[int] = ..., key: _Optional[str] = ..., data_ref: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class KeyedTake(_message.Message):
    __slots__ = ("call_id", "key", "from_stage", "to_stage", "timeout_seconds")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    key: str
    from_stage: str
    to_stage: str
    timeout_seconds: float
    def __init__(self, call_id: _Optional[int] = ..., key: _Optional[str] = ..., from_stage: _Optional[str] = ..., to_stage: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class DiscardCall(_message.Message):
    __slots__ = ("call_id", "data_ref", "key")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_REF_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    data_ref: bytes
    key: str
    def __init__(self, call_id: _Optional[int] = ..., data_ref: _Optional[bytes] = ..., key: _Optional[str] = ...) -> None: ...

class KeyedResult(_message.Message):
    __slots__ = ("call_id", "code", "message", "data_ref")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DATA_REF_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    code: ErrorCode
    message: str
    data_ref: bytes
    def __init__(self, call_id: _Optional[int] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., data_ref: _Optional[bytes] = ...) -> None: ...

class SessionFrame(_message.Message):
    __slots__ = ("bind", "reserve", "publish", "claim", "release", "cancel", "return_grant", "report", "fetch", "latency", "freed", "aborted", "event", "fetched", "landed", "declined", "keyed_put", "keyed_take", "discard", "keyed_result", "probe", "probe_answer")
    BIND_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RETURN_GRANT_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    KEYED_PUT_FIELD_NUMBER: _ClassVar[int]
    KEYED_TAKE_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    KEYED_RESULT_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    PROBE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    bind: Bind
    reserve: _containers.RepeatedCompositeFieldContainer[Reserve]
    publish: _containers.RepeatedCompositeFieldContainer[Publish]
    claim: _containers.RepeatedCompositeFieldContainer[Claim]
    release: _containers.RepeatedCompositeFieldContainer[Release]
    cancel: _containers.RepeatedCompositeFieldContainer[Cancel]
    return_grant: _containers.RepeatedCompositeFieldContainer[ReturnGrant]
    report: _containers.RepeatedCompositeFieldContainer[TransferReport]
    fetch: _containers.RepeatedCompositeFieldContainer[FetchCall]
    latency: _containers.RepeatedCompositeFieldContainer[EdgeLatencyReport]
    freed: Freed
    aborted: _containers.RepeatedCompositeFieldContainer[Aborted]
    event: _containers.RepeatedCompositeFieldContainer[Event]
    fetched: _containers.RepeatedCompositeFieldContainer[FetchResult]
    landed: _containers.RepeatedCompositeFieldContainer[LandedPush]
    declined: _containers.RepeatedCompositeFieldContainer[LandedPush]
    keyed_put: _containers.RepeatedCompositeFieldContainer[KeyedPut]
    keyed_take: _containers.RepeatedCompositeFieldContainer[KeyedTake]
    discard: _containers.RepeatedCompositeFieldContainer[DiscardCall]
    keyed_result: _containers.RepeatedCompositeFieldContainer[KeyedResult]
    probe: bool
    probe_answer: bool
    def __init__(self, bind: _Optional[_Union[Bind, _Mapping]] = ..., reserve: _Optional[_Iterable[_Union[Reserve, _Mapping]]] = ..., publish: _Optional[_Iterable[_Union[Publish, _Mapping]]] = ..., claim: _Optional[_Iterable[_Union[Claim, _Mapping]]] = ..., release: _Optional[_Iterable[_Union[Release, _Mapping]]] = ..., cancel: _Optional[_Iterable[_Union[Cancel, _Mapping]]] = ..., return_grant: _Optional[_Iterable[_Union[ReturnGrant, _Mapping]]] = ..., report: _Optional[_Iterable[_Union[TransferReport, _Mapping]]] = ..., fetch: _Optional[_Iterable[_Union[FetchCall, _Mapping]]] = ..., latency: _Optional[_Iterable[_Union[EdgeLatencyReport, _Mapping]]] = ..., freed: _Optional[_Union[Freed, _Mapping]] = ..., aborted: _Optional[_Iterable[_Union[Aborted, _Mapping]]] = ..., event: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., fetched: _Optional[_Iterable[_Union[FetchResult, _Mapping]]] = ..., landed: _Optional[_Iterable[_Union[LandedPush, _Mapping]]] = ..., declined: _Optional[_Iterable[_Union[LandedPush, _Mapping]]] = ..., keyed_put: _Optional[_Iterable[_Union[KeyedPut, _Mapping]]] = ..., keyed_take: _Optional[_Iterable[_Union[KeyedTake, _Mapping]]] = ..., discard: _Optional[_Iterable[_Union[DiscardCall, _Mapping]]] = ..., keyed_result: _Optional[_Iterable[_Union[KeyedResult, _Mapping]]] = ..., probe: _Optional[bool] = ..., probe_answer: _Optional[bool] = ...) -> None: ...

class ArenaSegment(_message.Message):
    __slots__ = ("index", "base", "size", "data_offset", "nslots")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    base: int
    size: int
    data_offset: int
    nslots: int
    def __init__(self, index: _Optional[int] = ..., base: _Optional[int] = ..., size: _Optional[int] = ..., data_offset: _Optional[int] = ..., nslots: _Optional[int] = ...) -> None: ...

class PeerHello(_message.Message):
    __slots__ = ("protocol_version", "node_id", "daemon_epoch", "peer_address", "mooncake_session", "slot_size", "segments", "stages", "notice_port")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_SESSION_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    NOTICE_PORT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    node_id: str
    daemon_epoch: str
    peer_address: str
    mooncake_session: str
    slot_size: int
    segments: _containers.RepeatedCompositeFieldContainer[ArenaSegment]
    stages: _containers.RepeatedScalarFieldContainer[str]
    notice_port: int
    def __init__(self, protocol_version: _Optional[int] = ..., node_id: _Optional[str] = ..., daemon_epoch: _Optional[str] = ..., peer_address: _Optional[str] = ..., mooncake_session: _Optional[str] = ..., slot_size: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[ArenaSegment, _Mapping]]] = ..., stages: _Optional[_Iterable[str]] = ..., notice_port: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "daemon_epoch", "stages")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    daemon_epoch: str
    stages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., daemon_epoch: _Optional[str] = ..., stages: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("node_id", "daemon_epoch", "stages")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    daemon_epoch: str
    stages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., daemon_epoch: _Optional[str] = ..., stages: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRemoteRequest(_message.Message):
    __slots__ = ("lease_id", "generation", "node_id", "discard", "stages")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    generation: int
    node_id: str
    discard: bool
    stages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_id: _Optional[int] = ..., generation: _Optional[int] = ..., node_id: _Optional[str] = ..., discard: _Optional[bool] = ..., stages: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRemoteResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class AbortRemoteRequest(_message.Message):
    __slots__ = ("request_id", "node_id", "stages", "narrow", "aborter_uid", "aborter_stages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    NARROW_FIELD_NUMBER: _ClassVar[int]
    ABORTER_UID_FIELD_NUMBER: _ClassVar[int]
    ABORTER_STAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    node_id: str
    stages: _containers.RepeatedScalarFieldContainer[str]
    narrow: bool
    aborter_uid: int
    aborter_stages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., node_id: _Optional[str] = ..., stages: _Optional[_Iterable[str]] = ..., narrow: _Optional[bool] = ..., aborter_uid: _Optional[int] = ..., aborter_stages: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortRemoteResponse(_message.Message):
    __slots__ = ("leases_freed",)
    LEASES_FREED_FIELD_NUMBER: _ClassVar[int]
    leases_freed: int
    def __init__(self, leases_freed: _Optional[int] = ...) -> None: ...

class PeerKeyedPutRequest(_message.Message):
    __slots__ = ("node_id", "key", "data_ref")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_REF_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    key: str
    data_ref: bytes
    def __init__(self, node_id: _Optional[str] = ..., key: _Optional[str] = ..., data_ref: _Optional[bytes] = ...) -> None: ...

class PeerKeyedPutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerKeyedWithdrawRequest(_message.Message):
    __slots__ = ("node_id", "key", "data_ref")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_REF_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    key: str
    data_ref: bytes
    def __init__(self, node_id: _Optional[str] = ..., key: _Optional[str] = ..., data_ref: _Optional[bytes] = ...) -> None: ...

class PeerKeyedWithdrawResponse(_message.Message):
    __slots__ = ("withdrawn",)
    WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    withdrawn: bool
    def __init__(self, withdrawn: _Optional[bool] = ...) -> None: ...

class PushGrantRequest(_message.Message):
    __slots__ = ("node_id", "daemon_epoch", "nbytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    daemon_epoch: str
    nbytes: int
    def __init__(self, node_id: _Optional[str] = ..., daemon_epoch: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PushGrantResponse(_message.Message):
    __slots__ = ("grant_id", "segment", "slot", "nslots", "daemon_epoch")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    segment: int
    slot: int
    nslots: int
    daemon_epoch: str
    def __init__(self, grant_id: _Optional[int] = ..., segment: _Optional[int] = ..., slot: _Optional[int] = ..., nslots: _Optional[int] = ..., daemon_epoch: _Optional[str] = ...) -> None: ...

class PushLanded(_message.Message):
    __slots__ = ("lease_id", "generation", "grant_id", "slot", "nslots", "length", "request_id", "from_stage", "to_stage", "attached")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    generation: int
    grant_id: int
    slot: int
    nslots: int
    length: int
    request_id: str
    from_stage: str
    to_stage: str
    attached: int
    def __init__(self, lease_id: _Optional[int] = ..., generation: _Optional[int] = ..., grant_id: _Optional[int] = ..., slot: _Optional[int] = ..., nslots: _Optional[int] = ..., length: _Optional[int] = ..., request_id: _Optional[str] = ..., from_stage: _Optional[str] = ..., to_stage: _Optional[str] = ..., attached: _Optional[int] = ...) -> None: ...

class PushDeclined(_message.Message):
    __slots__ = ("lease_id", "generation", "to_stage")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    generation: int
    to_stage: str
    def __init__(self, lease_id: _Optional[int] = ..., generation: _Optional[int] = ..., to_stage: _Optional[str] = ...) -> None: ...

class PushFreed(_message.Message):
    __slots__ = ("grant_id", "slot", "nslots")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    slot: int
    nslots: int
    def __init__(self, grant_id: _Optional[int] = ..., slot: _Optional[int] = ..., nslots: _Optional[int] = ...) -> None: ...

class LeaseKey(_message.Message):
    __slots__ = ("lease_id", "generation", "reader_stages")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    READER_STAGES_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    generation: int
    reader_stages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_id: _Optional[int] = ..., generation: _Optional[int] = ..., reader_stages: _Optional[_Iterable[str]] = ...) -> None: ...

class PeerNotices(_message.Message):
    __slots__ = ("node_id", "daemon_epoch", "landed", "declined", "freed", "released", "received", "unreceived")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    UNRECEIVED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    daemon_epoch: str
    landed: _containers.RepeatedCompositeFieldContainer[PushLanded]
    declined: _containers.RepeatedCompositeFieldContainer[PushDeclined]
    freed: _containers.RepeatedCompositeFieldContainer[PushFreed]
    released: _containers.RepeatedCompositeFieldContainer[LeaseKey]
    received: _containers.RepeatedCompositeFieldContainer[LeaseKey]
    unreceived: _containers.RepeatedCompositeFieldContainer[LeaseKey]
    def __init__(self, node_id: _Optional[str] = ..., daemon_epoch: _Optional[str] = ..., landed: _Optional[_Iterable[_Union[PushLanded, _Mapping]]] = ..., declined: _Optional[_Iterable[_Union[PushDeclined, _Mapping]]] = ..., freed: _Optional[_Iterable[_Union[PushFreed, _Mapping]]] = ..., released: _Optional[_Iterable[_Union[LeaseKey, _Mapping]]] = ..., received: _Optional[_Iterable[_Union[LeaseKey, _Mapping]]] = ..., unreceived: _Optional[_Iterable[_Union[LeaseKey, _Mapping]]] = ...) -> None: ...

class PeerNoticesAck(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
