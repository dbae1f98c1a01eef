"""Errors that say what was wrong and what to do about it."""

from __future__ import annotations


class UdnnLabError(Exception):
    """Base class of every error udnn_lab raises on purpose."""


class UnknownModelError(UdnnLabError, ValueError):
    """A zoo name that is not in the zoo."""


class ModelFactoryError(UdnnLabError, RuntimeError):
    """A 'module.path:factory' that cannot be loaded, or whose factory raised (the cause is chained)."""


class ModelInputError(UdnnLabError, ValueError):
    """The example input does not fit the model."""


class FakeTensorUnsupported(UdnnLabError, RuntimeError):
    """An op of the model cannot run under fake tensors."""


class TraceMismatch(UdnnLabError, RuntimeError):
    """A measured run did not execute the same ops as the traced Graph."""


class MissingDependency(UdnnLabError, ImportError):
    """An optional package is needed for what was asked."""


class ReplayError(UdnnLabError, RuntimeError):
    """A recomputation could not reproduce forward."""


class PlanMismatch(UdnnLabError, RuntimeError):
    """The step run under the runtime is not the step the plan was made for."""


class HostMemoryError(UdnnLabError, MemoryError):
    """The plan needs more host memory than the pool may take."""


class PlanInfeasible(UdnnLabError, ValueError):
    """No plan of the policy fits the budget."""

    def __init__(self, message: str, minimum_bytes: int, fitting_policy: str | None) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.fitting_policy = fitting_policy


class SolverLimit(UdnnLabError, RuntimeError):
    """The exact planner's problem is too large to start, or its solver did not finish within the time limit."""


class BudgetTooSmall(UdnnLabError, ValueError):
    """A budget below what the model's weights alone take: no batch of it can fit."""

    def __init__(self, message: str, weights_bytes: int) -> None:
        super().__init__(message)
        self.weights_bytes = weights_bytes


class PlanError(UdnnLabError, ValueError):
    """A plan that breaks a rule, or that was made for another graph."""


class PlanForAnotherStep(PlanError, PlanMismatch):
    """A plan given with a step other than the one it was made for: a Graph (refused before anything runs) or the
    step a runtime is running (refused at its first difference). One check raises it for every consumer of a Plan
    (graph/plan_ir.py ``check_plan``); it is a PlanError and a PlanMismatch, so either catches it."""


class SnapshotError(UdnnLabError, ValueError):
    """A file that is not a memory snapshot, or one that asks to run code as it is read."""


class AllocatorModelError(UdnnLabError, ValueError):
    """An event sequence the allocator cannot replay (a double allocation, a free of an unknown block)."""


class AllocatorOutOfMemory(UdnnLabError, MemoryError):
    """A segment the capacity cannot hold, even after releasing every free cached segment."""


class ReportError(UdnnLabError, RuntimeError):
    """The report notebook failed while it ran."""


class HardwareProfileError(UdnnLabError, ValueError):
    """A hardware profile that cannot be found, read or trusted."""


class UnknownHardwareError(HardwareProfileError):
    """A profile name that is not among the shipped profiles."""


class HardwareMismatchWarning(UserWarning):
    """A profile made for one device is applied to another."""


class ShippedProfileWarning(UserWarning):
    """No profile measured on this machine could be had: a shipped one stands in (it is named)."""


class UnmeasuredFigureWarning(UserWarning):
    """A host probe could not measure its figures here: they stay unmeasured, and what they price is not priced."""


class PublishedDataError(UdnnLabError, ValueError):
    """A record of published measurements that is malformed, unsourced or inconsistent."""


class LargeMeasurementWarning(UserWarning):
    """A real measurement that will take long or hold much memory: said before it starts."""


class JobFailed(UdnnLabError, RuntimeError):
    """A job's worker reported an error, died, or stopped answering."""

    def __init__(self, job: str, message: str) -> None:
        super().__init__(f"{job}: {message}")
        self.job = job
        self.message = message


class RankFailed(UdnnLabError, RuntimeError):
    """A rank of a run over ranks raised, or its process died; every other rank was ended."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed, so every rank was ended:\n{detail}")
        self.rank = rank
        self.detail = detail


class CapBelowMinimum(UdnnLabError, ValueError):
    """A memory cap under the least a job can run with."""

    def __init__(self, message: str, job: str, cap_bytes: int, minimum_bytes: int) -> None:
        super().__init__(message)
        self.job, self.cap_bytes, self.minimum_bytes = job, cap_bytes, minimum_bytes


class BudgetOverDevice(UdnnLabError, ValueError):
    """A budget larger than the hardware profile's device memory: no plan can promise it."""

    def __init__(self, message: str, budget_bytes: int, memory_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes, self.memory_bytes = budget_bytes, memory_bytes


class HostBudgetExceeded(PlanInfeasible):
    """A plan that fits the device but whose offloads need more host memory than the host budget."""

    def __init__(self, message: str, peak_bytes: int, host_bytes: int, host_budget_bytes: int,
                 fitting_policy: str | None) -> None:
        super().__init__(message, peak_bytes, fitting_policy)
        self.peak_bytes, self.host_bytes, self.host_budget_bytes = peak_bytes, host_bytes, host_budget_bytes


class HostMemoryTooSmall(HostMemoryError):
    """A real try (inputs, tensors or pinned buffers built on this host) would need more host memory than it has."""

    def __init__(self, message: str, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes, self.available_bytes = needed_bytes, available_bytes
