"""The training recipe: its schema (``components``: every key with its default, doc and checks),
its root (``spec.RecipeSpec``) and the rules across keys (``rules``). The dotted-key wire format
(parsing overrides, checking values, operator limits) is ``opentinker.config``, read off this
schema. No torch."""

from opentinker.recipe.knobs import ConfigError
from opentinker.recipe.rules import cross_field_problem
from opentinker.recipe.spec import RecipeSpec, spec_keys

__all__ = ["ConfigError", "RecipeSpec", "cross_field_problem", "spec_keys"]
