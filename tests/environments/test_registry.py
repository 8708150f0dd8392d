"""Interaction specs, the class-path allowlist, and picking an interaction per dataset row."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest
from pydantic import ValidationError

from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.endpoints import EndpointError, EndpointPolicy
from opentinker.environments.interaction import Interaction, InteractionContext
from opentinker.environments.registry import (
    InteractionRegistry,
    InteractionSpec,
    UnknownInteractionError,
    default_registry,
    select_interaction,
)
from opentinker.environments.text_interactions import Gsm8kInteraction, SimpleTextEnvironment

GYM_PATH = "opentinker.environments.gym_interaction.GymEnvironmentInteraction"
SIMPLE_PATH = "opentinker.environments.text_interactions.SimpleTextEnvironment"
GSM8K_PATH = "opentinker.environments.text_interactions.Gsm8kInteraction"


@pytest.fixture
def temp_module(tmp_path, monkeypatch):
    """``temp_module(source) -> (module name, marker path)``: a fresh module on sys.path
    whose import writes a marker file, so an import is visible."""

    def make(source: str = "") -> tuple[str, object]:
        name = f"ot_tmp_{uuid.uuid4().hex[:12]}"
        marker = tmp_path / f"{name}.imported"
        header = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        (tmp_path / f"{name}.py").write_text(header + textwrap.dedent(source))
        return name, marker

    monkeypatch.syspath_prepend(str(tmp_path))
    return make


# InteractionSpec -------------------------------------------------------------------------


def test_spec_validation_names_the_field():
    spec = InteractionSpec(name="gsm8k", class_path="gsm8k")
    assert spec.config == {}
    with pytest.raises(ValidationError) as err:
        InteractionSpec(name="x")  # type: ignore[call-arg]
    assert "class_path" in str(err.value)
    with pytest.raises(ValidationError) as err:
        InteractionSpec(name="  ", class_path="gym")
    assert "name" in str(err.value)
    with pytest.raises(ValidationError) as err:
        InteractionSpec(name="x", class_path="gym", config=[1])  # type: ignore[arg-type]
    assert "config" in str(err.value)
    with pytest.raises(ValidationError) as err:
        InteractionSpec(name="x", class_path="gym", extra=1)  # type: ignore[call-arg]
    assert "extra" in str(err.value)


def test_spec_accepts_verl_class_name_and_round_trips_json():
    spec = InteractionSpec.model_validate({"name": "g", "class_name": "gsm8k", "config": {"max_turns": 2}})
    assert spec.class_path == "gsm8k"
    again = InteractionSpec.model_validate_json(spec.model_dump_json())
    assert again == spec


# Resolving class paths -------------------------------------------------------------------


def test_builtins_resolve_by_path_and_alias():
    registry = default_registry()
    assert registry.resolve(GYM_PATH) is GymEnvironmentInteraction
    assert registry.resolve("gym") is GymEnvironmentInteraction
    assert registry.resolve(SIMPLE_PATH) is SimpleTextEnvironment
    assert registry.resolve("simple_text") is SimpleTextEnvironment
    assert registry.resolve(GSM8K_PATH) is Gsm8kInteraction
    assert registry.resolve("gsm8k") is Gsm8kInteraction
    # verl's / OpenTinker's spellings of the same classes
    assert registry.resolve("verl.interactions.gsm8k_interaction.Gsm8kInteraction") is Gsm8kInteraction
    assert (
        registry.resolve("verl.interactions.gym_environment_interaction.GymEnvironmentInteraction")
        is GymEnvironmentInteraction
    )


def test_unknown_path_error_lists_allowed_paths():
    registry = default_registry()
    with pytest.raises(UnknownInteractionError) as err:
        registry.resolve("my.pkg.Env")
    message = str(err.value)
    assert "my.pkg.Env" in message
    for path in (GYM_PATH, SIMPLE_PATH, GSM8K_PATH, "gym", "gsm8k", "simple_text"):
        assert path in message
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("path", ["os.system", "subprocess.Popen", "builtins.eval", "os", ""])
def test_dangerous_paths_are_rejected(path):
    with pytest.raises(UnknownInteractionError):
        default_registry().resolve(path)


def test_client_paths_are_never_imported(temp_module):
    name, marker = temp_module(
        """
        from opentinker.environments.interaction import Interaction

        class Sneaky(Interaction):
            async def generate_response(self, instance_id, messages, **kwargs):
                return True, "", 0.0, {}
        """
    )
    registry = default_registry()
    with pytest.raises(UnknownInteractionError):
        registry.resolve(f"{name}.Sneaky")
    with pytest.raises(UnknownInteractionError):
        registry.build([InteractionSpec(name="x", class_path=f"{name}.Sneaky")])
    # a spec with an unknown path fails the whole build before anything is made
    with pytest.raises(UnknownInteractionError):
        registry.build([{"name": "ok", "class_path": "gsm8k"}, {"name": "x", "class_path": f"{name}.Sneaky"}])
    assert name not in sys.modules
    assert not marker.exists()


def test_allowlist_imports_a_real_subclass(temp_module):
    name, marker = temp_module(
        """
        from opentinker.environments.interaction import Interaction

        class Custom(Interaction):
            async def generate_response(self, instance_id, messages, **kwargs):
                return True, "custom", float(self.config.get("reward", 0.0)), {}
        """
    )
    registry = default_registry(allowed=[f"{name}.Custom"])
    assert not marker.exists()  # allowing does not import
    assert f"{name}.Custom" in registry.allowed_paths()
    cls = registry.resolve(f"{name}.Custom")
    assert marker.exists()
    assert issubclass(cls, Interaction) and cls.__name__ == "Custom"
    assert registry.resolve(f"{name}.Custom") is cls  # cached
    built = registry.build([InteractionSpec(name="mine", class_path=f"{name}.Custom", config={"reward": 0.5})])
    assert isinstance(built["mine"], cls) and built["mine"].name == "mine"
    # other registries are unaffected
    with pytest.raises(UnknownInteractionError):
        default_registry().resolve(f"{name}.Custom")


def test_allowlist_rejects_non_subclasses_and_bad_paths(temp_module):
    name, _ = temp_module(
        """
        class NotAnInteraction:
            pass

        def factory():
            return None
        """
    )
    registry = InteractionRegistry()
    registry.allow(f"{name}.NotAnInteraction")
    registry.allow(f"{name}.factory")
    registry.allow(f"{name}.Missing")
    registry.allow("no_such_module_xyz.Env")
    with pytest.raises(TypeError, match="not a subclass"):
        registry.resolve(f"{name}.NotAnInteraction")
    with pytest.raises(TypeError, match="not a subclass"):
        registry.resolve(f"{name}.factory")
    with pytest.raises(UnknownInteractionError, match="Missing"):
        registry.resolve(f"{name}.Missing")
    with pytest.raises(UnknownInteractionError, match="cannot import"):
        registry.resolve("no_such_module_xyz.Env")
    for bad in ("", "os", "os.", "a b.C", "1x.Y"):
        with pytest.raises(ValueError):
            registry.allow(bad)
    with pytest.raises(TypeError):
        registry.register("thing", object)  # type: ignore[arg-type]


def test_register_custom_class():
    class Local(Interaction):
        async def generate_response(self, instance_id, messages, **kwargs):
            return True, "", 0.0, {}

    registry = default_registry()
    registry.register("local", Local)
    assert registry.resolve("local") is Local
    assert "local" in registry and "nope" not in registry


def test_build_instantiates_with_names_and_rejects_duplicates():
    registry = default_registry()
    built = registry.build(
        [
            InteractionSpec(name="math", class_path="gsm8k", config={"max_turns": 2}),
            {"name": "quiz", "class_path": SIMPLE_PATH, "config": {"scorer": "contains"}},
            InteractionSpec(name="game", class_path="gym", config={"env_endpoint": "http://127.0.0.1:9"}),
        ]
    )
    assert set(built) == {"math", "quiz", "game"}
    assert isinstance(built["math"], Gsm8kInteraction) and built["math"].max_turns == 2
    assert built["quiz"].name == "quiz" and built["quiz"].scorer_name == "contains"
    assert isinstance(built["game"], GymEnvironmentInteraction)
    with pytest.raises(ValueError, match="duplicate"):
        registry.build([InteractionSpec(name="a", class_path="gsm8k"), InteractionSpec(name="a", class_path="gym")])
    assert registry.build([]) == {}


def test_build_applies_the_operators_context_through_create():
    policy = EndpointPolicy.from_strings(["127.0.0.1:8000"])
    context = InteractionContext(job_id="job-42", endpoint_policy=policy, max_env_shards=2)
    registry = default_registry()
    built = registry.build(
        [InteractionSpec(name="game", class_path="gym",
                         config={"env_endpoint": "http://127.0.0.1:8000", "job_id": "chosen-by-client"}),
         InteractionSpec(name="quiz", class_path="simple_text")],
        context,
    )
    assert built["game"].job_id == "job-42" and built["game"].shards == ["http://127.0.0.1:8000"]
    assert isinstance(built["quiz"], SimpleTextEnvironment)  # the default create() ignores the context
    with pytest.raises(EndpointError, match="^env_endpoint http://127.0.0.1:9 is not allowed"):
        registry.build([InteractionSpec(name="game", class_path="gym", config={"env_endpoint": "http://127.0.0.1:9"})],
                       context)
    with pytest.raises(ValueError, match="^env_shards: at most 2"):
        registry.build([InteractionSpec(name="game", class_path="gym",
                                        config={"env_endpoint": "http://127.0.0.1:8000", "env_shards": 3})], context)
    # without a context (trusted in-process use) there is no policy
    trusted = registry.build([InteractionSpec(name="game", class_path="gym", config={"env_endpoint": "http://127.0.0.1:9"})])
    assert trusted["game"].shards == ["http://127.0.0.1:9"] and trusted["game"].job_id is None


def test_build_hands_the_context_to_a_custom_create():
    seen = []

    class ContextAware(Interaction):
        @classmethod
        def create(cls, config, context=None):
            seen.append((config, context))
            return cls(config)

        async def generate_response(self, instance_id, messages, **kwargs):
            return True, "", 0.0, {}

    registry = InteractionRegistry()
    registry.register("aware", ContextAware)
    context = InteractionContext(job_id="j")
    built = registry.build([InteractionSpec(name="a", class_path="aware", config={"k": 1})], context)
    assert isinstance(built["a"], ContextAware)
    assert seen == [({"k": 1, "name": "a"}, context)]


def test_thin_client_import_stays_light():
    code = (
        "import sys; import opentinker.environments.registry, opentinker.environments.gym_interaction; "
        "heavy = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# select_interaction ------------------------------------------------------------------------


@pytest.fixture
def interactions():
    return default_registry().build(
        [InteractionSpec(name="gsm8k", class_path="gsm8k"), InteractionSpec(name="quiz", class_path="simple_text")]
    )


def row(**kwargs):
    return {"prompt": [{"role": "user", "content": "q"}], "extra_info": {"interaction_kwargs": kwargs}}


def test_select_by_name(interactions):
    chosen, kwargs = select_interaction(row(name="quiz", ground_truth="x", seed=3), interactions)
    assert chosen is interactions["quiz"]
    assert kwargs == {"ground_truth": "x", "seed": 3}


def test_select_unknown_name_lists_known(interactions):
    with pytest.raises(UnknownInteractionError) as err:
        select_interaction(row(name="chess"), interactions)
    assert "chess" in str(err.value) and "gsm8k" in str(err.value) and "quiz" in str(err.value)


def test_select_without_name(interactions):
    chosen, kwargs = select_interaction(row(ground_truth="1"), interactions, default="gsm8k")
    assert chosen is interactions["gsm8k"] and kwargs == {"ground_truth": "1"}
    with pytest.raises(ValueError, match="no default"):
        select_interaction(row(ground_truth="1"), interactions)
    with pytest.raises(UnknownInteractionError, match="known"):
        select_interaction(row(), interactions, default="chess")
    only = {"gsm8k": interactions["gsm8k"]}
    assert select_interaction({"prompt": []}, only) == (interactions["gsm8k"], {})
    assert select_interaction({"extra_info": None}, only) == (interactions["gsm8k"], {})
    with pytest.raises(ValueError, match="no interactions"):
        select_interaction(row(), {})
    with pytest.raises(ValueError, match="interaction_kwargs"):
        select_interaction({"extra_info": {"interaction_kwargs": "gsm8k"}}, only)
