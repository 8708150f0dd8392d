import pytest

from opentinker.config import ConfigError, check_limits, closest_key, make_config, parse_overrides, to_dotted


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
    with pytest.raises(ConfigError, match="'trainer.total_training_steps' must be >= 1 and <= 100000, got 0"):
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


def test_interpolation_is_refused_in_every_form(monkeypatch):
    monkeypatch.setenv("SECRET_FOR_TEST", "s3cret")
    for override in (["trainer.experiment_name=${oc.env:SECRET_FOR_TEST}"],
                     {"trainer": {"project_name": "${oc.env:SECRET_FOR_TEST}"}},
                     {"trainer.logger": ["console", "${trainer.project_name}"]}):
        with pytest.raises(ConfigError, match="interpolation is not supported") as error:
            make_config(override)
        assert "s3cret" not in str(error.value)


def test_every_key_has_a_doc_every_numeric_key_a_range_and_only_none_defaults_take_null():
    from opentinker.config import RANGES
    from opentinker.recipe import RecipeSpec
    from opentinker.recipe.knobs import knobs_of

    keys = list(knobs_of(RecipeSpec))
    assert len(keys) > 100
    assert all(info.knob.doc.strip() for info in keys)
    assert {info.key for info in keys if info.kind in (int, float)} - set(RANGES) == set()
    assert {info.key for info in keys if info.nullable} == {info.key for info in keys if info.default is None}


def test_choices_match_the_engine_registries_and_grow_with_them():
    from opentinker.config import CHOICES
    from opentinker.engine.algorithms import ADVANTAGE_ESTIMATORS, KL_KINDS, LOSS_AGG_MODES, POLICY_LOSSES
    from opentinker.engine.algorithms import register_policy_loss
    from opentinker.engine.data import BUILTIN_TASKS
    from opentinker.server.validation import TASK_ROW_CHECKS

    # Every registered name is a valid value (registering adds it); every built-in is registered.
    assert set(ADVANTAGE_ESTIMATORS) <= set(CHOICES["algorithm.adv_estimator"])
    assert set(POLICY_LOSSES) <= set(CHOICES["actor_rollout_ref.actor.policy_loss"])
    assert {"gae", "grpo", "grpo_weighted_add", "grpo_weighted_mul", "rloo", "reinforce_plus_plus",
            "reinforce_plus_plus_baseline"} <= set(ADVANTAGE_ESTIMATORS)
    assert {"vanilla", "gspo", "cispo"} <= set(POLICY_LOSSES)
    assert set(CHOICES["actor_rollout_ref.actor.kl_loss_type"]) == set(KL_KINDS)
    assert set(CHOICES["actor_rollout_ref.actor.loss_agg_mode"]) == set(LOSS_AGG_MODES)
    assert set(CHOICES["data.task"]) == set(BUILTIN_TASKS) == set(TASK_ROW_CHECKS)
    with pytest.raises(ConfigError, match="unknown value 'my_loss'"):
        make_config(["actor_rollout_ref.actor.policy_loss=my_loss"])
    register_policy_loss("my_loss")(lambda *args, **kwargs: None)
    try:
        assert make_config(["actor_rollout_ref.actor.policy_loss=my_loss"]).actor_rollout_ref.actor.policy_loss == "my_loss"
    finally:
        CHOICES["actor_rollout_ref.actor.policy_loss"].remove("my_loss")


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.model.path=5", "'actor_rollout_ref.model.path' expects str"),
        ("actor_rollout_ref.actor.clip_ratio=0", "'actor_rollout_ref.actor.clip_ratio' must be > 0 and <= 10"),
        ("actor_rollout_ref.actor.optim.betas=[0.9,1.5]", "betas' must be two numbers in [0, 1)"),
        ("trainer.logger=[console,wandbb]", "did you mean 'wandb'?"),
        ("trainer.experiment_name=" + "x" * 2000, "at most 1024 characters"),
    ],
)
def test_value_checks_name_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        make_config([override])
    assert message in str(error.value)


def test_operator_limits_replace_upper_bounds():
    assert make_config(["actor_rollout_ref.rollout.n=4"], limits={"actor_rollout_ref.rollout.n": 4})
    with pytest.raises(ConfigError, match="<= 4 \\(a limit of this server\\), got 8"):
        make_config([], limits={"actor_rollout_ref.rollout.n": 4})


def test_an_operator_turns_a_switch_off_with_a_limit_of_zero():
    key = "actor_rollout_ref.rollout.compile_decode"
    assert make_config([f"{key}=true"]).actor_rollout_ref.rollout.compile_decode is True
    assert make_config([f"{key}=true"], limits=check_limits({key: 1})).actor_rollout_ref.rollout.compile_decode
    off = check_limits({key: 0})
    assert make_config([f"{key}=false"], limits=off).actor_rollout_ref.rollout.compile_decode is False
    with pytest.raises(ConfigError, match=f"config key '{key}' is turned off on this server"):
        make_config([f"{key}=true"], limits=off)
    with pytest.raises(ConfigError, match="0 \\(off\\) or 1 \\(allowed\\), got 2"):
        check_limits({key: 2})


def test_the_key_reference_page_is_the_schemas_and_the_client_prints_it_without_torch(run_without_heavy_packages):
    from pathlib import Path

    from opentinker.recipe import reference

    page = Path(__file__).resolve().parent.parent / "docs" / "config_keys.md"
    assert page.read_text() == reference.markdown(), "regenerate: python -m opentinker.recipe.reference > docs/config_keys.md"
    assert "| `actor_rollout_ref.actor.optim.lr` | `1e-06` | float; >= 0 and <= 1 | AdamW learning rate |" in page.read_text()
    done = run_without_heavy_packages("""
        from opentinker.client.cli import main
        main(["config", "keys"])
    """)
    assert done.returncode == 0, done.stderr
    blocks = done.stdout.split("\nactor_rollout_ref.rollout.compile_decode = false\n")
    assert len(blocks) == 2 and blocks[1].startswith("    bool; operator switch\n")
