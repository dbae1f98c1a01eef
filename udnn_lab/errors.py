"""Errors that say what was wrong and what to do about it."""

from __future__ import annotations


class UdnnLabError(Exception):
    """Base class of every error udnn_lab raises on purpose."""


class UnknownModelError(UdnnLabError, ValueError):
    """A zoo name that is not in the zoo."""


class ModelInputError(UdnnLabError, ValueError):
    """The example input does not fit the model."""


class FakeTensorUnsupported(UdnnLabError, RuntimeError):
    """An op of the model cannot run under fake tensors."""


class TraceMismatch(UdnnLabError, RuntimeError):
    """A measured run did not execute the same ops as the traced Graph."""


class MissingDependency(UdnnLabError, ImportError):
    """An optional package is needed for what was asked."""
