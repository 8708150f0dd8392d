"""A config key given twice in one mapping (dotted and nested, two dotted spellings, a nested
section beside a dotted key below it) is an error naming the key and both spellings, wherever
a mapping is read: make_config, flatten (the server's policy), the client's GenericEnvironment
and RecipeSpec. Separate overrides still stack, later ones winning."""

from __future__ import annotations

import pytest

from opentinker.config import ConfigError, flatten, make_config

LR = "actor_rollout_ref.actor.optim.lr"

TWICE = [  # (mapping, the key named, the first spelling, the second)
    ({LR: 1e-5, "actor_rollout_ref": {"actor": {"optim": {"lr": 3e-5}}}}, LR,
     "['actor_rollout_ref.actor.optim.lr']", "['actor_rollout_ref']['actor']['optim']['lr']"),
    ({"actor_rollout_ref": {"actor": {"optim": {"lr": 3e-5}}}, LR: 1e-5}, LR,
     "['actor_rollout_ref']['actor']['optim']['lr']", "['actor_rollout_ref.actor.optim.lr']"),
    ({LR: 1e-5, "actor_rollout_ref.actor": {"optim.lr": 3e-5}}, LR,  # two dotted spellings
     "['actor_rollout_ref.actor.optim.lr']", "['actor_rollout_ref.actor']['optim.lr']"),
    ({"trainer": {"seed": 1}, "trainer.seed": 2}, "trainer.seed", "['trainer']['seed']", "['trainer.seed']"),
    ({"actor_rollout_ref": {"actor.optim": {"lr": 1e-5}}, "actor_rollout_ref.actor": {"optim": {"lr": 3e-5}}}, LR,
     "['actor_rollout_ref']['actor.optim']['lr']", "['actor_rollout_ref.actor']['optim']['lr']"),
]


@pytest.mark.parametrize(("mapping", "key", "first", "second"), TWICE)
def test_a_key_given_twice_in_one_mapping_names_the_key_and_both_spellings(mapping, key, first, second):
    for read in (make_config, flatten):
        with pytest.raises(ConfigError) as error:
            read(mapping)
        assert str(error.value) == f"config key '{key}' is given twice, as {first} and as {second}; give it once"
        assert error.value.key == key


@pytest.mark.parametrize("mapping", [{"trainer": 1, "trainer.seed": 2}, {"trainer.seed": 2, "trainer": 1},
                                     {"trainer": {"seed": {"x": 1}}, "trainer.seed": 2}])
def test_a_value_where_a_section_is_given_names_both(mapping):
    with pytest.raises(ConfigError, match=r"config key 'trainer(\.seed)?' is given both as a value \(\[.+\]\) and "
                                          r"as a section \(\[.+\]\)") as error:
        make_config(mapping)
    assert error.value.key in ("trainer", "trainer.seed")


def test_different_keys_of_a_section_may_be_given_both_ways():
    cfg = make_config({"trainer": {"seed": 1}, "trainer.total_training_steps": 2,
                       "actor_rollout_ref.actor": {"optim": {"lr": 3e-5}},
                       "actor_rollout_ref.actor.optim.betas": [0.8, 0.9],
                       "data": {}, "data.seed": 4})
    assert (cfg.trainer.seed, cfg.trainer.total_training_steps, cfg.data.seed) == (1, 2, 4)
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-5 and list(cfg.actor_rollout_ref.actor.optim.betas) == [0.8, 0.9]
    assert flatten({"a": {"b": 1}, "a.c": 2}) == {"a.b": 1, "a.c": 2}


def test_separate_overrides_still_override_earlier_ones():
    cfg = make_config({LR: 1e-5}, {"actor_rollout_ref": {"actor": {"optim": {"lr": 3e-5}}}}, [f"{LR}=2e-5"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 2e-5
    assert make_config({"trainer": {"seed": 1}}, {"trainer.seed": 2}).trainer.seed == 2


def test_the_client_refuses_a_key_given_twice_before_sending():
    from opentinker import GenericEnvironment
    from opentinker.config import build_recipe

    twice = {LR: 1e-5, "actor_rollout_ref": {"actor": {"optim": {"lr": 3e-5}}}}
    with pytest.raises(ConfigError, match="config key 'actor_rollout_ref.actor.optim.lr' is given twice"):
        GenericEnvironment(twice, dataset=[{"prompt": [{"role": "user", "content": "1+1=?"}]}])
    with pytest.raises(ConfigError, match="config key 'actor_rollout_ref.actor.optim.lr' is given twice"):
        build_recipe(twice)
