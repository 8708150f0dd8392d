"""The vision inputs the engine builds itself: image-pad widening and 3-D rotary positions equal
to transformers' own Qwen2-VL ones, with several pictures of different shapes in a row."""

from __future__ import annotations

import inspect

import pytest
import torch

from opentinker.engine.vision import VisionLayout, batch_positions, expand_image_pads, mrope_positions

IMAGE, START, END = 50, 51, 52


def _tiny_qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={"vocab_size": 64, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]}},
        vision_config={"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 48, "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=IMAGE, video_token_id=53, vision_start_token_id=START, vision_end_token_id=END)
    return Qwen2VLForConditionalGeneration(config).eval()


def test_positions_equal_transformers_get_rope_index():
    model = _tiny_qwen2_vl()
    layout = VisionLayout.of(model.config)
    assert layout == VisionLayout(IMAGE, 2)
    grids = [(1, 4, 8), (1, 6, 2), (1, 2, 2)]
    prompt = [3, 4, START, IMAGE, END, 5, START, IMAGE, END, 6, 7, 8, START, IMAGE, END, 9]
    ids = expand_image_pads(prompt, grids, layout)
    assert ids.count(IMAGE) == 8 + 3 + 1
    ours = mrope_positions(ids, grids, layout)
    assert torch.equal(ours[0], torch.arange(len(ids)))  # the text positions the packed mask reads
    input_ids = torch.tensor([ids])
    kwargs = {"image_grid_thw": torch.tensor(grids), "attention_mask": torch.ones_like(input_ids)}
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = (input_ids == IMAGE).int()
    theirs, _ = model.model.get_rope_index(input_ids, **kwargs)
    assert torch.equal(ours[1:], theirs[:, 0])


def test_a_text_only_sequence_counts_up_on_every_axis():
    layout = VisionLayout(IMAGE, 2)
    positions = mrope_positions([1, 2, 3, 4], [], layout)
    assert torch.equal(positions, torch.arange(4).expand(4, 4))


def test_forward_with_our_positions_equals_the_models_own():
    """A forward given our [4, rows, T] positions (right- and left-padded rows) gives the logits
    of transformers' own position computation on each row alone."""
    model = _tiny_qwen2_vl()
    layout = VisionLayout.of(model.config)
    torch.manual_seed(0)
    grids = [(1, 4, 4)]
    ids = expand_image_pads([3, START, IMAGE, END, 4, 5], grids, layout)
    pixels = torch.randn(16, 3 * 2 * 14 * 14)
    input_ids = torch.tensor([ids])
    own_kwargs = {}
    if "mm_token_type_ids" in inspect.signature(model.model.forward).parameters:
        own_kwargs["mm_token_type_ids"] = (input_ids == IMAGE).int()
    with torch.no_grad():
        own = model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=torch.tensor(grids), **own_kwargs).logits
        model.model.rope_deltas = None
        for left in (0, 3):
            padded = torch.tensor([[0] * left + ids])
            mask = torch.tensor([[0] * left + [1] * len(ids)])
            positions = batch_positions([mrope_positions(ids, grids, layout)], left + len(ids), [left])
            ours = model(input_ids=padded, attention_mask=mask, position_ids=positions, pixel_values=pixels,
                         image_grid_thw=torch.tensor(grids)).logits
            torch.testing.assert_close(ours[:, left:], own, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ids, grids, message", [
    ([1, IMAGE, 2], [(1, 4, 4), (1, 2, 2)], "1 image placeholder"),
    ([1, 2], [(1, 2, 2)], "0 image placeholder"),
])
def test_placeholders_and_images_must_agree(ids, grids, message):
    with pytest.raises(ValueError, match=message):
        expand_image_pads(ids, grids, VisionLayout(IMAGE, 2))


def test_a_short_image_run_is_refused():
    with pytest.raises(ValueError, match="needs 4 image tokens"):
        mrope_positions([1, IMAGE, IMAGE, 2], [(1, 4, 4)], VisionLayout(IMAGE, 2))
