"""The screen shared by every run kind: pick a profile, edit it, save it, run it, watch the latest run."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.events import Resize
from textual.geometry import Size
from textual.widgets import Button, Label, Static, Tab, Tabs

from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.errors import ProfileError, UserError
from gpuopt_tui.core.kinds import KINDS, engine_available
from gpuopt_tui.core.paths import shipped_profiles_dir, user_profiles_dir
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.io import ProfileEntry, read_text
from gpuopt_tui.core.profiles.io import save_profile as write_profile
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.loading import Loaded, reply
from gpuopt_tui.ui.profile_listing import ProfileListing, read_listing, read_profile
from gpuopt_tui.ui.run_poller import RunsSnapshot
from gpuopt_tui.ui.screens.base import AppScreen
from gpuopt_tui.ui.widgets.choice_field import BLANK, ChoiceField
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.profile_form import ProfileForm
from gpuopt_tui.ui.widgets.profile_values import FORM_SOURCE
from gpuopt_tui.ui.widgets.prompt import TextPrompt
from gpuopt_tui.ui.widgets.run_progress import RunProgress
from gpuopt_tui.ui.widgets.run_results import RunResults

NARROW_BELOW = 100
PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def display_path(path: Path) -> str:
    """Short, stable names: shipped profiles by file name, others relative to the home directory."""
    path = path.resolve()
    if path.parent == shipped_profiles_dir().resolve():
        return f"shipped: {path.name}"
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def check_profile_name(name: str) -> str:
    if not PROFILE_NAME.fullmatch(name):
        return "use letters, digits, '.', '_' or '-' (no spaces or slashes), starting with a letter or digit"
    return ""


class ProfilesRead(Loaded):
    """The listing of a kind's profiles, and the one to open (a ProfileListing)."""


class KindScreen(AppScreen):
    """Subclasses set KIND (a run kind) and SCREEN_NAME, and may set RESULTS to a richer results widget."""

    KIND: ClassVar[str] = ""
    RESULTS: ClassVar[type[RunResults]] = RunResults
    BROWSE_RESULTS: ClassVar[type[RunResults] | None] = (
        None  # the view of one run in the results browser: RESULTS if None
    )

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+r", "run", "Run", id="profile.run", tooltip="Start a run of this profile in the background"),
        Binding("ctrl+s", "save", "Save", id="profile.save", tooltip="Save the profile (comments are kept)"),
        Binding("ctrl+n", "save_as", "Save as", id="profile.save_as", tooltip="Save under a new name"),
        Binding("ctrl+g", "cancel_run", "Cancel run", id="profile.cancel", tooltip="Stop the latest run"),
        Binding(
            "ctrl+o",
            "toggle_results",
            "Results",
            id="profile.results",
            tooltip="Show the latest run's results on the whole screen (escape comes back)",
        ),
        Binding(
            "ctrl+l",
            "switch_pane",
            "Form/Run",
            id="profile.pane",
            tooltip="On a narrow terminal: show the profile form, or the latest run and its results",
        ),
        Binding("escape", "leave_field", "Leave field", show=False, id="profile.leave_field"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.cls: type[ProfileBase] = KINDS[self.KIND].profile
        self.path: Path | None = None  # the profile file being edited
        self.latest: RunInfo | None = None  # the newest run of this kind
        self._entries: dict[str, ProfileEntry] = {}
        self._opened: str | None = None  # the picker value last opened (readable or not)

    # -- layout -------------------------------------------------------------------------------------------------

    def compose_body(self) -> ComposeResult:
        with Horizontal(id="profile-bar"):
            yield Label("Profile", classes="bar-label")
            yield ChoiceField(
                id="profile-picker",
                prompt="(no profile)",
                tooltip="The profile in the form: enter or a click lists them",
            )
            yield Button("Save", id="save", compact=True)
            yield Button("Save as", id="save-as", compact=True)
            yield Button("Run", id="run", variant="success", compact=True)
        yield Static("", id="profile-info", markup=False)
        # (on a narrow terminal, the tabs of the form and run panes come here: see on_resize)
        with Horizontal(id="kind-body"):
            yield ProfileForm(self.cls, id="form")
            with Vertical(id="run-side"):
                yield from self.compose_side()
                yield Static("", id="engine-note", markup=False)
                yield Static("Latest run", classes="pane-title")
                yield RunProgress(
                    f"No {self.KIND} run yet: ctrl+r runs this profile.",
                    gpu=self.gapp.gpu_telemetry().source,
                    id="run-progress",
                )
                yield Button("Cancel run", id="cancel", variant="error", compact=True)
                yield self.RESULTS(id="run-results")

    def compose_side(self) -> ComposeResult:
        """Extra panes above the run's progress (none by default)."""
        yield from ()

    def on_mount(self) -> None:
        self._show_engine()
        self._fit_width(self.app.size.width)  # as the first layout will: the form's rows drawn in the first paint
        listing = self.gapp.profile_listings.pop(self.KIND, None)  # read after the app's first frame, if it was
        if listing is None and self.gapp.startup_seconds is None:
            listing = read_listing(self.KIND, None)  # the first screen: nothing is on the terminal to keep answering
        if listing is not None:
            self._show_listing(listing)
        else:
            self.reload_profiles()
        # the arrows move through the keys at once; tab reaches the picker and buttons. Focused now, not after (as
        # `focus()` does): the table would be drawn again, focused, right after the screen's first paint
        self.set_focus(self.form.table)

    def on_resize(self, event: Resize) -> None:
        self._fit_width(event.size.width)
        self.refresh_bindings()

    def _fit_width(self, width: int) -> None:
        """Lay the panes out for a screen `width` columns wide: side by side, or taking turns when narrow."""
        narrow = width < NARROW_BELOW
        self.set_class(narrow, "-narrow")
        if narrow and not self.query("#pane-tabs"):
            # the form and the run pane take turns: tabs to pick one, made the first time they are needed (a wide
            # terminal never shows them, and each widget costs time on the screen's first visit)
            active = "pane-run" if self.has_class("-run-pane") else "pane-form"
            tabs = Tabs(
                Tab("Profile", id="pane-form"), Tab("Run & results", id="pane-run"), id="pane-tabs", active=active
            )
            self.mount(tabs, before="#kind-body")
        side_width = self.query_one("#run-side").styles.width  # beside the form, which takes the rest (1fr)
        size = Size(width, self.app.size.height)
        beside = int(side_width.resolve(size, size)) if side_width is not None and not narrow else 0
        self.form.expect_width(width - beside)

    @property
    def results(self) -> RunResults:
        return self.query_one("#run-results", RunResults)

    def show_pane(self, pane: str) -> None:
        """On a narrow terminal, show the "form" or the "run" pane (both are always shown on a wide one)."""
        tabs = self.query("#pane-tabs")
        if tabs:
            tabs.first(Tabs).active = f"pane-{pane}"
        else:  # not made yet: wide so far
            self.set_class(pane == "run", "-run-pane")

    @on(Tabs.TabActivated, "#pane-tabs")
    def _pane_chosen(self, event: Tabs.TabActivated) -> None:
        event.stop()
        run_pane = event.tab.id == "pane-run"
        if self.has_class("-narrow") and self.focused is not None:
            hidden = self.query_one("#form" if run_pane else "#run-side")
            if self.focused is hidden or hidden in self.focused.ancestors:
                self.set_focus(None)
        self.set_class(run_pane, "-run-pane")

    @property
    def form(self) -> ProfileForm:
        return self.query_one("#form", ProfileForm)

    def _show_engine(self) -> None:
        available = engine_available(self.KIND)
        note = self.query_one("#engine-note", Static)
        note.set_class(not available, "-warning")
        if available:
            note.update("Runs are background processes: they go on if this terminal closes.")
        else:
            note.update(
                f"No engine for {self.cls.title} in this build yet: runs of this kind cannot start. "
                "Profiles can still be edited and saved."
            )
        self.query_one("#run", Button).disabled = not available

    # -- profiles -----------------------------------------------------------------------------------------------

    def reload_profiles(self, select: Path | None = None) -> None:
        """List the profiles of this kind (and unreadable ones, so their errors can be seen) in the picker, and open
        `select` (else the one open, else the kind's demo); read in a thread."""
        wanted = select or self.path
        self._read(partial(read_listing, self.KIND, wanted))

    @work(thread=True, exclusive=True, group="profiles", exit_on_error=False)
    def _read(self, read: Callable[[], ProfileListing]) -> None:
        reply(self, ProfilesRead, None, read)

    @on(ProfilesRead)
    def _profiles_read(self, message: ProfilesRead) -> None:
        if message.value is not None:
            self._show_listing(message.value)
        else:  # the listing could not be read (the app reports why)
            self.form.show_defaults()

    def _show_listing(self, listing: ProfileListing) -> None:
        picker = self.query_one("#profile-picker", ChoiceField)
        if listing.entries is not None:
            self._entries = {str(e.path): e for e in listing.entries}
            picker.set_options([(self._label(e), str(e.path)) for e in listing.entries])
        if listing.path is None:
            self.form.show_defaults()
            return
        self._opened = str(listing.path)  # before the picker shows it: that Changed is not a pick
        picker.value = str(listing.path)
        if listing.profile is None:
            self.path = None
            self.form.disabled = True
            self.form.show_defaults()
            self._set_info(Content.from_markup("[$error]$error[/]", error=listing.error), error=True)
            self.notify_shown(listing.error, title="Cannot open this profile", severity="error", timeout=10)
        else:
            self.path = listing.path
            self.form.disabled = False
            self.form.load(listing.profile, listing.keys)
            self._show_profile_info(dirty=False)
        self.profile_opened()

    def profile_opened(self) -> None:
        """Called when a profile was opened into the form, or could not be (the form is disabled then)."""

    def _label(self, entry: ProfileEntry) -> str:
        if entry.error:
            return f"{entry.name} (unreadable)"
        if entry.kind not in KINDS:
            return f"{entry.name} (unknown kind)"
        return entry.name if entry.shipped else f"{entry.name} (yours)"

    @on(ChoiceField.Changed, "#profile-picker")
    def _picked(self, event: ChoiceField.Changed) -> None:
        if event.value is BLANK or event.value == self._opened:
            return  # set by code, or no change
        target = Path(str(event.value))
        if not self.form.dirty:
            self._open(target)
            return

        def answered(discard: bool | None) -> None:
            if discard:
                self._open(target)
            else:
                self.query_one("#profile-picker", ChoiceField).value = self._opened or BLANK

        self.app.push_screen(ConfirmDialog("Discard the unsaved changes to this profile?", "Discard", "Keep"), answered)

    def unsaved_edits(self) -> str:
        forms = self.query("#form").results(ProfileForm)  # none before the screen is composed
        if not any(form.dirty for form in forms):
            return ""
        name = self.path.stem if self.path is not None else "(not saved yet)"
        return f"the edits to {self.KIND} profile {name}"

    def _open(self, path: Path) -> None:
        self._opened = str(path)
        self._read(partial(read_profile, path, None))

    def _show_profile_info(self, dirty: bool) -> None:
        if self.path is None:
            return
        entry = self._entries.get(str(self.path))
        description = entry.description if entry else ""
        self._set_info(
            Content.from_markup(
                "$path[$warning]$modified[/]  [$text-muted]$description[/]",
                path=display_path(self.path),
                modified="  (modified)" if dirty else "",
                description=description,
            )
        )

    def _set_info(self, content: Content, error: bool = False) -> None:
        info = self.query_one("#profile-info", Static)
        info.set_class(error, "-error")  # an error wraps onto more lines; a path and description stay on one
        info.update(content)

    @on(ProfileForm.Changed)
    def _form_changed(self, event: ProfileForm.Changed) -> None:
        self._show_profile_info(event.dirty)

    # -- actions ------------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel_run":
            return self.latest is not None and self.latest.active
        if action == "toggle_results":
            return self.maximized is not None or self.results.has_results
        if action == "switch_pane":
            return self.has_class("-narrow") and self.maximized is None
        return True

    def action_toggle_results(self) -> None:
        if self.maximized is not None:
            self.minimize()
            return
        results = self.results
        if self.maximize(results, container=False):
            results.focus_first()

    def action_switch_pane(self) -> None:
        self.show_pane("form" if self.has_class("-run-pane") else "run")

    def action_leave_field(self) -> None:
        """Escape: from the form's editor back to its table; elsewhere, no focus (keys then switch screens)."""
        editor = self.form.query_one("#form-editor")
        if self.focused is not None and editor in self.focused.ancestors:
            self.form.table.focus()
        else:
            self.set_focus(None)

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        if self.path is None:
            self.action_save_as()
            return
        shipped = self.path.resolve().parent == shipped_profiles_dir().resolve()
        # shipped profiles stay as they are; a saved copy of the same name in the user's profiles shadows them
        self._save_to(user_profiles_dir() / self.path.name if shipped else self.path)

    @on(Button.Pressed, "#save-as")
    def action_save_as(self) -> None:
        suggestion = f"my-{self.path.stem}" if self.path else f"my-{self.KIND}"

        def named(name: str | None) -> None:
            if not name:
                return
            target = user_profiles_dir() / f"{name}.toml"
            if not target.exists():
                self._save_to(target)
                return
            self.app.push_screen(
                ConfirmDialog(f"{display_path(target)} exists. Replace it?", "Replace", "Keep"),
                lambda replace: self._save_to(target) if replace else None,
            )

        question = f"Save the profile as (a name; saved in {display_path(user_profiles_dir())}/):"
        self.app.push_screen(TextPrompt(question, suggestion, check_profile_name), named)

    def _save_to(self, target: Path) -> None:
        form = self.form
        if form.disabled:
            self.app.notify("open a readable profile first", severity="error")
            return
        if not form.validate():
            self._refuse("Not saved", form.errors)
            return
        try:
            profile = form.profile(str(target))
            if self.path is not None and target != self.path and not target.exists():
                atomic_write_text(target, read_text(self.path))  # start from the original: its comments survive
            write_profile(profile, target)
        except UserError as e:
            self.app.notify(str(e), title="Not saved", severity="error", timeout=10)
            return
        self.app.notify(f"saved {display_path(target)}", title="Profile saved")
        self.path = None  # reload it from the file as saved
        self.reload_profiles(select=target)

    def current_profile(self, title: str) -> ProfileBase | None:
        """The form as a validated profile, or None after saying what is wrong."""
        form = self.form
        if form.disabled:
            self.app.notify("open a readable profile first", severity="error")
            return None
        if not form.validate():
            self._refuse(title, form.errors)
            return None
        try:
            return form.profile(str(self.path) if self.path else FORM_SOURCE)
        except UserError as e:
            self.app.notify(str(e), title=title, severity="error", timeout=10)
            return None

    @on(Button.Pressed, "#run")
    def action_run(self) -> None:
        if not engine_available(self.KIND):
            self.app.notify(f"no engine for {self.KIND} runs in this build", severity="error")
            return
        profile = self.current_profile("Not started")
        if profile is not None:
            self.start(profile)

    def start(self, profile: ProfileBase, title: str = "Run not started") -> Path | None:
        """Start a background run of `profile` and show the run pane; on an error, say it (at its field if it has
        one) and return None."""
        try:
            run_dir = self.gapp.start_profile_run(profile, self.path)
        except UserError as e:
            if isinstance(e, ProfileError):
                self.show_pane("form")
                self.form.show_error(e.key, e.detail)  # e.g. a path that does not exist, at its field
            self.gapp.report_error(str(e), title=title)
            return None
        self.show_pane("run")
        return run_dir

    def _refuse(self, title: str, errors: dict[str, str]) -> None:
        self.show_pane("form")
        key, message = next(iter(errors.items()))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        self.app.notify(f"{key}: {message}{more}", title=title, severity="error", timeout=10)

    @on(Button.Pressed, "#cancel")
    def action_cancel_run(self) -> None:
        if self.latest is not None and self.latest.active:
            self.gapp.confirm_cancel(self.latest)

    # -- runs ---------------------------------------------------------------------------------------------------

    def shown_run(self, snapshot: RunsSnapshot) -> RunInfo | None:
        """The run whose progress and results this screen shows: the newest of its kind."""
        return snapshot.latest(self.KIND)

    def runs_updated(self, snapshot: RunsSnapshot) -> None:
        self.latest = self.shown_run(snapshot)
        self.query_one("#run-progress", RunProgress).show(self.latest)
        self.query_one("#cancel", Button).display = self.latest is not None and self.latest.active
        self.results.show(self.latest)
        self.refresh_bindings()
