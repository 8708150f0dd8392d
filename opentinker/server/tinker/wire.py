"""The Tinker API's protobuf messages, decoded into plain numpy and encoded back.

The message classes are the SDK's own generated module (``tinker/proto/tinker_public_pb2.py``,
Apache-2.0, from the ``tinker`` package in the server extra), so the wire is exactly what the
SDK writes and reads. It is loaded from its file: importing it through the ``tinker`` package
would run the SDK's ``__init__``, which imports torch into the server process. Everything a client sends is checked here before it goes anywhere:
:class:`WireError` names the datum and field that is wrong, and the route answers it as a
user error. No torch here: the server process decodes, the model workers compute.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from opentinker.engine.tinker.datum_rules import PICTURES
from opentinker.images import ImageError, ImageLimits, PictureTokens, image_size
from opentinker.server.tinker.proto_budget import ParseBudgetError, check_parse_budget
from opentinker.tinker_losses import TINKER_LOSSES


def _sdk_proto_module():
    name = "opentinker._tinker_public_pb2"
    if name not in sys.modules:
        package = importlib.util.find_spec("tinker")  # finds the package without running it
        if package is None or package.origin is None:
            raise ImportError("the Tinker API needs the 'tinker' package: pip install 'opentinker[server]'")
        spec = importlib.util.spec_from_file_location(name, Path(package.origin).parent / "proto" / "tinker_public_pb2.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


pb = _sdk_proto_module()

#: The losses this server computes (opentinker/tinker_losses.py, which the engine's losses read
#: too): the per-token inputs each needs besides ``target_tokens`` and its options with defaults.
SUPPORTED_LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    name: (loss.inputs, dict(loss.options)) for name, loss in TINKER_LOSSES.items()}
#: Per-token inputs a datum may carry, and the dtype each must have.
INPUT_DTYPES = {"target_tokens": "int64", "weights": "float32", "logprobs": "float32", "advantages": "float32",
                "sequence_ratio_mask": "float32"}
_PROTO_DTYPES = {pb.DTYPE_FLOAT32: np.dtype(np.float32), pb.DTYPE_INT64: np.dtype(np.int64)}
_DTYPE_NAMES = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64", pb.DTYPE_INT32: "int32",
                pb.DTYPE_BFLOAT16: "bfloat16"}
MAX_LOGPROB_FLOOR = -99999.0  # an empty top-k cell, as the SDK expects it
#: Datums in one forward_backward request: the SDK's chunk length (client/config
#: ``fwdbwd_max_chunk_len``, 1024 unless a server says otherwise) splits larger calls.
MAX_DATUMS = 1024
#: Fields, messages and repeated values a forward_backward body may hold (proto_budget): a full
#: chunk of 1024 datums, each with its inputs and provenance spans, is about 50,000.
MAX_PARSE_ITEMS = 262_144


class WireError(ValueError):
    """A request the SDK could not have meant: the message says which part is wrong."""


def unsupported_loss_message(name: str) -> str:
    return (f"loss_fn {name!r} is not supported by this server; supported: {', '.join(SUPPORTED_LOSSES)} "
            "(custom losses run client-side with forward_backward_custom)")


@dataclass
class Datum:
    """One training example: ``tokens`` (the model input, N ids) and its per-token inputs,
    each a 1-D array of length N (position i predicts ``target_tokens[i]``)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def _tensor(message: pb.Tensor, where: str, length: int) -> np.ndarray:
    """A per-token input of a datum with ``length`` model input tokens: dense, 1-D, ``length``
    values. Everything is checked against ``length`` before any array is made, so no claimed
    shape makes the server allocate more than the body already holds."""
    dtype = _PROTO_DTYPES.get(message.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype {_DTYPE_NAMES.get(message.dtype, message.dtype)!r} is not accepted "
                        "(float32 or int64)")
    # The SDK writes CSR only for 2-D tensors (TensorData.from_torch_sparse); every input here is
    # 1-D, so a sparse tensor cannot be one: refused by name, its buffers never read.
    if message.WhichOneof("encoding") == "sparse_csr":
        raise WireError(f"{where}: a sparse (CSR) tensor is not accepted; every per-token input is dense and 1-D "
                        f"(shape [{length}], one value per model input token)")
    shape = list(message.shape)
    if any(dim < 0 for dim in shape):
        raise WireError(f"{where}: shape {shape} has a negative dimension; expected [{length}]")
    if shape and shape != [length]:
        raise WireError(f"{where}: shape {shape}, expected [{length}] (one value per model input token)")
    dense = message.dense
    if len(dense) != length * dtype.itemsize:
        raise WireError(f"{where}: {len(dense)} bytes of {dtype.name}, expected {length} values "
                        f"({length * dtype.itemsize} bytes, one per model input token)")
    return np.frombuffer(dense, dtype=dtype)


def _tokens(datum: pb.Datum, where: str, context: int | None, pictures: PictureReading | None
            ) -> tuple[np.ndarray, tuple[bytes, ...]]:
    """The datum's model input as token ids (each picture as its image tokens) and its pictures."""
    pieces, files, count = [], [], 0
    for index, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "image":
            if pictures is None:
                raise WireError(f"{where}.model_input[{index}]: an image chunk, but this model is not a "
                                "vision-language model (token chunks only)")
            image, place = chunk.image, f"{where}.model_input[{index}]"
            if image.HasField("override_dimensions"):
                raise WireError(f"{place}: override_dimensions is not supported (the picture is sized by its processor)")
            expected = image.expected_tokens if image.HasField("expected_tokens") else None
            tokens = pictures.image_tokens(image.data, image.format, expected, place)
            files.append(image.data)
        elif kind == "encoded_text":
            if len(chunk.encoded_text.tokens) % 4:
                raise WireError(f"{where}.model_input[{index}]: token bytes are not int32 values")
            tokens = np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32)
        else:
            raise WireError(f"{where}.model_input[{index}]: {kind or 'an empty chunk'} chunks are not supported "
                            "(token and image chunks)")
        pieces.append(tokens)
        count += tokens.size
    if count == 0:
        raise WireError(f"{where}.model_input: no tokens")
    # The model sees the N input tokens and the last target: N + 1 positions.
    if context is not None and count + 1 > context:
        raise WireError(f"{where}: {count} model input tokens (plus the last target: {count + 1} positions) are "
                        f"more than the model's context of {context} tokens; at most {context - 1} input tokens")
    return np.concatenate(pieces).astype(np.int64), tuple(files)


@dataclass(frozen=True)
class PictureReading:
    """How image chunks become tokens for one vision-language model, under the server's bounds."""

    tokens: PictureTokens
    limits: ImageLimits

    def image_tokens(self, data: bytes, fmt: str, expected: int | None, where: str) -> np.ndarray:
        """An image chunk's tokens (its picture's header read under the bounds, nothing decoded);
        a WireError for a bad picture or an ``expected`` token count that is not the count."""
        if fmt not in ("png", "jpeg"):
            raise WireError(f"{where}: image format {fmt!r}; expected png or jpeg")
        try:
            width, height = image_size(data, self.limits)
            count = self.tokens.count(width, height)
        except ImageError as error:
            raise WireError(f"{where}: {error}") from None
        if expected is not None and expected != count:
            raise WireError(f"{where}: expected_tokens is {expected}, but this {width} x {height} picture is "
                            f"{count} tokens for this model")
        return np.full(count, self.tokens.image_token_id, dtype=np.int64)


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The message of a ``ForwardBackwardRequest`` body (already decompressed), with the ids
    it names checked; its datums are checked by :func:`decode_forward_backward`."""
    message = pb.ForwardBackwardRequest()
    try:
        check_parse_budget(message.DESCRIPTOR, body, MAX_PARSE_ITEMS)
    except ParseBudgetError as error:
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({error})") from None
    try:
        message.ParseFromString(body)
    except DecodeError as error:
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({error})") from None
    if not message.model_id:
        raise WireError("forward_backward: model_id is missing")
    if message.seq_id < 0:
        raise WireError(f"forward_backward: seq_id {message.seq_id} is negative (expected >= 1, or 0 for none)")
    return message


def decode_forward_backward(message: pb.ForwardBackwardRequest | bytes, context: int | None = None,
                            pictures: PictureReading | None = None) -> ForwardBackwardCall:
    """A ``ForwardBackwardRequest`` as plain arrays, every datum checked against its loss and
    the model: known loss and options, at most :data:`MAX_DATUMS` datums, each within the
    model's ``context`` (tokens), the inputs it needs, dense with the right dtypes and one value
    per input token, token ids that are not negative. Image chunks need ``pictures`` (a
    vision-language model's): each becomes its image tokens, its file kept in the datum's
    inputs under :data:`PICTURES`."""
    if isinstance(message, bytes):
        message = parse_forward_backward(message)
    loss = message.loss_fn
    if loss not in SUPPORTED_LOSSES:
        raise WireError(unsupported_loss_message(loss))
    needed, options = SUPPORTED_LOSSES[loss]
    config = loss_config(message, loss, options)
    if not message.data:
        raise WireError("forward_backward: data is empty")
    if len(message.data) > MAX_DATUMS:
        raise WireError(f"forward_backward: {len(message.data)} datums in one request; at most {MAX_DATUMS} "
                        "(the SDK splits larger calls into chunks of that many)")
    data = []
    for index, raw in enumerate(message.data):
        where = f"data[{index}]"
        # Provenance spans (model_input_spans / loss_fn_input_spans) are accepted and not read:
        # Tinker's 'stable_reinforce' looks sampling-time records up by them; this server's
        # takes the sampler's logprobs from the datum (engine/backend/losses.py).
        tokens, files = _tokens(raw, where, context, pictures)
        inputs: dict[str, Any] = {}
        for name, tensor in raw.loss_fn_inputs.items():
            if name not in INPUT_DTYPES:
                raise WireError(f"{where}.loss_fn_inputs: unknown input {name!r} (known: {', '.join(INPUT_DTYPES)})")
            array = _tensor(tensor, f"{where}.loss_fn_inputs[{name!r}]", tokens.size)
            if array.dtype.name != INPUT_DTYPES[name]:
                raise WireError(f"{where}.loss_fn_inputs[{name!r}]: dtype {array.dtype.name}, expected "
                                f"{INPUT_DTYPES[name]}")
            inputs[name] = array
        missing = [name for name in ("target_tokens", *needed) if name not in inputs]
        if missing:
            raise WireError(f"{where}: loss {loss!r} needs loss_fn_inputs {', '.join(map(repr, missing))} "
                            f"(it takes: {', '.join(('target_tokens', *needed))})")
        if (tokens < 0).any() or (inputs["target_tokens"] < 0).any():
            raise WireError(f"{where}: token ids must not be negative")
        if files:
            inputs[PICTURES] = files
        data.append(Datum(tokens, inputs))
    return ForwardBackwardCall(message.model_id, message.seq_id or None, loss, config, message.forward_only, data)


def loss_config(message: pb.ForwardBackwardRequest, loss: str, options: Mapping[str, float]) -> dict[str, float]:
    """The loss options: ``loss_fn_config_v2`` when set (it wins), else the legacy map."""
    if message.loss_fn_config_v2:
        raw: dict[str, Any] = {}
        for key, value in message.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise WireError(f"loss_fn_config[{key!r}]: expected a number")
            raw[key] = value.number
    else:
        raw = dict(message.loss_fn_config)
    unknown = sorted(set(raw) - set(options))
    if unknown:
        raise WireError(f"loss_fn_config: loss {loss!r} takes no option(s) {unknown}; it takes: "
                        f"{', '.join(options) or 'none'}")
    config = {**options, **{key: float(value) for key, value in raw.items()}}
    if "clip_low_threshold" in config and not 0 <= config["clip_low_threshold"] <= 1 <= config["clip_high_threshold"]:
        raise WireError("loss_fn_config: expected 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
                        f"{config['clip_low_threshold']} and {config['clip_high_threshold']}")
    if "clip_high_threshold" in config and not config["clip_high_threshold"] >= 1:
        raise WireError(f"loss_fn_config: expected clip_high_threshold >= 1, got {config['clip_high_threshold']}")
    if "beta" in config and not config["beta"] >= 0:
        raise WireError(f"loss_fn_config: expected beta >= 0, got {config['beta']}")
    return config


# -- results -----------------------------------------------------------------------


def _batched(arrays: Sequence[np.ndarray], dtype: np.dtype, proto_dtype: int) -> pb.BatchedTensor:
    arrays = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=proto_dtype)


def encode_forward_backward_output(outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one ArrayRecord holding each field of every datum (1-D
    float32 arrays of the datum's own length), and the metrics (``name:reduction`` keys)."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in (outputs[0] if outputs else {}):
        record.fields[name].CopyFrom(_batched([out[name] for out in outputs], np.dtype(np.float32), pb.DTYPE_FLOAT32))
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                       metrics={key: float(value) for key, value in metrics.items()})
    return message.SerializeToString()


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    topk: tuple[np.ndarray, np.ndarray] | None = None  # [len(tokens), k] ids and logprobs, when asked for


def _topk(ids: np.ndarray, logprobs: np.ndarray) -> pb.TopkLogprobs:
    length, k = ids.shape
    return pb.TopkLogprobs(token_ids=np.ascontiguousarray(ids, dtype=np.int32).tobytes(),
                           logprobs=np.ascontiguousarray(logprobs, dtype=np.float32).tobytes(), k=k, length=length)


def _dense(array: np.ndarray, dtype: np.dtype, proto_dtype: int) -> pb.Tensor:
    array = np.ascontiguousarray(array, dtype=dtype)
    return pb.Tensor(dense=array.tobytes(), dtype=proto_dtype, shape=list(array.shape))


def encode_sample_response(sequences: Sequence[SampledSequence], prompt_logprobs: Sequence[float] | None = None,
                           topk_prompt: tuple[np.ndarray, np.ndarray] | None = None,
                           prompt_alt: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """A ``SampleResponse``: each sequence's tokens and their logprobs (and their top-k); the
    prompt's logprobs (NaN where not scored), top-k prompt logprobs and the prompt's alternative
    tokens ([len(prompt) - 1, k] ids and logprobs) when asked for."""
    message = pb.SampleResponse()
    for sequence in sequences:
        added = message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype=np.float32).tobytes(),
        )
        if sequence.topk is not None:
            added.topk_sampled_logprobs.CopyFrom(_topk(*sequence.topk))
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        message.topk_prompt_logprobs.CopyFrom(_topk(*topk_prompt))
    if prompt_alt is not None:
        ids, logprobs = prompt_alt
        message.prompt_alt_tokens.tokens.CopyFrom(_dense(ids, np.dtype(np.int64), pb.DTYPE_INT64))
        message.prompt_alt_tokens.logprobs.CopyFrom(_dense(logprobs, np.dtype(np.float32), pb.DTYPE_FLOAT32))
    return message.SerializeToString()
