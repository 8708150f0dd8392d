"""The JSON request bodies of the Tinker routes, as the SDK 0.38.0 sends them.

Fields this server does not use are ignored (``extra="ignore"``: a newer SDK may add some);
the ones it uses are typed and bounded, so a bad value is a 422 naming the field. Every
body is first checked whole as the main API's are (``protocol.wire_problem``: no lone
surrogates, integers within int64, finite numbers, bounded nesting), and every number that
reaches the store is below 2**63.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from opentinker.protocol import MAX_INT, wire_problem

CHECKPOINT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ID = Field(min_length=1, max_length=256)
MAX_TAGS = 64
MAX_TAG_CHARS = 256
MAX_METADATA_BYTES = 4096  # user_metadata, as JSON
MAX_TTL_S = 100 * 365 * 86400
#: topk_sample_logprobs and prompt_alt_tokens_k at most (vLLM's and OpenAI's bound on top logprobs).
MAX_TOKEN_ALTERNATIVES = 20
#: num_samples x max_tokens x topk_sample_logprobs of one call at most: 32 MiB of top-k in its result.
MAX_TOPK_SAMPLE_CELLS = 2**22


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _wire_safe(cls, data: Any) -> Any:
        problem = wire_problem(data, limit=MAX_INT)
        if problem:
            raise PydanticCustomError("unsafe_value", problem)
        return data


def _small_json(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None and len(json.dumps(value)) > MAX_METADATA_BYTES:
        raise ValueError(f"at most {MAX_METADATA_BYTES} bytes as JSON")
    return value


#: ``user_metadata``: a small JSON object kept with the session, model or checkpoint.
Metadata = Annotated[dict[str, Any] | None, AfterValidator(_small_json)]
StrMetadata = Annotated[dict[str, str] | None, AfterValidator(_small_json)]
SeqId = Annotated[int, Field(ge=1, le=MAX_INT)]
Tag = Annotated[str, Field(max_length=MAX_TAG_CHARS)]


class CreateSession(_Body):
    tags: list[Tag] = Field(default_factory=list, max_length=MAX_TAGS)
    user_metadata: Metadata = None
    sdk_version: str | None = Field(None, max_length=64)


class SessionRef(_Body):
    session_id: str = ID


class FinishReason(_Body):
    type: str = Field("success", max_length=64)


class FinishSession(_Body):
    reason: FinishReason | None = None
    detail: str | None = Field(None, max_length=4096)  # not kept


class LoraConfig(_Body):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = Field(None, ge=0, le=MAX_INT)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_Body):
    type: str = Field("adamw", max_length=64)


class CreateModel(_Body):
    session_id: str = ID
    model_seq_id: int = Field(ge=0, le=MAX_INT)
    base_model: str = Field(min_length=1, max_length=1024)
    user_metadata: StrMetadata = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None


class ModelRef(_Body):
    model_id: str = ID


class AdamParams(_Body):
    learning_rate: float = Field(ge=0, le=1.0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=10)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStep(_Body):
    model_id: str = ID
    seq_id: SeqId | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None  # only its "type" is read (to name it in the refusal)


class SaveWeights(_Body):
    model_id: str = ID
    seq_id: SeqId | None = None
    path: str | None = Field(None, pattern=CHECKPOINT_NAME)
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)
    user_metadata: StrMetadata = None
    overwrite: bool = False
    sampling_session_seq_id: int | None = Field(None, ge=0, le=MAX_INT)  # save_weights_for_sampler, ephemeral


class LoadWeights(_Body):
    path: str = Field(min_length=1, max_length=2048)
    optimizer: bool = False
    # create-via-load
    session_id: str | None = Field(None, min_length=1, max_length=256)
    model_seq_id: int | None = Field(None, ge=0, le=MAX_INT)
    user_metadata: StrMetadata = None
    # legacy: into an existing model
    model_id: str | None = Field(None, min_length=1, max_length=256)
    seq_id: SeqId | None = None


class CreateSamplingSession(_Body):
    session_id: str = ID
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = Field(None, max_length=1024)
    model_path: str | None = Field(None, max_length=2048)


class EncodedText(_Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int] = Field(max_length=1_000_000)


class ImageChunk(_Body):
    type: Literal["image"] = "image"
    data: str = Field(max_length=64 * 1024 * 1024)  # base64; the picture's own bound is the server's
    format: str = Field(max_length=16)
    expected_tokens: int | None = Field(None, ge=0, le=MAX_INT)


class OtherChunk(_Body):
    type: str


class ModelInput(_Body):
    chunks: list[Union[EncodedText, ImageChunk, OtherChunk]] = Field(min_length=1)


class SamplingParams(_Body):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Union[str, list[str], list[int], None] = None
    temperature: float = Field(1.0, ge=0, le=100)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class SampleRequest(_Body):
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: int | None = None
    num_samples: int = Field(1, ge=1, le=1024)
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(0, ge=0, le=1024)
    topk_sample_logprobs: int = Field(0, ge=0, le=MAX_TOKEN_ALTERNATIVES)
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = Field(0, ge=0, le=MAX_TOKEN_ALTERNATIVES)
    prompt_logprobs_last_n: int | None = Field(None, ge=1)
    record_stability_info: bool = False


class FuturesTarget(_Body):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str = ID
    cloned_sampler_id: int = Field(0, ge=0, le=MAX_INT)


class RetrieveFutures(_Body):
    target: FuturesTarget
    prev_cursor: int = Field(0, ge=0, le=MAX_INT)
    timeout: float | None = Field(None, ge=0, le=3600)
    retrieved_request_ids: list[str] = Field(default_factory=list, max_length=100_000)


class RetrieveFuture(_Body):
    request_id: str = ID
    allow_metadata_only: bool = False


class WeightsInfo(_Body):
    tinker_path: str = Field(min_length=1, max_length=2048)
