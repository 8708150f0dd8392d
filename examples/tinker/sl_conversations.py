"""Supervised learning with the tinker-cookbook, unmodified, against an OpenTinker server.

The cookbook's `supervised.train` loop on its bundled `example_data/conversations.jsonl`
(`FromConversationFileBuilder`), i.e. what `recipes/sl_basic.py` does with a file, but with an
explicit renderer: sl_basic looks the renderer up in the cookbook's table of hosted models,
which does not know local models. Run by examples/tinker/cookbook_recipes.sh; by hand:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-<key> \
        python examples/tinker/sl_conversations.py model_name=<tiny model folder> log_path=/tmp/sl

Any top-level `supervised.train.Config` field can be set the same way (chz `key=value`), e.g.
`learning_rate=3e-4 num_epochs=2 max_steps=5`. model_name defaults to the embedded tiny
model's folder (the cookbook loads the tokenizer from it; the server maps it to its weights).
"""

import asyncio
import os
import sys
from importlib.resources import files

import chz

from tinker_cookbook import cli_utils
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

CONVERSATIONS = str(files("tinker_cookbook") / "example_data" / "conversations.jsonl")


def blueprint(model_name: str, renderer_name: str) -> chz.Blueprint[train.Config]:
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model_name,
        renderer_name=renderer_name,
        max_length=1024,  # the tiny model's context
        batch_size=16,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    # 16 of the 128 conversations are held out: the cookbook then evaluates test NLL with a
    # sampling client (compute_logprobs) every eval_every steps.
    dataset = FromConversationFileBuilder(common_config=common, file_path=CONVERSATIONS, test_size=16)
    return chz.Blueprint(train.Config).apply({
        "log_path": cli_utils.runs_path("sl_conversations"),
        "model_name": model_name,
        "recipe_name": "opentinker_sl_conversations",
        "renderer_name": renderer_name,
        "dataset_builder": dataset,
        "base_url": os.environ.get("TINKER_BASE_URL"),
        "learning_rate": 1e-3,
        "lr_schedule": "linear",
        "lora_rank": 16,
        "num_epochs": 3,
        "eval_every": 5,
        "save_every": 0,
    })


if __name__ == "__main__":
    argv = sys.argv[1:]
    from opentinker.tiny import ensure_tiny_model

    model_name = cli_utils.model_name_from_argv(argv, default="") or str(ensure_tiny_model())
    renderer_name = "role_colon"
    for arg in argv:  # like model_name: the dataset's renderer follows it (last one wins)
        if arg.startswith("renderer_name="):
            renderer_name = arg.removeprefix("renderer_name=")
    config = blueprint(model_name, renderer_name).make_from_argv(argv)
    cli_utils.check_log_dir(config.log_path, behavior_if_exists="delete")
    asyncio.run(train.main(config))
