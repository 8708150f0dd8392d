"""The bf16 copies of a model's linear weights, made once per weight change rather than once per micro-batch.

Under ``torch.autocast`` every linear layer casts its fp32 weight (and bias) to bf16 on each
call, and autocast's own cache of those casts lasts one autocast region: here one micro-batch's
forward (the backward runs outside it, as autocast asks). An update of 4 micro-batches cast
every weight 4 times, and the forward-only passes (old and reference logprobs) once per
micro-batch too: on the Qwen2.5-0.5B shape, 26 ms of copies per micro-batch in an H100 profile.

:class:`CastWeights` keeps those bf16 copies until the weight changes (each tensor's version
counter moves with every in-place write: an optimizer step, a loaded checkpoint) or the grad
mode does, and runs the model on them (``torch.func.functional_call``). A copy made with grad
enabled is a differentiable cast of the fp32 weight, so every micro-batch's gradient flows back
through it and accumulates in the fp32 ``.grad`` as before. Under autocast a linear layer given
a bf16 weight casts only its input: the same kernels and the same numbers as autocast's own
casts (``tests/engine/test_weight_casts.py``: bit for bit). Only the weights of linear layers
are cast, and not one tied to another module (an embedding that is also the LM head keeps its
fp32 lookup), so what autocast leaves in fp32 stays so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call


def _linear_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Floating-point parameters owned by ``nn.Linear`` modules only (a tied one is left out)."""
    elsewhere = {id(p) for module in model.modules() if not isinstance(module, torch.nn.Linear)
                 for p in module.parameters(recurse=False)}
    found: dict[str, torch.nn.Parameter] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            for name, parameter in module.named_parameters(recurse=False):
                if parameter.is_floating_point() and id(parameter) not in elsewhere:
                    found[f"{module_name}.{name}" if module_name else name] = parameter
    return found


class CastWeights:
    """``CastWeights(model)(**inputs)``: ``model(**inputs)`` on cached bf16 copies of its linear
    weights (see the module docstring). Attribute reads go to the model (``config``, ...)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.model, self.dtype = model, dtype
        self._parameters = _linear_parameters(model)
        # name -> (the weight's version, whether the copy carries a gradient, the copy)
        self._copies: dict[str, tuple[int, bool, torch.Tensor]] = {}

    def copies(self) -> dict[str, torch.Tensor]:
        """The bf16 copy of each linear weight, recast where the weight or the grad mode changed."""
        with_grad = torch.is_grad_enabled()
        out = {}
        for name, parameter in self._parameters.items():
            wants_grad = with_grad and parameter.requires_grad
            cached = self._copies.get(name)
            if cached is None or cached[0] != parameter._version or cached[1] != wants_grad:
                cached = (parameter._version, wants_grad, parameter.to(self.dtype))
                self._copies[name] = cached
            out[name] = cached[2]
        return out

    def clear(self) -> None:
        """Drops every copy (their memory: a bf16 image of the linear weights)."""
        self._copies.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.model, self.copies(), args, kwargs, strict=False, tie_weights=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
