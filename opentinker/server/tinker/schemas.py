"""The JSON request bodies of the Tinker routes, as the SDK 0.38.0 sends them.

Fields this server does not use are ignored (``extra="ignore"``: a newer SDK may add some);
the ones it uses are typed and bounded, so a bad value is a 422 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

CHECKPOINT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ID = Field(min_length=1, max_length=256)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateSession(_Body):
    tags: list[str] = Field(default_factory=list, max_length=64)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None


class SessionRef(_Body):
    session_id: str = ID


class FinishReason(_Body):
    type: str = "success"


class FinishSession(_Body):
    reason: FinishReason | None = None
    detail: str | None = None


class LoraConfig(_Body):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_Body):
    type: str = "adamw"


class CreateModel(_Body):
    session_id: str = ID
    model_seq_id: int = Field(ge=0)
    base_model: str = Field(min_length=1, max_length=1024)
    user_metadata: dict[str, str] | None = None
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
    seq_id: int | None = Field(None, ge=1)
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(_Body):
    model_id: str = ID
    seq_id: int | None = Field(None, ge=1)
    path: str | None = Field(None, pattern=CHECKPOINT_NAME)
    ttl_seconds: int | None = Field(None, ge=1)
    user_metadata: dict[str, str] | None = None
    sampling_session_seq_id: int | None = Field(None, ge=0)  # save_weights_for_sampler, ephemeral


class LoadWeights(_Body):
    path: str = Field(min_length=1, max_length=2048)
    optimizer: bool = False
    # create-via-load
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    user_metadata: dict[str, str] | None = None
    # legacy: into an existing model
    model_id: str | None = None
    seq_id: int | None = Field(None, ge=1)


class CreateSamplingSession(_Body):
    session_id: str = ID
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = Field(None, max_length=1024)
    model_path: str | None = Field(None, max_length=2048)


class EncodedText(_Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int] = Field(max_length=1_000_000)


class OtherChunk(_Body):
    type: str


class ModelInput(_Body):
    chunks: list[Union[EncodedText, OtherChunk]] = Field(min_length=1)


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
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = Field(None, ge=1)
    record_stability_info: bool = False


class RetrieveFuture(_Body):
    request_id: str = ID
    allow_metadata_only: bool = False


class WeightsInfo(_Body):
    tinker_path: str = Field(min_length=1, max_length=2048)
