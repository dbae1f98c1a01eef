"""Training under a plan where users already train: a Hugging Face ``TrainerCallback`` and a PyTorch Lightning
``Callback``. Each loads its framework only when its name is first used."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from udnn_lab.integrations._planned import PlannedSteps, StepReport

if TYPE_CHECKING:
    from udnn_lab.integrations._huggingface import HFPlanCallback as HFPlanCallback
    from udnn_lab.integrations._lightning import LightningPlanCallback as LightningPlanCallback

_FRAMEWORK_MODULES = {"HFPlanCallback": ("udnn_lab.integrations._huggingface", "transformers"),
                      "LightningPlanCallback": ("udnn_lab.integrations._lightning", "lightning")}

__all__ = ["HFPlanCallback", "LightningPlanCallback", "PlannedSteps", "StepReport"]


def __getattr__(name: str) -> Any:
    if name not in _FRAMEWORK_MODULES:
        raise AttributeError(f"module 'udnn_lab.integrations' has no attribute {name!r}")
    module, framework = _FRAMEWORK_MODULES[name]
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        if err.name != framework:
            raise
        raise ModuleNotFoundError(f"{name} needs {framework}: pip install {framework}", name=framework) from err


def __dir__() -> list[str]:
    return sorted(__all__)
