"""A reply read off the UI thread goes to the node that asked for it only: it does not bubble to a parent, which
may read other things (a results view holds tables that page their records in)."""

from __future__ import annotations

from textual import on
from textual.app import App, ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from gpuopt_tui.ui.loading import Loaded


class PartRead(Loaded):
    """A read of the child."""


class Parent(Vertical):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Loaded] = []

    @on(Loaded)
    def _any_reply(self, message: Loaded) -> None:
        self.seen.append(message)

    def compose(self) -> ComposeResult:
        yield Child()


class Child(Static):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Loaded] = []

    @on(PartRead)
    def _part_read(self, message: PartRead) -> None:
        self.seen.append(message)


async def test_a_reply_reaches_only_the_node_it_was_posted_to() -> None:
    class Host(App[None]):
        def compose(self) -> ComposeResult:
            yield Parent()

    app = Host()
    async with app.run_test() as pilot:
        child, parent = app.query_one(Child), app.query_one(Parent)
        child.post_message(PartRead(1, value="part"))
        child.post_message(Loaded(2))
        await pilot.pause()
        assert [m.value for m in child.seen] == ["part"]
        assert parent.seen == []
