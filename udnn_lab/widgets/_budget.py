"""MemoryLab's budget: a slider and a box to type a size in, over one number of bytes.

The slider's grid is a thousandth of the step's peak, and a browser's slider moves any
value it is given onto its grid. So the budget is exact where it matters: the slider
stands on the grid point nearest a budget that was typed (or kept across a change of
the step), and while it stays within half a grid step of that budget or of the peak, the
budget is that one, to the byte. A budget the user sees as the peak plans as the peak,
however the slider or a rounded figure typed back lands. The box reads sizes as
``units.parse_bytes`` does ("6 GiB", "1500 MiB", bytes) and shows them as
``units.format_bytes`` writes every size in the app.
"""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as widgets

from udnn_lab.units import format_bytes, parse_bytes

MIB = 2**20
GRID = 1000  # slider steps from 0 to the peak
ABOVE_PEAK = 1.1  # the slider reaches this far past the peak


class BudgetControl:
    """The budget's slider (MiB, no label of its own) and entry; ``changed`` is called when the user moves either."""

    def __init__(self, changed: Callable[[], None], report: Callable[[Exception], None], width: str) -> None:
        self.changed, self.report = changed, report
        self.entry = widgets.Text(description="budget", continuous_update=False, placeholder="e.g. 6 GiB",
                                  tooltip="type a size (6 GiB, 1500 MiB, or bytes) and press Enter",
                                  layout=widgets.Layout(width=width))
        self.slider = widgets.FloatSlider(value=1.0, min=0.0, max=1.0, step=1.0, readout=False,
                                          continuous_update=True, layout=widgets.Layout(width=width))
        self.peak_bytes = 0
        self._typed: int | None = None  # a budget given in bytes, exact while the slider stands next to it
        self._quiet = False
        self.slider.observe(self._on_slider, names="value")
        self.entry.observe(self._on_entry, names="value")

    @property
    def nbytes(self) -> int:
        """The budget in bytes: the typed budget or the peak while the slider is within half a step of it."""
        nbytes = int(round(self.slider.value * MIB))
        for exact in (self._typed, self.peak_bytes):
            if exact and abs(nbytes - exact) <= self.slider.step * MIB / 2:
                return exact
        return nbytes

    def _on_grid(self, nbytes: int) -> float:
        """The slider's value nearest ``nbytes``, on its grid."""
        return min(round(nbytes / MIB / self.slider.step) * self.slider.step, self.slider.max)

    def rescale(self, peak_bytes: int, capacity_bytes: int, reset: bool) -> None:
        """Fit the slider to a step whose peak is ``peak_bytes``.

        ``reset``: start at the peak (at most the device's capacity). Otherwise a budget
        that was at the old peak follows the peak, and any other stays where the user put
        it, clamped to the new range.
        """
        before, at_peak = self.nbytes, self.peak_bytes and self.nbytes == self.peak_bytes
        step = peak_bytes / MIB / GRID if peak_bytes else 1.0
        top = step * GRID * ABOVE_PEAK
        wanted = min(peak_bytes, capacity_bytes) if reset or at_peak or not self.peak_bytes else before
        wanted = min(wanted, int(round(top * MIB)))
        self._quiet = True
        try:
            self.slider.max = max(self.slider.max, top)  # never below min or value while they move
            self.slider.min = 0.0
            self.slider.step = step
            self.peak_bytes, self._typed = peak_bytes, wanted
            self.slider.value = self._on_grid(wanted)
            self.slider.max = top
        finally:
            self._quiet = False
        self._show()

    def _on_slider(self, _change) -> None:
        self._show()
        if not self._quiet:
            self.changed()

    def _on_entry(self, change) -> None:
        if self._quiet or change.new.strip() == format_bytes(self.nbytes):
            return
        try:
            nbytes = parse_bytes(change.new)
        except (TypeError, ValueError) as error:
            self.report(error)
            self._show()
            return
        if nbytes / MIB > self.slider.max:
            self.slider.max = nbytes / MIB
        self._typed = nbytes
        value = self._on_grid(nbytes)
        if value == self.slider.value:  # the slider does not move: say so and replan here
            self._show()
            self.changed()
        else:
            self.slider.value = value  # the slider's observer replans

    def _show(self) -> None:
        self._quiet, before = True, self._quiet
        try:
            self.entry.value = format_bytes(self.nbytes)
        finally:
            self._quiet = before
