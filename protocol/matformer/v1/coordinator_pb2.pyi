from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoundState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_STATE_UNSPECIFIED: _ClassVar[RoundState]
    ROUND_STATE_WAIT: _ClassVar[RoundState]
    ROUND_STATE_TRAIN: _ClassVar[RoundState]
    ROUND_STATE_FINISHED: _ClassVar[RoundState]
ROUND_STATE_UNSPECIFIED: RoundState
ROUND_STATE_WAIT: RoundState
ROUND_STATE_TRAIN: RoundState
ROUND_STATE_FINISHED: RoundState

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class SparseResult(_message.Message):
    __slots__ = ("name", "shape", "region", "encoding", "chunk", "chunks", "indices", "values", "tokens", "scales")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    region: _containers.RepeatedCompositeFieldContainer[Range]
    encoding: str
    chunk: _containers.RepeatedScalarFieldContainer[int]
    chunks: Tensor
    indices: Tensor
    values: Tensor
    tokens: int
    scales: Tensor
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., region: _Optional[_Iterable[_Union[Range, _Mapping]]] = ..., encoding: _Optional[str] = ..., chunk: _Optional[_Iterable[int]] = ..., chunks: _Optional[_Union[Tensor, _Mapping]] = ..., indices: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., tokens: _Optional[int] = ..., scales: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("device_kind", "device_name", "memory_bytes", "requested_tier", "tokens_per_second", "load_strategy", "microbatch_tokens")
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TIER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOAD_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    device_kind: str
    device_name: str
    memory_bytes: int
    requested_tier: int
    tokens_per_second: float
    load_strategy: str
    microbatch_tokens: int
    def __init__(self, device_kind: _Optional[str] = ..., device_name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., requested_tier: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., load_strategy: _Optional[str] = ..., microbatch_tokens: _Optional[int] = ...) -> None: ...

class Schema(_message.Message):
    __slots__ = ("local_hash", "canonical_hash", "parameter_count", "tier", "sliced")
    LOCAL_HASH_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_HASH_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLICED_FIELD_NUMBER: _ClassVar[int]
    local_hash: str
    canonical_hash: str
    parameter_count: int
    tier: int
    sliced: bool
    def __init__(self, local_hash: _Optional[str] = ..., canonical_hash: _Optional[str] = ..., parameter_count: _Optional[int] = ..., tier: _Optional[int] = ..., sliced: _Optional[bool] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("run_id", "join_token", "capabilities", "schema", "client_name", "relay")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    join_token: str
    capabilities: Capabilities
    schema: Schema
    client_name: str
    relay: bool
    def __init__(self, run_id: _Optional[str] = ..., join_token: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., schema: _Optional[_Union[Schema, _Mapping]] = ..., client_name: _Optional[str] = ..., relay: _Optional[bool] = ...) -> None: ...

class TierEntry(_message.Message):
    __slots__ = ("tier", "intermediate_size", "files")
    TIER_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    intermediate_size: int
    files: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tier: _Optional[str] = ..., intermediate_size: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckpointRef(_message.Message):
    __slots__ = ("round", "manifest_path", "entry")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_PATH_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    round: int
    manifest_path: str
    entry: TierEntry
    def __init__(self, round: _Optional[int] = ..., manifest_path: _Optional[str] = ..., entry: _Optional[_Union[TierEntry, _Mapping]] = ...) -> None: ...

class TrainingSettings(_message.Message):
    __slots__ = ("encoding", "chunk", "topk", "value_dtype", "decay", "compression_lr", "sequence_length", "data_fingerprint", "data_strategy", "data_view", "heartbeat_seconds", "inner", "overlap", "peer_clip", "max_norm", "norm_action", "round_deadline_seconds", "layer_mixes")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    VALUE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DECAY_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_LR_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DATA_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DATA_VIEW_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INNER_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    PEER_CLIP_FIELD_NUMBER: _ClassVar[int]
    MAX_NORM_FIELD_NUMBER: _ClassVar[int]
    NORM_ACTION_FIELD_NUMBER: _ClassVar[int]
    ROUND_DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_MIXES_FIELD_NUMBER: _ClassVar[int]
    encoding: str
    chunk: int
    topk: int
    value_dtype: str
    decay: float
    compression_lr: float
    sequence_length: int
    data_fingerprint: str
    data_strategy: str
    data_view: str
    heartbeat_seconds: float
    inner: InnerOptimizer
    overlap: bool
    peer_clip: float
    max_norm: float
    norm_action: str
    round_deadline_seconds: float
    layer_mixes: _containers.RepeatedCompositeFieldContainer[LayerTiers]
    def __init__(self, encoding: _Optional[str] = ..., chunk: _Optional[int] = ..., topk: _Optional[int] = ..., value_dtype: _Optional[str] = ..., decay: _Optional[float] = ..., compression_lr: _Optional[float] = ..., sequence_length: _Optional[int] = ..., data_fingerprint: _Optional[str] = ..., data_strategy: _Optional[str] = ..., data_view: _Optional[str] = ..., heartbeat_seconds: _Optional[float] = ..., inner: _Optional[_Union[InnerOptimizer, _Mapping]] = ..., overlap: _Optional[bool] = ..., peer_clip: _Optional[float] = ..., max_norm: _Optional[float] = ..., norm_action: _Optional[str] = ..., round_deadline_seconds: _Optional[float] = ..., layer_mixes: _Optional[_Iterable[_Union[LayerTiers, _Mapping]]] = ...) -> None: ...

class LayerTiers(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tiers: _Optional[_Iterable[int]] = ...) -> None: ...

class InnerOptimizer(_message.Message):
    __slots__ = ("name", "lr", "weight_decay", "beta1", "beta2", "eps", "warmup_steps", "batch_tokens", "schedule", "final_lr", "planned_rounds", "grad_clip")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    FINAL_LR_FIELD_NUMBER: _ClassVar[int]
    PLANNED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    name: str
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    warmup_steps: int
    batch_tokens: int
    schedule: str
    final_lr: float
    planned_rounds: int
    grad_clip: float
    def __init__(self, name: _Optional[str] = ..., lr: _Optional[float] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., schedule: _Optional[str] = ..., final_lr: _Optional[float] = ..., planned_rounds: _Optional[int] = ..., grad_clip: _Optional[float] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("client_id", "session_token", "tier", "ffn_width", "tier_reason", "round", "checkpoint", "settings", "schema_hash", "rounds_planned", "tokens_planned", "heartbeat_port")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FFN_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TIER_REASON_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_HASH_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_PLANNED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PLANNED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_PORT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    session_token: str
    tier: int
    ffn_width: int
    tier_reason: str
    round: int
    checkpoint: CheckpointRef
    settings: TrainingSettings
    schema_hash: str
    rounds_planned: int
    tokens_planned: int
    heartbeat_port: int
    def __init__(self, client_id: _Optional[str] = ..., session_token: _Optional[str] = ..., tier: _Optional[int] = ..., ffn_width: _Optional[int] = ..., tier_reason: _Optional[str] = ..., round: _Optional[int] = ..., checkpoint: _Optional[_Union[CheckpointRef, _Mapping]] = ..., settings: _Optional[_Union[TrainingSettings, _Mapping]] = ..., schema_hash: _Optional[str] = ..., rounds_planned: _Optional[int] = ..., tokens_planned: _Optional[int] = ..., heartbeat_port: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("round", "tokens_per_second", "relayed")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    round: int
    tokens_per_second: float
    relayed: _containers.RepeatedCompositeFieldContainer[RelayedMember]
    def __init__(self, round: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., relayed: _Optional[_Iterable[_Union[RelayedMember, _Mapping]]] = ...) -> None: ...

class RelayedMember(_message.Message):
    __slots__ = ("name", "tier", "tokens_per_second")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    name: str
    tier: int
    tokens_per_second: float
    def __init__(self, name: _Optional[str] = ..., tier: _Optional[int] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class GetRoundRequest(_message.Message):
    __slots__ = ("after_round",)
    AFTER_ROUND_FIELD_NUMBER: _ClassVar[int]
    after_round: int
    def __init__(self, after_round: _Optional[int] = ...) -> None: ...

class RoundAssignment(_message.Message):
    __slots__ = ("state", "round", "sequence_ids", "tier", "retry_after_seconds", "assignment_id", "run_tokens", "deadline_in_seconds")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    state: RoundState
    round: int
    sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    tier: int
    retry_after_seconds: float
    assignment_id: str
    run_tokens: int
    deadline_in_seconds: float
    def __init__(self, state: _Optional[_Union[RoundState, str]] = ..., round: _Optional[int] = ..., sequence_ids: _Optional[_Iterable[int]] = ..., tier: _Optional[int] = ..., retry_after_seconds: _Optional[float] = ..., assignment_id: _Optional[str] = ..., run_tokens: _Optional[int] = ..., deadline_in_seconds: _Optional[float] = ...) -> None: ...

class FetchSequencesRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("id", "tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    tokens: Tensor
    def __init__(self, id: _Optional[int] = ..., tokens: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SubmitHeader(_message.Message):
    __slots__ = ("round", "client_id", "tokens", "loss", "train_seconds", "assignment_id", "missed_ids", "tier_losses")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MISSED_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOSSES_FIELD_NUMBER: _ClassVar[int]
    round: int
    client_id: str
    tokens: int
    loss: float
    train_seconds: float
    assignment_id: str
    missed_ids: _containers.RepeatedScalarFieldContainer[int]
    tier_losses: _containers.RepeatedCompositeFieldContainer[TierLoss]
    def __init__(self, round: _Optional[int] = ..., client_id: _Optional[str] = ..., tokens: _Optional[int] = ..., loss: _Optional[float] = ..., train_seconds: _Optional[float] = ..., assignment_id: _Optional[str] = ..., missed_ids: _Optional[_Iterable[int]] = ..., tier_losses: _Optional[_Iterable[_Union[TierLoss, _Mapping]]] = ...) -> None: ...

class TierLoss(_message.Message):
    __slots__ = ("tier", "tokens", "loss")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    tier: int
    tokens: int
    loss: float
    def __init__(self, tier: _Optional[int] = ..., tokens: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class SubmitMessage(_message.Message):
    __slots__ = ("header", "result", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: SubmitHeader
    result: SparseResult
    results: ResultBatch
    def __init__(self, header: _Optional[_Union[SubmitHeader, _Mapping]] = ..., result: _Optional[_Union[SparseResult, _Mapping]] = ..., results: _Optional[_Union[ResultBatch, _Mapping]] = ...) -> None: ...

class ResultBatch(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SparseResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SparseResult, _Mapping]]] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted", "assignments")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    assignments: _containers.RepeatedCompositeFieldContainer[RoundAssignment]
    def __init__(self, accepted: _Optional[int] = ..., assignments: _Optional[_Iterable[_Union[RoundAssignment, _Mapping]]] = ...) -> None: ...

class GetUpdatesRequest(_message.Message):
    __slots__ = ("since_round", "wait_seconds", "tier", "headers_only")
    SINCE_ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    HEADERS_ONLY_FIELD_NUMBER: _ClassVar[int]
    since_round: int
    wait_seconds: float
    tier: int
    headers_only: bool
    def __init__(self, since_round: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., tier: _Optional[int] = ..., headers_only: _Optional[bool] = ...) -> None: ...

class RoundUpdateHeader(_message.Message):
    __slots__ = ("round", "learning_rate", "weight_hash", "parameters", "rule", "weight_decay")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_HASH_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    round: int
    learning_rate: float
    weight_hash: str
    parameters: int
    rule: str
    weight_decay: float
    def __init__(self, round: _Optional[int] = ..., learning_rate: _Optional[float] = ..., weight_hash: _Optional[str] = ..., parameters: _Optional[int] = ..., rule: _Optional[str] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class Box(_message.Message):
    __slots__ = ("range",)
    RANGE_FIELD_NUMBER: _ClassVar[int]
    range: _containers.RepeatedCompositeFieldContainer[Range]
    def __init__(self, range: _Optional[_Iterable[_Union[Range, _Mapping]]] = ...) -> None: ...

class ParameterUpdate(_message.Message):
    __slots__ = ("name", "shape", "covered", "box", "values", "coefficients")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    COVERED_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    covered: _containers.RepeatedCompositeFieldContainer[Box]
    box: _containers.RepeatedCompositeFieldContainer[Range]
    values: Tensor
    coefficients: Coefficients
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., covered: _Optional[_Iterable[_Union[Box, _Mapping]]] = ..., box: _Optional[_Iterable[_Union[Range, _Mapping]]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., coefficients: _Optional[_Union[Coefficients, _Mapping]] = ...) -> None: ...

class Coefficients(_message.Message):
    __slots__ = ("chunk", "positions", "levels", "scales", "level_bits", "per_chunk")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    LEVEL_BITS_FIELD_NUMBER: _ClassVar[int]
    PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: _containers.RepeatedScalarFieldContainer[int]
    positions: bytes
    levels: Tensor
    scales: Tensor
    level_bits: int
    per_chunk: int
    def __init__(self, chunk: _Optional[_Iterable[int]] = ..., positions: _Optional[bytes] = ..., levels: _Optional[_Union[Tensor, _Mapping]] = ..., scales: _Optional[_Union[Tensor, _Mapping]] = ..., level_bits: _Optional[int] = ..., per_chunk: _Optional[int] = ...) -> None: ...

class UpdateMessage(_message.Message):
    __slots__ = ("header", "parameter", "parameters")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    header: RoundUpdateHeader
    parameter: ParameterUpdate
    parameters: ParameterBatch
    def __init__(self, header: _Optional[_Union[RoundUpdateHeader, _Mapping]] = ..., parameter: _Optional[_Union[ParameterUpdate, _Mapping]] = ..., parameters: _Optional[_Union[ParameterBatch, _Mapping]] = ...) -> None: ...

class ParameterBatch(_message.Message):
    __slots__ = ("parameters",)
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterUpdate]
    def __init__(self, parameters: _Optional[_Iterable[_Union[ParameterUpdate, _Mapping]]] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DownloadCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("offset", "total_size", "data", "sha256")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    offset: int
    total_size: int
    data: bytes
    sha256: str
    def __init__(self, offset: _Optional[int] = ..., total_size: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
