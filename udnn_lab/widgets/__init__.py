"""MemoryLab: the widget app (ipywidgets) over every stage, with charts updated in place.

May import every stage and the charts; nothing but notebooks imports it.
"""

from udnn_lab.widgets.app import MemoryLab

__all__ = ["MemoryLab"]
