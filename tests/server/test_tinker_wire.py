"""The Tinker wire format: what the SDK's own converters write, decoded here, and what is
encoded here, read back by the SDK's own converters (no server, no model)."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from opentinker.engine.backend.losses import resolve_loss  # noqa: E402
from opentinker.engine.tinker.datums import INPUT_NAMES  # noqa: E402
from opentinker.server.tinker import wire  # noqa: E402


def _body(data, loss="ppo", config=None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
        model_id="s:train:0", seq_id=4)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_the_sdks_request_decodes_to_the_same_arrays():
    weights_2d = types.TensorData.from_numpy(np.eye(3, dtype=np.float32)[0])
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [-1.0, -2.0, -0.5],
                                        "advantages": [0.5, -0.5, 1.0], "weights": weights_2d})]
    call = wire.decode_forward_backward(_body(data, config={"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}))
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 4, "ppo", False)
    assert call.loss_config == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    (datum,) = call.data
    assert datum.tokens.tolist() == [5, 6, 7] and datum.inputs["target_tokens"].tolist() == [6, 7, 8]
    assert datum.inputs["logprobs"].dtype == np.float32
    np.testing.assert_allclose(datum.inputs["advantages"], [0.5, -0.5, 1.0])


def test_refusals_name_the_problem():
    ok = types.Datum(model_input=types.ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, 7]})
    with pytest.raises(wire.WireError, match="'custom' is not supported.*cross_entropy.*stable_reinforce"):
        wire.decode_forward_backward(_body([ok], loss="custom"))
    rl = types.Datum(model_input=types.ModelInput.from_ints([5, 6]),
                     loss_fn_inputs={"target_tokens": [6, 7], "logprobs": [-1.0, -1.0], "advantages": [1.0, 1.0]})
    with pytest.raises(wire.WireError, match="loss 'gspo' needs loss_fn_inputs 'sequence_ratio_mask'"):
        wire.decode_forward_backward(_body([rl], loss="gspo"))
    with pytest.raises(wire.WireError, match="clip_high_threshold >= 1, got 0.5"):
        wire.decode_forward_backward(_body([rl], loss="stable_reinforce", config={"clip_high_threshold": 0.5}))
    with pytest.raises(wire.WireError, match="beta >= 0"):
        wire.decode_forward_backward(_body([rl], loss="dro", config={"beta": -1.0}))
    with pytest.raises(wire.WireError, match="takes no option.*'clip'"):
        wire.decode_forward_backward(_body([ok], config={"clip": 1.0}))
    with pytest.raises(wire.WireError, match="clip_low_threshold <= 1"):
        wire.decode_forward_backward(_body([ok], config={"clip_low_threshold": 1.5}))
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.decode_forward_backward(b"\xff\xff\xff\xff")
    with pytest.raises(wire.WireError, match="unknown input 'rewards'"):
        bad = types.Datum(model_input=types.ModelInput.from_ints([5]), loss_fn_inputs={"target_tokens": [6],
                                                                                        "rewards": types.TensorData(data=[1.0], dtype="float32")})
        wire.decode_forward_backward(_body([bad], loss="cross_entropy"))


def test_outputs_read_back_by_the_sdk():
    outputs = [{"logprobs": np.array([-1.0, -2.0], np.float32), "elementwise_loss": np.array([1.0, 2.0], np.float32)},
               {"logprobs": np.array([-0.5], np.float32), "elementwise_loss": np.array([0.5], np.float32)}]
    decoded = deserialize_forward_backward_output(wire.encode_forward_backward_output(outputs, {"loss:sum": 3.5}))
    assert decoded.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]

    sample = deserialize_sample_response(wire.encode_sample_response(
        [wire.SampledSequence([4, 5], [-0.25, -0.5], "stop"), wire.SampledSequence([9], [-1.0], "length")],
        prompt_logprobs=[float("nan"), -1.5],
        topk_prompt=(np.array([[0, 0], [3, 4]], np.int32), np.array([[-99999.0, -99999.0], [-0.1, -2.0]], np.float32))))
    assert [s.tokens for s in sample.sequences] == [[4, 5], [9]]
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.prompt_logprobs == [None, -1.5]
    assert sample.topk_prompt_logprobs[1] == [(3, pytest.approx(-0.1)), (4, -2.0)]


def test_the_supported_losses_are_the_backends_with_the_same_options():
    for name, (needed, options) in wire.SUPPORTED_LOSSES.items():
        spec, defaults = resolve_loss(name, None)
        assert defaults == options
        assert set(spec.inputs) == {INPUT_NAMES[n] for n in needed}


@pytest.mark.parametrize("loss", ["importance_sampling", "stable_reinforce"])
def test_provenance_spans_the_cookbook_attaches_are_accepted(loss):
    from tinker.types.provenance_spans import PromptProvenanceSpan, SampledProvenanceSpan

    # What the cookbook's rl_loop attaches for stable_reinforce (with_sampled_provenance).
    d = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [0.0, -1.0, -1.0],
                                    "advantages": [0.0, 1.0, 1.0]}).with_provenance(
        model_input=[PromptProvenanceSpan(sequence_id="r:0", length=2), SampledProvenanceSpan(sequence_id="r:0", length=1)],
        loss_fn_inputs=[PromptProvenanceSpan(sequence_id="r:0", offset=1, length=1),
                        SampledProvenanceSpan(sequence_id="r:0", length=2)])
    call = wire.decode_forward_backward(_body([d], loss=loss, config=None))
    assert call.loss_fn == loss and call.data[0].tokens.tolist() == [5, 6, 7]


def test_gspos_sequence_ratio_mask_is_a_float_input():
    d = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [0.0, -1.0, -1.0],
                                    "advantages": [0.0, 1.0, 1.0], "sequence_ratio_mask": [0.0, 1.0, 1.0]})
    call = wire.decode_forward_backward(_body([d], loss="gspo"))
    assert call.loss_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert call.data[0].inputs["sequence_ratio_mask"].tolist() == [0.0, 1.0, 1.0]
