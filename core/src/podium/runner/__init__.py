"""The model runner, split by concept (see ``model_runner`` for the map and how TP/PP plug in)."""

from .deferred import LaunchedStep, launch
from .model_runner import ModelRunner, StepLogits
from .plan import StepPlan, plan_step
from .sampling import StepResult, prompt_logprobs, sample_now

__all__ = ["LaunchedStep", "ModelRunner", "StepLogits", "StepPlan", "StepResult", "launch", "plan_step",
           "prompt_logprobs", "sample_now"]
