"""Partial screen updates that send the terminal only the cells a widget marked as changed.

Textual repaints the regions a widget refreshes, but writes each line of a region from the left edge of the
widget it belongs to, not from the region's start (Textual issue #5625): a figure at the right end of a GPU
line resends the whole line. A live monitor over SSH repaints a few figures a second, so the GPU screens crop
their partial updates to the region's start as well. Full updates (a new screen, a resize) are unchanged.

This leans on Textual internals (its compositor and ChopsUpdate's fields, through ui/textual_internals.py); where
they are not as expected the screen keeps Textual's own updates (tests/ui/test_cell_lines.py checks which one
runs).
"""

from __future__ import annotations

from rich.console import Console
from rich.control import Control
from textual.screen import Screen

from gpuopt_tui.ui.textual_internals import ChopsUpdate, Compositor, replace_compositor


class CroppedChopsUpdate(ChopsUpdate):
    """A partial update whose line pieces start where their changed region starts."""

    def render_segments(self, console: Console) -> str:
        out: list[str] = []
        last_y = self.spans[-1][0]
        for y, x1, x2 in self.spans:
            for end, (x, strip) in zip(self.chop_ends[y], self.chops[y].items()):
                if strip is None or x > x2 or end <= x1:
                    continue
                start = max(x, x1)
                out.append(Control.move_to(start, y).segment.text)
                out.append(strip.crop(start - x, min(end, x2) - x).render(console))
            if y != last_y:
                out.append("\n")
        return "".join(out)


class CroppingCompositor(Compositor):
    def render_partial_update(self) -> ChopsUpdate | None:
        update = super().render_partial_update()
        return None if update is None else CroppedChopsUpdate(update.chops, update.spans, update.chop_ends)


def crop_partial_updates(screen: Screen) -> bool:
    """Make `screen` (not yet mounted) send only the changed cells of its partial updates; False where this
    Textual does not have the internals it needs (the screen then sends whole line pieces)."""
    return hasattr(ChopsUpdate, "render_segments") and replace_compositor(screen, CroppingCompositor)
