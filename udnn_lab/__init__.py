"""udnn_lab: how much GPU memory each step of training needs, where it goes, and how to make it fit."""

from udnn_lab.errors import (
    FakeTensorUnsupported,
    MissingDependency,
    ModelInputError,
    TraceMismatch,
    UdnnLabError,
    UnknownModelError,
)
from udnn_lab import zoo
from udnn_lab.graph import Graph
from udnn_lab.measure import Measurement, measure
from udnn_lab.trace import trace
from udnn_lab.units import format_bytes, format_seconds, parse_bytes
from udnn_lab.workload import Workload

__version__ = "0.1.0"
