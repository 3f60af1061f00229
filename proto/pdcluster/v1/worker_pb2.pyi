from pdcluster.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MuxFrame(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[MuxMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[MuxMessage, _Mapping]]] = ...) -> None: ...

class MuxMessage(_message.Message):
    __slots__ = ("stream_id", "generate", "prefill", "decode", "cancel", "response", "prefill_done", "status", "fragment", "watch_load", "load", "hello", "ping", "timeout_s")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    WATCH_LOAD_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    generate: GenerateRequest
    prefill: PrefillRequest
    decode: DecodeRequest
    cancel: MuxCancel
    response: GenerateResponse
    prefill_done: PrefillResponse
    status: MuxStatus
    fragment: MuxFragment
    watch_load: MuxWatchLoad
    load: GetLoadResponse
    hello: MuxHello
    ping: MuxPing
    timeout_s: float
    def __init__(self, stream_id: _Optional[int] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[_Union[MuxCancel, _Mapping]] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., prefill_done: _Optional[_Union[PrefillResponse, _Mapping]] = ..., status: _Optional[_Union[MuxStatus, _Mapping]] = ..., fragment: _Optional[_Union[MuxFragment, _Mapping]] = ..., watch_load: _Optional[_Union[MuxWatchLoad, _Mapping]] = ..., load: _Optional[_Union[GetLoadResponse, _Mapping]] = ..., hello: _Optional[_Union[MuxHello, _Mapping]] = ..., ping: _Optional[_Union[MuxPing, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class MuxHello(_message.Message):
    __slots__ = ("credential",)
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    credential: str
    def __init__(self, credential: _Optional[str] = ...) -> None: ...

class MuxPing(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class MuxWatchLoad(_message.Message):
    __slots__ = ("interval_s", "heartbeat_s")
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    heartbeat_s: float
    def __init__(self, interval_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ...) -> None: ...

class MuxCancel(_message.Message):
    __slots__ = ("code",)
    CODE_FIELD_NUMBER: _ClassVar[int]
    code: int
    def __init__(self, code: _Optional[int] = ...) -> None: ...

class MuxStatus(_message.Message):
    __slots__ = ("code", "message", "trailing_metadata")
    class TrailingMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    trailing_metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., trailing_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class MuxFragment(_message.Message):
    __slots__ = ("data", "more")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    more: bool
    def __init__(self, data: _Optional[bytes] = ..., more: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("rid", "input_ids", "sampling_params", "return_logprob", "top_logprobs_num", "dp_rank", "prior_output_len", "priority")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    return_logprob: bool
    top_logprobs_num: int
    dp_rank: int
    prior_output_len: int
    priority: int
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., dp_rank: _Optional[int] = ..., prior_output_len: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "bootstrap_room", "prefill_dp_rank")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    bootstrap_room: int
    prefill_dp_rank: int
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., bootstrap_room: _Optional[int] = ..., prefill_dp_rank: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("rid", "prompt_tokens", "cached_tokens", "timing")
    RID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    rid: str
    prompt_tokens: int
    cached_tokens: int
    timing: _common_pb2.Timing
    def __init__(self, rid: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "bootstrap_room", "bootstrap_addr", "prefill_dp_rank", "decode_dp_rank")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ADDR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    bootstrap_room: int
    bootstrap_addr: str
    prefill_dp_rank: int
    decode_dp_rank: int
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., bootstrap_room: _Optional[int] = ..., bootstrap_addr: _Optional[str] = ..., prefill_dp_rank: _Optional[int] = ..., decode_dp_rank: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "finished")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    finished: Finished
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("last", "finish_reason", "matched_token", "matched_stop", "usage", "timing", "spec")
    LAST_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    last: TokenChunk
    finish_reason: str
    matched_token: int
    matched_stop: str
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    spec: _common_pb2.SpecDecoding
    def __init__(self, last: _Optional[_Union[TokenChunk, _Mapping]] = ..., finish_reason: _Optional[str] = ..., matched_token: _Optional[int] = ..., matched_stop: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., spec: _Optional[_Union[_common_pb2.SpecDecoding, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rid",)
    RID_FIELD_NUMBER: _ClassVar[int]
    rid: str
    def __init__(self, rid: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankLoad(_message.Message):
    __slots__ = ("dp_rank", "running", "waiting", "bootstrap", "inflight", "prealloc", "transfer", "free_kv_pages", "total_kv_pages", "free_req_slots", "total_req_slots", "token_usage", "evictable_tokens", "admissible_tokens", "preempt_priority", "host_cache_tokens", "cache_storage")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    PREALLOC_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_REQ_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REQ_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIBLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_STORAGE_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    running: int
    waiting: int
    bootstrap: int
    inflight: int
    prealloc: int
    transfer: int
    free_kv_pages: int
    total_kv_pages: int
    free_req_slots: int
    total_req_slots: int
    token_usage: float
    evictable_tokens: int
    admissible_tokens: int
    preempt_priority: int
    host_cache_tokens: int
    cache_storage: str
    def __init__(self, dp_rank: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., bootstrap: _Optional[int] = ..., inflight: _Optional[int] = ..., prealloc: _Optional[int] = ..., transfer: _Optional[int] = ..., free_kv_pages: _Optional[int] = ..., total_kv_pages: _Optional[int] = ..., free_req_slots: _Optional[int] = ..., total_req_slots: _Optional[int] = ..., token_usage: _Optional[float] = ..., evictable_tokens: _Optional[int] = ..., admissible_tokens: _Optional[int] = ..., preempt_priority: _Optional[int] = ..., host_cache_tokens: _Optional[int] = ..., cache_storage: _Optional[str] = ...) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("ranks", "page_size")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankLoad]
    page_size: int
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankLoad, _Mapping]]] = ..., page_size: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("mode", "model_path", "served_model_name", "model_fingerprint", "page_size", "tp_size", "dp_size", "bootstrap_port", "context_len", "vocab_size", "kv_transfer_backend", "max_total_tokens", "max_requests_per_rank", "schedule_low_priority_values_first")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_LOW_PRIORITY_VALUES_FIRST_FIELD_NUMBER: _ClassVar[int]
    mode: str
    model_path: str
    served_model_name: str
    model_fingerprint: str
    page_size: int
    tp_size: int
    dp_size: int
    bootstrap_port: int
    context_len: int
    vocab_size: int
    kv_transfer_backend: str
    max_total_tokens: int
    max_requests_per_rank: int
    schedule_low_priority_values_first: bool
    def __init__(self, mode: _Optional[str] = ..., model_path: _Optional[str] = ..., served_model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., page_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., dp_size: _Optional[int] = ..., bootstrap_port: _Optional[int] = ..., context_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_transfer_backend: _Optional[str] = ..., max_total_tokens: _Optional[int] = ..., max_requests_per_rank: _Optional[int] = ..., schedule_low_priority_values_first: _Optional[bool] = ...) -> None: ...

class ProveMembershipRequest(_message.Message):
    __slots__ = ("nonce", "address")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    address: str
    def __init__(self, nonce: _Optional[bytes] = ..., address: _Optional[str] = ...) -> None: ...

class ProveMembershipResponse(_message.Message):
    __slots__ = ("proof",)
    PROOF_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    def __init__(self, proof: _Optional[bytes] = ...) -> None: ...
