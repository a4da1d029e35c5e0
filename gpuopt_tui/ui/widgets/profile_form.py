"""A profile as one property table (key | value | where the value comes from, or what is wrong with it), rows
grouped by section, and one editor for the key under the cursor.

A widget per key made a form of 60 keys about 250 widgets, and Textual restyles every widget of a screen each
time the screen is shown: seconds per switch on a small machine. Here the form is a table and a few editors,
whatever the number of keys.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar, Literal, cast

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.events import Resize
from textual.message import Message
from textual.widgets import Checkbox, DataTable, Input, Label, Static

from gpuopt_tui.core.errors import ProfileError
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.schema import FieldInfo, describe, get_path, to_plain
from gpuopt_tui.ui.widgets.choice_field import BLANK, ChoiceField
from gpuopt_tui.ui.widgets.keyed_table import KeyedTable
from gpuopt_tui.ui.widgets.profile_values import (
    FORM_SOURCE,
    build,
    field_error,
    field_text,
    parse_field,
    range_text,
    row_key,
    select_options,
    set_path,
)

FORM_HINT = "↑↓ choose a key · enter edits it (toggles a true/false) · enter or escape back to the table"
SECTION = "section:"  # row keys of section titles
# Longer values and messages are cut in the table, to fit the form's width (the editor and the error line below the
# table show them whole): the value column narrows first, down to MIN_VALUE_WIDTH, then where each value comes from
# is a short tag (e.g. the planner's form, beside a wide plan).
VALUE_WIDTH = 24
MIN_VALUE_WIDTH = 10
NOTE_WIDTH = 7  # "default", "profile"
SHORT_NOTES = {"default": "dflt", "profile": "file", "edited": "edit"}
TABLE_CHROME = 2 + 3 * 2  # the vertical scrollbar, and a cell's padding on either side in each column
Editor = Literal["text", "choice", "toggle"]


def editor_kind(info: FieldInfo) -> Editor:
    if info.type_name == "bool" and not info.auto:
        return "toggle"
    if info.choices or info.type_name == "bool":
        return "choice"  # a `bool | "auto"` key too: a toggle cannot show "auto"
    return "text"


def cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def fitted_widths(width: int, key_width: int) -> tuple[int, int]:
    """(value, note) column widths for a table `width` columns wide whose key column takes `key_width`; a note
    narrower than NOTE_WIDTH is a short tag."""
    room = width - TABLE_CHROME - key_width
    if room - NOTE_WIDTH >= MIN_VALUE_WIDTH:
        value = min(VALUE_WIDTH, room - NOTE_WIDTH)
        return value, room - value
    short = max(len(tag) for tag in SHORT_NOTES.values())
    return max(MIN_VALUE_WIDTH, room - short), short


def section_of(key: str) -> str:
    return key.split(".")[0] if "." in key else ""


class ProfileForm(Vertical):
    """Edits a profile of one kind. `values()` returns the nested data; `profile(source)` validates it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "move(-1)", "Previous key", show=False),
        Binding("down", "move(1)", "Next key", show=False),
    ]

    class Changed(Message):
        """A value changed; `dirty`: the form differs from what was loaded."""

        def __init__(self, form: ProfileForm, dirty: bool) -> None:
            super().__init__()
            self.form = form
            self.dirty = dirty

    def __init__(self, cls: type[ProfileBase], *, id: str | None = None) -> None:
        super().__init__(id=id, classes="profile-form")
        self.cls = cls
        self.infos = {info.key: info for info in describe(cls)}
        self._sections = {f.name: f.metadata.get("help", "") for f in fields(cls)}
        self._values: dict[str, Any] = {key: info.default for key, info in self.infos.items()}
        self._texts: dict[str, str] = {k: field_text(i, i.default) for k, i in self.infos.items()}  # as typed
        self._loaded: dict[str, Any] = dict(self._values)
        self._in_file: frozenset[str] = frozenset()  # the keys the loaded profile's file sets
        self._own_errors: dict[str, str] = {}  # each key checked on its own
        self.errors: dict[str, str] = {}  # what is shown, by key
        self.current: str | None = None  # the key in the editor
        self._key_width = max(len("  " + key.rsplit(".", 1)[-1]) for key in self.infos)
        # of the value and note columns (fitted_widths); the rows are drawn once the form's width is known, or the
        # width it will have (expect_width): a table drawn at other widths would be drawn twice on the screen's first
        # showing, and one drawn only on the form's first resize comes after a first paint of an empty form
        self._widths: tuple[int, int] | None = None
        # and once a profile is loaded (or show_defaults says there is none to load): the defaults drawn before would
        # be drawn again at once with the profile's values (a profile is read in a thread)
        self._ready = False

    def compose(self) -> ComposeResult:
        yield KeyedTable(("key", "value", "from"), id="form-table", classes="form-fields")
        with Horizontal(id="form-editor"):
            yield Label("", id="editor-key")
            text = Input(id="editor-text", compact=True)
            text.cursor_blink = False  # a blinking cursor redraws twice a second: bytes over SSH for nothing
            yield text
        # the choice and toggle editors and the error line are mounted the first time they are needed (a form opens
        # on a text key, without errors; each widget costs time on the screen's first showing)
        yield Static(FORM_HINT, classes="form-help", markup=False)

    def on_mount(self) -> None:
        self._show_rows()
        self._show_key(next(iter(self.infos)))

    def expect_width(self, width: int) -> None:
        """The width the form will have once laid out (from its screen's layout, before it is laid out): the rows
        are drawn at that width, in the screen's first paint; the form's first resize draws them again only if the
        width it gets fits other column widths."""
        if self._widths is None:
            self._widths = fitted_widths(width, self._key_width)
            self._show_rows()

    def on_resize(self, event: Resize) -> None:
        widths = fitted_widths(event.size.width, self._key_width)
        if widths != self._widths:
            self._widths = widths
            self._show_rows(relayout=True)

    @property
    def table(self) -> KeyedTable:
        return self.query_one("#form-table", KeyedTable)

    # -- values -------------------------------------------------------------------------------------------------

    def load(self, profile: ProfileBase, keys_in_file: frozenset[str] = frozenset()) -> None:
        """Show `profile`'s values; `keys_in_file`: the keys its file sets (shown as from the profile, also where
        a value equals its default)."""
        self._in_file = keys_in_file
        plain = to_plain(profile)
        for key, info in self.infos.items():
            value = get_path(plain, key)
            self._values[key] = value
            self._texts[key] = field_text(info, value)
        self._loaded = dict(self._values)
        self._ready = True
        current, self.current = self.current, None
        self._show_key(current or next(iter(self.infos)))  # the editor shows the loaded value
        self.validate()

    def show_defaults(self) -> None:
        """Draw the rows without a profile loaded (none could be read): each key's default."""
        if not self._ready:
            self._ready = True
            self._show_rows()

    def values(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, value in self._values.items():
            set_path(data, key, value)
        return data

    @property
    def dirty(self) -> bool:
        return self._values != self._loaded

    def profile(self, source: str) -> ProfileBase:
        """The form as a validated profile; raises ProfileError (and marks the key) when it does not validate."""
        try:
            return build(self.cls, self.values(), source)
        except ProfileError as e:
            self.show_error(e.key, e.detail)
            raise

    def _set(self, key: str, value: Any) -> None:
        self._values[key] = value
        self.validate(key)
        self.post_message(self.Changed(self, self.dirty))

    # -- validation ---------------------------------------------------------------------------------------------

    def validate(self, changed: str | None = None) -> bool:
        """Check each key on its own (only `changed` when given), then the rules between keys. A whole form that
        validates has no key in error: checking every key on its own (a profile built per key) is left out then."""
        between: dict[str, str] = {}
        if changed is None and self._builds():
            self._own_errors = dict.fromkeys(self.infos, "")
        else:
            for key in [changed] if changed else self.infos:
                self._own_errors[key] = field_error(self.cls, key, self._values[key])
            if not any(self._own_errors.values()):
                try:
                    build(self.cls, self.values(), FORM_SOURCE)
                except ProfileError as e:
                    between[row_key(e.key)] = e.detail
        self.errors = {k: m for k in self.infos if (m := self._own_errors.get(k) or between.get(k, ""))}
        self._show_rows()
        return not self.errors

    def _builds(self) -> bool:
        try:
            build(self.cls, self.values(), FORM_SOURCE)
        except ProfileError:
            return False
        return True

    def show_error(self, key: str, message: str) -> None:
        """Mark `key` (or the key a nested key belongs to) with `message` and put the cursor on it."""
        key = row_key(key)
        if key in self.infos:
            self.errors[key] = message
            self._show_rows()
            self.edit_key(key, focus=False)

    # -- the table ----------------------------------------------------------------------------------------------

    def _show_rows(self, relayout: bool = False) -> None:
        if self._widths is None or not self._ready:
            return
        value_width, note_width = self._widths
        rows: dict[str, tuple[Text, Text, Text]] = {}
        section = None
        for key, info in self.infos.items():
            if section_of(key) != section:
                section = section_of(key)
                title = f"[{section}]" if section else "profile"
                rows[SECTION + section] = (Text(title, "bold"), Text(""), Text(""))
            leaf = Text("  " + key.rsplit(".", 1)[-1])
            rows[key] = (leaf, self._value_cell(key, value_width), self._note_cell(key, info, note_width))
        first = not self.table.row_count
        self.table.set_rows(rows, relayout)
        if first and self.current is not None:
            self.table.select(self.current)  # the cursor on the key in the editor, not on the first row
        self._show_error_line()

    def _value_cell(self, key: str, width: int) -> Text:
        text = (
            self._texts[key]
            if editor_kind(self.infos[key]) == "text"
            else field_text(self.infos[key], self._values[key])
        )
        if not text:
            return Text("(empty)", "dim")
        return Text(cut(text, width), "red" if key in self.errors else "")

    def _note_cell(self, key: str, info: FieldInfo, width: int) -> Text:
        if key in self.errors:
            return Text(cut("✗ " + self.errors[key], width), "bold red")
        if self._values[key] != self._loaded[key]:
            note, style = "edited", "yellow"
        else:
            from_file = key in self._in_file or self._values[key] != info.default
            note, style = ("profile", "") if from_file else ("default", "dim")
        return Text(note if width >= NOTE_WIDTH else SHORT_NOTES[note], style)

    def _show_error_line(self) -> None:
        line = next(self.query("#form-error").results(Static), None)
        if line is None:
            if not self.errors:
                return
            line = Static("", id="form-error", markup=False)
            self.mount(line, before=".form-help")
        line.display = bool(self.errors)
        if self.errors:
            key = self.current if self.current in self.errors else next(iter(self.errors))
            more = f"   ({len(self.errors)} keys to fix)" if len(self.errors) > 1 else ""
            line.update(f"✗ {key}: {self.errors[key]}{more}")

    @on(DataTable.RowHighlighted, "#form-table")
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        # one the cursor has left since is passed over (the rows first drawn highlight the first row, then the key
        # in the editor): showing that key would hide and show the editors again, relaid out after the first paint
        if event.row_key.value is not None and event.cursor_row == self.table.cursor_row:
            self._show_key(event.row_key.value)

    @on(DataTable.RowSelected, "#form-table")
    def _selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a key: a true/false flips, anything else is edited."""
        event.stop()
        key = event.row_key.value
        if key in self.infos and not self.disabled:
            if editor_kind(self.infos[key]) == "toggle":
                cast(Checkbox, self._editor("toggle")).toggle()
            else:
                self.edit_key(key)

    def action_move(self, delta: int) -> None:
        """Up/down in an editor (the table moves its own cursor): edit the previous/next key (not a section)."""
        keys = list(self.infos)
        if self.current in keys:
            self.edit_key(keys[min(max(keys.index(self.current) + delta, 0), len(keys) - 1)])

    # -- the editor ---------------------------------------------------------------------------------------------

    def edit_key(self, key: str, focus: bool = True) -> Input | ChoiceField | Checkbox:
        """Put the cursor on `key` and, with `focus`, the focus in its editor; returns that editor."""
        self._show_key(key)
        self.table.select(key)
        editor = self._editor(editor_kind(self.infos[key]))
        if focus:
            editor.focus()
        return editor

    def _editor(self, kind: Editor) -> Input | ChoiceField | Checkbox:
        """The editor of `kind`, mounted the first time a key needs it."""
        found = self.query(f"#editor-{kind}")
        if found:
            editor = found.first()
        else:
            if kind == "choice":
                editor = ChoiceField(id="editor-choice", tooltip="Enter or a click lists the values this key takes")
            else:
                editor = Checkbox("", id="editor-toggle", compact=True)
            self.query_one("#form-editor").mount(editor)
        assert isinstance(editor, (Input, ChoiceField, Checkbox))
        return editor

    def _show_key(self, key: str) -> None:
        """Show `key` in the editor (a section title: its help only)."""
        if key == self.current:
            return
        self._commit_editor()
        info = self.infos.get(key)
        self.current = key if info else None
        kind = editor_kind(info) if info else None
        for name in ("text", "choice", "toggle"):
            for editor in self.query(f"#editor-{name}"):
                editor.display = name == kind
        self.query_one("#editor-key", Label).update(key if info else "")
        help_line = self.query_one(".form-help", Static)
        if info is None:
            section = key.removeprefix(SECTION)
            help_line.update(f"[{section}] {self._sections.get(section, '')}" if section else "profile")
            return
        help_line.update(
            Content.from_markup("[b]$key[/] ($range): $help", key=key, range=range_text(info), help=info.help)
        )
        editor = self._editor(editor_kind(info))
        if isinstance(editor, Input):
            editor.value = self._texts[key]
        elif isinstance(editor, ChoiceField):
            editor.set_options(select_options(info))
            editor.value = self._values[key]
        else:
            editor.value = bool(self._values[key])
        self._show_error_line()

    def _commit_editor(self) -> None:
        """Keep the value in the editor for the key being left, even if its Changed message has not come yet."""
        if self.current is None:
            return
        kind = editor_kind(self.infos[self.current])
        value = self._editor(kind).value
        if kind == "text":
            self._typed_text(str(value))
        else:
            self._picked_value(value)

    def _typed_text(self, text: str) -> None:
        key = self.current
        if key is None or text == self._texts[key]:
            return
        self._texts[key] = text
        self._set(key, parse_field(self.infos[key], text))

    # An editor's Changed message comes after the value was set: one that no longer matches its editor (the
    # cursor moved on) or the value held (it was set from the held value) is not an edit.

    @on(Input.Changed, "#editor-text")
    def _text_changed(self, event: Input.Changed) -> None:
        event.stop()
        if event.value == event.input.value:
            self._typed_text(event.value)

    @on(Input.Submitted, "#editor-text")
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.table.focus()

    @on(ChoiceField.Changed, "#editor-choice")
    @on(Checkbox.Changed, "#editor-toggle")
    def _picked(self, event: ChoiceField.Changed | Checkbox.Changed) -> None:
        event.stop()
        if event.value == event.control.value:
            self._picked_value(event.value)

    def _picked_value(self, value: Any) -> None:
        key = self.current
        if key is None or value is BLANK or editor_kind(self.infos[key]) == "text":
            return
        held = self._values[key]
        if value != held or type(value) is not type(held):
            self._set(key, value)
