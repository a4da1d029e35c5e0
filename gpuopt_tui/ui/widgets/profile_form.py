"""A form generated from a profile schema: one row per field, validated by the schema itself.

Numbers and lists are read the way `--set key=value` reads them (a TOML value; a bare word stays a string), so
the form, the CLI and the files accept the same things and give the same messages.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.events import DescendantFocus
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Input, Label, Select, Static, Switch

from gpuopt_tui.core.errors import ProfileError
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.io import parse_override, profile_from_data
from gpuopt_tui.core.profiles.schema import AUTO, FieldInfo, describe, get_path, to_plain

FORM_SOURCE = "form"
FORM_HINT = "tab / shift+tab: next / previous field · the focused field's help shows here"


def toml_inline(value: Any) -> str:
    """A value as inline TOML (what a user types for lists and tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_inline(v)}" for k, v in value.items()) + "}"
    return repr(value)


def field_text(info: FieldInfo, value: Any) -> str:
    if info.type_name == "list[str]" and isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if isinstance(value, str):
        return value
    return toml_inline(value)


def parse_field(info: FieldInfo, text: str) -> Any:
    """The value typed into a field, before validation (a wrong type is left for the schema to report)."""
    if info.type_name == "str":
        return text
    text = text.strip()
    if info.auto and text == AUTO:
        return AUTO
    if info.type_name == "list[str]":
        return [part.strip() for part in text.split(",") if part.strip()]
    if not text:
        return ""
    return parse_override(f"value={text}")[1]


def set_path(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[leaf] = value


def build(cls: type[ProfileBase], data: dict[str, Any], source: str) -> ProfileBase:
    """Validate form data into a profile (raises ProfileError naming the key)."""
    return profile_from_data({"kind": cls.kind, **data}, source)


def field_error(cls: type[ProfileBase], key: str, value: Any) -> str:
    """The schema's complaint about one value on its own, or ""."""
    data: dict[str, Any] = {}
    set_path(data, key, value)
    try:
        build(cls, data, FORM_SOURCE)
    except ProfileError as e:
        if e.key == key or e.key.startswith(key + "["):
            return e.detail
    return ""


def _row_key(key: str) -> str:
    """The field an error key belongs to: tracin.checkpoints[0].path -> tracin.checkpoints."""
    return key.split("[", 1)[0]


def switch_text(value: bool) -> str:
    return "on (true)" if value else "off (false)"


def select_options(info: FieldInfo) -> list[tuple[str, Any]]:
    """A Select's (label, value) pairs: the choices, or auto / true / false for a `bool | "auto"` field (a Switch
    cannot show "auto"), whose values are what the profile holds so that a form round-trips exactly."""
    if info.choices:
        return [(c, c) for c in info.choices]
    return [(AUTO, AUTO), ("true", True), ("false", False)]


def field_id(key: str) -> str:
    return "field-" + key.replace(".", "--")


def range_text(info: FieldInfo) -> str:
    bounds = []
    if info.min is not None:
        bounds.append(f">= {info.min:g}")
    if info.max is not None:
        bounds.append(f"<= {info.max:g}")
    kind = info.type_name + (' or "auto"' if info.auto else "")
    return f"{kind}{', ' + ', '.join(bounds) if bounds else ''}"


class FieldRow(Vertical):
    """Label, editor and an inline error line for one field."""

    def __init__(self, info: FieldInfo, editor: Widget) -> None:
        super().__init__(classes="field-row")
        self.info = info
        self.editor = editor
        self.error = ""

    def compose(self) -> ComposeResult:
        with Horizontal(classes="field-line"):
            yield Label(self.info.key.rsplit(".", 1)[-1], classes="field-label")
            yield self.editor
            if isinstance(self.editor, Switch):
                yield Label(switch_text(self.editor.value), classes="switch-state")
        yield Static("", classes="field-error", markup=False)

    def on_switch_changed(self, event: Switch.Changed) -> None:
        self.query_one(".switch-state", Label).update(switch_text(event.value))

    def set_error(self, message: str) -> None:
        if message == self.error:
            return  # restyling is the costly part of a form this size: only on change
        self.error = message
        self.set_class(bool(message), "-error")
        self.editor.set_class(bool(message), "-invalid")
        self.query_one(".field-error", Static).update(message)


class ProfileForm(Vertical):
    """Edits a profile of one kind. `values()` returns the nested data; `profile(source)` validates it."""

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
        self._rows: dict[str, FieldRow] = {}
        self._loaded: dict[str, Any] = {}
        self._own_errors: dict[str, str] = {}  # each field checked on its own
        self.errors: dict[str, str] = {}  # what is shown, by field key

    def compose(self) -> ComposeResult:
        sections = {f.name: f.metadata.get("help", "") for f in fields(self.cls)}
        with VerticalScroll(classes="form-fields"):
            current = None
            for info in self.infos.values():
                section = info.key.split(".")[0] if "." in info.key else ""
                if section != current:
                    current = section
                    title = f"[{section}]  {sections.get(section, '')}" if section else "profile"
                    yield Static(title, classes="form-section", markup=False)
                row = FieldRow(info, self._editor(info))
                self._rows[info.key] = row
                yield row
        yield Static(FORM_HINT, classes="form-help", markup=False)

    def _editor(self, info: FieldInfo) -> Widget:
        editor_id = field_id(info.key)
        tooltip = f"{info.help} ({range_text(info)})"
        if info.type_name == "bool" and not info.auto:
            return Switch(bool(info.default), animate=False, id=editor_id, tooltip=tooltip)
        if info.choices or info.type_name == "bool":
            return Select(
                select_options(info), allow_blank=False, value=info.default, id=editor_id, compact=True, tooltip=tooltip
            )
        placeholder = "(empty)" if info.type_name == "str" else range_text(info)
        editor = Input(
            field_text(info, info.default), placeholder=placeholder, id=editor_id, compact=True, tooltip=tooltip
        )
        editor.cursor_blink = False  # a blinking cursor redraws twice a second: bytes over SSH for nothing
        return editor

    # -- values -------------------------------------------------------------------------------------------------

    def load(self, profile: ProfileBase) -> None:
        plain = to_plain(profile)
        for key, row in self._rows.items():
            self._set_editor(row, get_path(plain, key))
        self._loaded = self.values()
        self.validate()

    def _set_editor(self, row: FieldRow, value: Any) -> None:
        editor = row.editor
        if isinstance(editor, Switch):
            editor.value = bool(value)
        elif isinstance(editor, Select):
            editor.value = value
        elif isinstance(editor, Input):
            editor.value = field_text(row.info, value)

    def _read(self, key: str) -> Any:
        editor = self._rows[key].editor
        if isinstance(editor, Switch):
            return editor.value
        if isinstance(editor, Select):
            return editor.value
        return parse_field(self.infos[key], editor.value if isinstance(editor, Input) else "")

    def values(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key in self._rows:
            set_path(data, key, self._read(key))
        return data

    @property
    def dirty(self) -> bool:
        return self.values() != self._loaded

    def profile(self, source: str) -> ProfileBase:
        """The form as a validated profile; raises ProfileError (and marks the field) when it does not validate."""
        try:
            return build(self.cls, self.values(), source)
        except ProfileError as e:
            self.show_error(e.key, e.detail)
            raise

    # -- validation ---------------------------------------------------------------------------------------------

    def validate(self, changed: str | None = None) -> bool:
        """Check each field on its own (only `changed` when given), then the rules between fields."""
        keys = [changed] if changed else list(self._rows)
        for key in keys:
            self._own_errors[key] = field_error(self.cls, key, self._read(key))
        between: dict[str, str] = {}
        if not any(self._own_errors.values()):
            try:
                build(self.cls, self.values(), FORM_SOURCE)
            except ProfileError as e:
                between[_row_key(e.key)] = e.detail
        self.errors = {k: m for k in self._rows if (m := self._own_errors.get(k) or between.get(k, ""))}
        for key, row in self._rows.items():
            row.set_error(self.errors.get(key, ""))
        return not self.errors

    def show_error(self, key: str, message: str) -> None:
        row = self._rows.get(_row_key(key))
        if row is not None:
            self.errors[row.info.key] = message
            row.set_error(message)
            row.scroll_visible()

    @on(Input.Changed)
    @on(Select.Changed)
    @on(Switch.Changed)
    def _changed(self, event: Input.Changed | Select.Changed | Switch.Changed) -> None:
        event.stop()
        key = next((k for k, row in self._rows.items() if row.editor is event.control), None)
        self.validate(key)
        self.post_message(self.Changed(self, self.dirty))

    def on_descendant_focus(self, event: DescendantFocus) -> None:
        row = next((r for r in self._rows.values() if r.editor is event.widget), None)
        if row is None:
            return
        info = row.info
        self.query_one(".form-help", Static).update(
            Content.from_markup("[b]$key[/] ($range): $help", key=info.key, range=range_text(info), help=info.help)
        )
