import pytest

from opentinker.config import ConfigError, closest_key, make_config, parse_overrides, to_dotted


def test_dotted_overrides_parse_types_like_verl():
    cfg = make_config(
        [
            "algorithm.adv_estimator=rloo",
            "actor_rollout_ref.rollout.n=4",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.logger=[console,wandb]",
            "actor_rollout_ref.model.path=/models/qwen",
        ]
    )
    assert cfg.algorithm.adv_estimator == "rloo"
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-5)
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.actor_rollout_ref.model.path == "/models/qwen"
    # untouched keys keep their defaults
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2


def test_later_overrides_win_and_mappings_work():
    cfg = make_config({"data": {"train_batch_size": 16}}, ["data.train_batch_size=24"])
    assert cfg.data.train_batch_size == 24


@pytest.mark.parametrize(
    ("bad", "nearest"),
    [
        ("actor_rollout_ref.actor.optim.lrr=1e-5", "actor_rollout_ref.actor.optim.lr"),
        ("algorithm.adv_estimater=grpo", "algorithm.adv_estimator"),
        ("actor_rollout_ref.rollout.temprature=0.7", "actor_rollout_ref.rollout.temperature"),
        ("data.train_bach_size=8", "data.train_batch_size"),
    ],
)
def test_unknown_key_names_it_and_the_nearest_valid_key(bad, nearest):
    with pytest.raises(ConfigError) as error:
        make_config([bad])
    message = str(error.value)
    assert f"'{bad.split('=')[0]}'" in message
    assert f"'{nearest}'" in message


def test_unknown_key_in_a_mapping_is_rejected_too():
    with pytest.raises(ConfigError, match="unknown config key 'trainer.total_trainig_steps'"):
        make_config({"trainer": {"total_trainig_steps": 3}})


def test_section_given_as_value_is_explained():
    with pytest.raises(ConfigError, match="is a section"):
        parse_overrides(["actor_rollout_ref.actor=3"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="'data.train_batch_size' expects int"):
        make_config(["data.train_batch_size=eight"])


def test_grpo_with_one_sample_per_prompt_is_a_clear_error():
    with pytest.raises(ConfigError) as error:
        make_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"])
    assert "rollout.n >= 2" in str(error.value)
    # estimators that do not compare samples of a prompt accept n=1
    make_config(["algorithm.adv_estimator=reinforce_plus_plus", "actor_rollout_ref.rollout.n=1"])


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="multiple of"):
        make_config(["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError, match="must be > 0"):
        make_config(["trainer.total_training_steps=0"])
    with pytest.raises(ConfigError, match="top_p"):
        make_config(["actor_rollout_ref.rollout.top_p=0"])


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        make_config(["algorithm.adv_estimator"])


def test_to_dotted_round_trip():
    cfg = make_config(["actor_rollout_ref.rollout.n=3"])
    flat = to_dotted(cfg)
    assert flat["actor_rollout_ref.rollout.n"] == 3
    assert make_config([f"{k}={v}" for k, v in flat.items() if v is not None and not isinstance(v, list)]) == cfg


def test_closest_key_for_a_misplaced_leaf():
    assert closest_key("trainer.kl_loss_coef") == "actor_rollout_ref.actor.kl_loss_coef"


def test_mappings_may_use_dotted_keys():
    cfg = make_config({"actor_rollout_ref.rollout.n": 4, "data": {"train_batch_size": 16}, "trainer.seed": 3})
    assert cfg.actor_rollout_ref.rollout.n == 4 and cfg.data.train_batch_size == 16 and cfg.trainer.seed == 3
    with pytest.raises(ConfigError, match="did you mean 'actor_rollout_ref.rollout.n'"):
        make_config({"actor_rollout_ref.rollout.nn": 4})
