from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRankRequest(_message.Message):
    __slots__ = ("dp_rank", "tp_rank", "dp_size", "tp_size", "control_addr", "instance_id", "epoch", "issued_at_ms", "proof")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDR_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    tp_rank: int
    dp_size: int
    tp_size: int
    control_addr: str
    instance_id: str
    epoch: int
    issued_at_ms: int
    proof: bytes
    def __init__(self, dp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., control_addr: _Optional[str] = ..., instance_id: _Optional[str] = ..., epoch: _Optional[int] = ..., issued_at_ms: _Optional[int] = ..., proof: _Optional[bytes] = ...) -> None: ...

class RegisterRankResponse(_message.Message):
    __slots__ = ("registered", "expected")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    registered: int
    expected: int
    def __init__(self, registered: _Optional[int] = ..., expected: _Optional[int] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ("nonce", "address")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    address: str
    def __init__(self, nonce: _Optional[bytes] = ..., address: _Optional[str] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("dp_size", "tp_size", "membership_proof")
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_PROOF_FIELD_NUMBER: _ClassVar[int]
    dp_size: int
    tp_size: int
    membership_proof: bytes
    def __init__(self, dp_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., membership_proof: _Optional[bytes] = ...) -> None: ...

class GetRankRequest(_message.Message):
    __slots__ = ("dp_rank", "tp_rank")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    tp_rank: int
    def __init__(self, dp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("control_addr", "instance_id", "epoch")
    CONTROL_ADDR_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    control_addr: str
    instance_id: str
    epoch: int
    def __init__(self, control_addr: _Optional[str] = ..., instance_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...
