"""A GGUF checkpoint, converted once into an ordinary Hugging Face folder in the cache.

transformers reads GGUF files of the architectures it can dequantize (Llama, Qwen2, Mistral,
...) with the ``gguf`` package; loading one takes tens of seconds on a CPU. Converting it once
into safetensors, tokenizer files, chat template and generation config lets every engine
(transformers and slot-decode rollout, vLLM, FSDP ranks, the Tinker workers, serving) load
the folder as it loads any other.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from opentinker.cached_build import build_once, default_cache_dir
from opentinker.pretrained import PretrainedModelError, is_preset, locate

REPORT_FILE = "opentinker_conversion.json"  # written last: a folder with it is complete


@functools.lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """Hashed once per process per (path, size, mtime)."""
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def converted_dir(gguf: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``gguf``'s conversion goes: named after the file's content, so a changed file is
    converted again (never read through a stale folder) and a preset and a path to its file
    share one conversion."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "pretrained" / f"{gguf.stem}-{file_sha256(gguf)[:12]}"


def _is_complete(folder: Path) -> bool:
    return (folder / REPORT_FILE).is_file()


def _as_plain_model(loaded: Any) -> Any:
    """The same weights in a model built from its config without the GGUF quantizer that
    transformers attaches on loading (already dequantized, it makes save_pretrained refuse)."""
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=next(loaded.parameters()).dtype)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    return plain


def convert_gguf(gguf: Path, out: Path) -> dict[str, Any]:
    """Write ``gguf`` as a float32 Hugging Face folder into ``out``; returns the report."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as error:  # transformers reads GGUF with the gguf package
        raise PretrainedModelError(f"reading {gguf.name} needs the gguf package: pip install 'gguf>=0.10' ({error})") from error
    except (ValueError, KeyError, RuntimeError) as error:
        raise PretrainedModelError(f"transformers cannot read {gguf}: {error}") from error
    _as_plain_model(model).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    report = {
        "source": gguf.name,
        "source_sha256": file_sha256(gguf),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "transformers": transformers.__version__,
        "seconds": round(time.monotonic() - started, 1),
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_converted(gguf: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                     progress: bool = True, force: bool = False) -> Path:
    """The Hugging Face folder of ``gguf``, converted on first use (locked, so concurrent
    callers convert it once; renamed into place when finished)."""
    source = Path(gguf).expanduser()
    if not source.is_file():
        raise PretrainedModelError(f"the GGUF file {str(gguf)!r} does not exist")
    target = converted_dir(source, cache_dir)

    def announce() -> None:
        if progress:
            print(f"[opentinker] converting {source.name} into a Hugging Face folder at {target} "
                  "(once; this takes about a minute)", file=sys.stderr, flush=True)

    def build(staging: Path) -> None:
        report = convert_gguf(source, staging)
        if progress:
            print(f"[opentinker] converted {source.name}: {report['architecture']}, "
                  f"{report['parameters'] / 1e6:.1f}M parameters, in {report['seconds']} s", file=sys.stderr, flush=True)

    return build_once(target, build, _is_complete, force=force, announce=announce)


def source_file(path: str) -> Path | None:
    """The GGUF file a model path names: a preset's (PretrainedModelError when it is not
    installed) or a ``.gguf`` path; None for any other path (a folder, a hub name)."""
    if is_preset(path):
        return locate(path)
    expanded = os.path.expanduser(path)
    return Path(expanded) if expanded.endswith(".gguf") else None


def converted_folder(path: str, *, convert: bool = True, progress: bool = True) -> Path | None:
    """The Hugging Face folder of a preset or ``.gguf`` path, converted now unless ``convert``
    is False (then None until a conversion is there); None for any other path."""
    source = source_file(path)
    if source is None:
        return None
    if convert:
        return ensure_converted(source, progress=progress)
    if not source.is_file():
        return None
    folder = converted_dir(source)
    return folder if _is_complete(folder) else None


def read_report(folder: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(folder) / REPORT_FILE).read_text())
