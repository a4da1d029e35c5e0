"""The planner's plan tabs (a TabSwitch): a click on a title or left/right on the focused titles shows that pane."""

from __future__ import annotations

from gpuopt_tui.app import make_app
from gpuopt_tui.ui.widgets.tab_switch import TabSwitch, TabTitles

from .conftest import screen_text, settle


async def test_plan_tabs_switch_by_mouse_and_keyboard() -> None:
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        tabs = app.screen.query_one("#plan-tabs", TabSwitch)
        closed, measured = (app.screen.query_one(f"#plan-{name}") for name in ("closed", "measured"))
        assert tabs.active == "plan-closed" and closed.display and not measured.display
        assert "Closed-form estimate" in screen_text(app) and "No measurement yet" not in screen_text(app)
        titles = tabs.query_one(TabTitles)
        offset = len(" Closed-form estimate ") + 2 + len(" Traced ") + 2 + 2  # inside " Measured ", after the gaps
        await pilot.click(titles, offset=(offset, 0))
        await pilot.pause()
        assert tabs.active == "plan-measured" and measured.display and not closed.display
        assert "No measurement yet" in screen_text(app)
        await pilot.click(titles, offset=(len(" Closed-form estimate "), 0))  # in the gap: nothing changes
        assert tabs.active == "plan-measured"
        titles.focus()
        await pilot.press("right")  # round to the first
        assert tabs.active == "plan-closed"
        await pilot.press("left")
        assert tabs.active == "plan-measured"
        await pilot.press("left")
        assert tabs.active == "plan-traced"
