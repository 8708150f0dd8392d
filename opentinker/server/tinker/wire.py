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

#: The losses this server computes, with the per-token inputs each needs besides
#: ``target_tokens`` and the options it takes (with defaults). Must agree with
#: ``engine.backend.losses`` (a test checks); Tinker names its sampler logprobs ``logprobs``.
SUPPORTED_LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "cross_entropy": ((), {}),
    "importance_sampling": (("logprobs", "advantages"), {}),
    "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
}
#: Per-token inputs a datum may carry, and the dtype each must have.
INPUT_DTYPES = {"target_tokens": "int64", "weights": "float32", "logprobs": "float32", "advantages": "float32"}
_PROTO_DTYPES = {pb.DTYPE_FLOAT32: np.dtype(np.float32), pb.DTYPE_INT64: np.dtype(np.int64)}
_DTYPE_NAMES = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64", pb.DTYPE_INT32: "int32",
                pb.DTYPE_BFLOAT16: "bfloat16"}
MAX_LOGPROB_FLOOR = -99999.0  # an empty top-k cell, as the SDK expects it


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


def _tensor(message: pb.Tensor, where: str) -> np.ndarray:
    dtype = _PROTO_DTYPES.get(message.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype {_DTYPE_NAMES.get(message.dtype, message.dtype)!r} is not accepted "
                        "(float32 or int64)")
    if message.WhichOneof("encoding") == "sparse_csr":
        return _dense_from_csr(message, dtype, where)
    if len(message.dense) % dtype.itemsize:
        raise WireError(f"{where}: {len(message.dense)} bytes is not a whole number of {dtype.name} values")
    values = np.frombuffer(message.dense, dtype=dtype)
    shape = list(message.shape) or [values.size]
    if int(np.prod(shape)) != values.size:
        raise WireError(f"{where}: shape {shape} does not hold {values.size} values")
    return values.reshape(shape)


def _dense_from_csr(message: pb.Tensor, dtype: np.dtype, where: str) -> np.ndarray:
    shape = list(message.shape)
    if len(shape) != 2:
        raise WireError(f"{where}: a sparse tensor needs a 2-D shape, got {shape}")
    csr = message.sparse_csr
    try:
        values = np.frombuffer(csr.values, dtype=dtype)
        rows = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
    except ValueError as error:
        raise WireError(f"{where}: sparse tensor bytes are malformed ({error})") from None
    if len(rows) != shape[0] + 1 or len(cols) != len(values) or (len(rows) and rows[-1] != len(values)) \
            or (len(cols) and (cols.min() < 0 or cols.max() >= shape[1])) or np.any(np.diff(rows) < 0):
        raise WireError(f"{where}: sparse tensor indices do not fit shape {shape}")
    dense = np.zeros(shape, dtype=dtype)
    for row in range(shape[0]):
        dense[row, cols[rows[row]:rows[row + 1]]] = values[rows[row]:rows[row + 1]]
    return dense


def _tokens(datum: pb.Datum, where: str) -> np.ndarray:
    pieces = []
    for index, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"{where}.model_input[{index}]: only token chunks are supported "
                            f"(got {kind or 'an empty chunk'}; this server trains text models)")
        if len(chunk.encoded_text.tokens) % 4:
            raise WireError(f"{where}.model_input[{index}]: token bytes are not int32 values")
        pieces.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
    if tokens.size == 0:
        raise WireError(f"{where}.model_input: no tokens")
    return tokens


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A ``ForwardBackwardRequest`` body (already decompressed) as plain arrays, every datum
    checked against its loss: known loss and options, the inputs it needs with the right
    dtypes, each of the model input's length, token ids that are not negative."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as error:
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({error})") from None
    if not message.model_id:
        raise WireError("forward_backward: model_id is missing")
    loss = message.loss_fn
    if loss not in SUPPORTED_LOSSES:
        raise WireError(unsupported_loss_message(loss))
    needed, options = SUPPORTED_LOSSES[loss]
    config = loss_config(message, loss, options)
    if not message.data:
        raise WireError("forward_backward: data is empty")
    data = []
    for index, raw in enumerate(message.data):
        where = f"data[{index}]"
        # Provenance spans (model_input_spans / loss_fn_input_spans) are ignored: only the loss
        # 'stable_reinforce' reads them, and it is refused above. The cookbook's RL loop attaches
        # them to every datum whose tokens were sampled here, whatever the loss.
        tokens = _tokens(raw, where)
        inputs = {}
        for name, tensor in raw.loss_fn_inputs.items():
            if name not in INPUT_DTYPES:
                raise WireError(f"{where}.loss_fn_inputs: unknown input {name!r} (known: {', '.join(INPUT_DTYPES)})")
            array = _tensor(tensor, f"{where}.loss_fn_inputs[{name!r}]")
            if array.dtype.name != INPUT_DTYPES[name]:
                raise WireError(f"{where}.loss_fn_inputs[{name!r}]: dtype {array.dtype.name}, expected "
                                f"{INPUT_DTYPES[name]}")
            if array.shape != tokens.shape:
                raise WireError(f"{where}.loss_fn_inputs[{name!r}]: shape {list(array.shape)}, expected "
                                f"[{tokens.size}] (one value per model input token)")
            inputs[name] = array
        missing = [name for name in ("target_tokens", *needed) if name not in inputs]
        if missing:
            raise WireError(f"{where}: loss {loss!r} needs loss_fn_inputs {', '.join(map(repr, missing))} "
                            f"(it takes: {', '.join(('target_tokens', *needed))})")
        if (tokens < 0).any() or (inputs["target_tokens"] < 0).any():
            raise WireError(f"{where}: token ids must not be negative")
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
    return config


def peek_ids(body: bytes) -> tuple[str, int | None]:
    """``(model_id, seq_id)`` of a body that may be invalid otherwise ("", None if unreadable)."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError:
        return "", None
    return message.model_id, message.seq_id or None


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


def _topk(ids: np.ndarray, logprobs: np.ndarray) -> pb.TopkLogprobs:
    length, k = ids.shape
    return pb.TopkLogprobs(token_ids=np.ascontiguousarray(ids, dtype=np.int32).tobytes(),
                           logprobs=np.ascontiguousarray(logprobs, dtype=np.float32).tobytes(), k=k, length=length)


def encode_sample_response(sequences: Sequence[SampledSequence], prompt_logprobs: Sequence[float] | None = None,
                           topk_prompt: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """A ``SampleResponse``: each sequence's tokens and their logprobs; the prompt's logprobs
    (NaN where not scored) and top-k prompt logprobs when asked for."""
    message = pb.SampleResponse()
    for sequence in sequences:
        message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        message.topk_prompt_logprobs.CopyFrom(_topk(*topk_prompt))
    return message.SerializeToString()
