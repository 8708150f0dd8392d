"""What the API process knows about a served model without loading it (no torch): its
context length from ``config.json`` and the size of its weight files on disk.

The context bounds a training datum at submit; the size is the basis of the admission
estimate of a new model's memory (:func:`estimated_model_bytes`). A model whose folder is not
there yet (the tiny model before its first build, a hub name not in the local cache) has
unknown facts: then only the checks that need them are skipped.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from opentinker.images import PictureTokens
from opentinker.server.policy import ServedModel

log = logging.getLogger("opentinker.server.tinker")

#: Memory of a live model per byte of its weight files: LoRA holds the frozen weights plus
#: small adapters and their optimizer state; full fine-tuning holds weights, gradients and
#: Adam's two moments. Estimates: activations and allocator overhead come on top.
LORA_FACTOR = 1.25
FULL_FACTOR = 4.0
#: Bytes per LoRA parameter while training: fp32 weight, gradient and Adam's two moments.
ADAPTER_PARAM_BYTES = 16
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class ModelFacts:
    context: int | None  # max_position_embeddings (tokens), None: unknown
    weight_bytes: int | None  # size of the weight files, None: unknown
    # LoRA parameters per unit of rank with every linear layer of every block and the
    # unembedding adapted (an upper bound for fewer targets), None: unknown
    lora_params_per_rank: int | None = None
    hidden_size: int | None = None  # the model's width: every adapted layer has it on one side
    pictures: PictureTokens | None = None  # a vision-language model's: how a picture becomes tokens


def model_folder(model: ServedModel) -> Path | None:
    """Where a served model's files are on this machine (None: not here, or not yet)."""
    if model.path is None:
        from opentinker.tiny import tiny_model_dir  # no torch: the shipped folder

        return tiny_model_dir()
    from opentinker.tiny_vlm import SHIPPED_DIR, TINY_VLM_PRESET

    if model.path == TINY_VLM_PRESET:
        return SHIPPED_DIR
    from opentinker.pretrained import PretrainedModelError
    from opentinker.pretrained.convert import converted_folder

    try:  # a preset or a .gguf file: its conversion (made when the server started)
        converted = converted_folder(model.path, convert=False)
    except PretrainedModelError:
        return None
    if converted is not None:
        return converted
    local = Path(os.path.expanduser(model.path))
    if local.is_dir():
        return local
    try:  # a hub name: its snapshot in the local cache, if any (never a download)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model.path, local_files_only=True))
    except Exception:
        return None


def _context(config: dict) -> int | None:
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _lora_params_per_rank(config: dict) -> int | None:
    """sum(d_in + d_out) over a Llama/Qwen-style block's q, k, v, o, gate, up, down, times the
    number of blocks, plus the unembedding's (``train_unembed``: hidden size + vocabulary)."""
    config = config.get("text_config") or config
    try:
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        inner = int(config.get("intermediate_size") or 4 * hidden)
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        kv = int(config.get("num_key_value_heads") or heads) * head_dim
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    attention = 2 * (hidden + heads * head_dim) + 2 * (hidden + kv)
    return layers * (attention + 3 * (hidden + inner)) + hidden + vocab


def _hidden_size(config: dict) -> int | None:
    value = (config.get("text_config") or config).get("hidden_size")
    return value if isinstance(value, int) and value > 0 else None


def _weight_bytes(folder: Path) -> int | None:
    files = [f for f in folder.iterdir() if f.is_file() and f.suffix in _WEIGHT_SUFFIXES]
    # A folder may hold the same weights twice (safetensors and .bin): count one format.
    safetensors = [f for f in files if f.suffix == ".safetensors"]
    chosen = safetensors or files
    return sum(f.stat().st_size for f in chosen) if chosen else None


class ModelFactsCache:
    """Facts per served model, read once they can be read (unknown ones are read again later)."""

    def __init__(self) -> None:
        self._known: dict[str, ModelFacts] = {}

    def get(self, model: ServedModel) -> ModelFacts:
        known = self._known.get(model.name)
        if known is not None:
            return known
        facts = read_model_facts(model)
        if facts.context is not None and facts.weight_bytes is not None:
            self._known[model.name] = facts
        return facts


def read_model_facts(model: ServedModel) -> ModelFacts:
    folder = model_folder(model)
    if folder is None or not (folder / "config.json").is_file():
        return ModelFacts(None, None)
    try:
        config = json.loads((folder / "config.json").read_text())
        if not isinstance(config, dict):
            return ModelFacts(None, _weight_bytes(folder))
        return ModelFacts(_context(config), _weight_bytes(folder), _lora_params_per_rank(config), _hidden_size(config),
                          PictureTokens.of_folder(folder))
    except (OSError, ValueError) as error:
        log.warning("tinker: cannot read the facts of model %s from %s: %s", model.name, folder, error)
        return ModelFacts(None, None)


def estimated_model_bytes(facts: ModelFacts, lora: bool) -> int | None:
    """The admission estimate of a live model's memory, or None when its size is unknown."""
    if facts.weight_bytes is None:
        return None
    return int(facts.weight_bytes * (LORA_FACTOR if lora else FULL_FACTOR))


def estimated_adapter_bytes(facts: ModelFacts, rank: int) -> int | None:
    """The admission estimate of one LoRA model beside others on a shared base: its adapter
    and optimizer state (the base is counted once, by the worker that holds it)."""
    if facts.lora_params_per_rank is None:
        return None
    return facts.lora_params_per_rank * rank * ADAPTER_PARAM_BYTES


#: Bytes per LoRA parameter on disk: fp32 (what the adapters train in; bf16 would be half).
#: A state checkpoint holds the weight and Adam's two moments, a sampler snapshot the weight.
_SAVED_PARAM_BYTES = 4


def estimated_checkpoint_bytes(facts: ModelFacts, lora_rank: int, sampler: bool) -> int | None:
    """What a model's first checkpoint will take on disk, before it is written (later ones
    are estimated by the model's previous one of the same kind), or None when unknown: a LoRA
    model's adapter from its parameter count (an upper bound: every linear layer adapted), a
    fully fine-tuned model's weights as large as the weight files; x3 with Adam's moments."""
    copies = 1 if sampler else 3
    if lora_rank > 0:
        if facts.lora_params_per_rank is None:
            return None
        return facts.lora_params_per_rank * lora_rank * _SAVED_PARAM_BYTES * copies
    return None if facts.weight_bytes is None else facts.weight_bytes * copies
