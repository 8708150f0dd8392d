"""RL algorithms as pure tensor functions behind name registries.

Conventions shared by every function here:

- Per-token tensors are ``[batch, response_len]``.
- ``response_mask`` (bool or float, used as float): 1 = a token the model generated, 0 =
  padding or an environment token. Masks may have holes (environment turns in the middle
  of a multi-turn response).
- Functions are pure: no hidden state, inputs are never modified.
- Unknown names (estimator, loss, KL kind, aggregation mode) raise ``ValueError`` naming
  the bad value, the closest valid one and all valid ones.

Modules: :mod:`.masked` (masked reductions), :mod:`.advantages` (advantage estimators),
:mod:`.policy_losses`, :mod:`.kl`, :mod:`.aggregation` (``agg_loss``), :mod:`.entropy`,
:mod:`.value_loss`, :mod:`.registry`.
"""

from opentinker.engine.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimatorFn,
    get_advantage_estimator,
    register_advantage_estimator,
)
from opentinker.engine.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from opentinker.engine.algorithms.entropy import entropy_from_logits
from opentinker.engine.algorithms.kl import KL_KINDS, kl_penalty
from opentinker.engine.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from opentinker.engine.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLossFn,
    PolicyTokenLossFn,
    get_policy_loss,
    policy_token_losses,
    register_policy_loss,
)
from opentinker.engine.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageEstimatorFn",
    "PolicyLossFn",
    "PolicyTokenLossFn",
    "agg_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "policy_token_losses",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_advantage_estimator",
    "register_policy_loss",
]
