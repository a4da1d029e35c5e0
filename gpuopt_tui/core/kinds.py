"""The run kinds, each said once: its profile class, its engine and the app screen that edits and watches it.

The CLI (profile kinds and keys), the runner (which engine a run directory's profile runs) and the app (which
screen shows a kind's runs) all read this table. Engines and screens are named as text: core imports neither
torch nor Textual, and the app must not import an engine to find out whether it is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpuopt_tui.core.profiles.ablation import AblationProfile
from gpuopt_tui.core.profiles.attribution import AttributionProfile
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.profiles.tracin import TracInProfile

_PACKAGE = Path(__file__).resolve().parents[1]  # gpuopt_tui/


@dataclass(frozen=True)
class RunKind:
    profile: type[ProfileBase]  # its `kind` is the kind's name
    engine: str  # module whose `run_job(profile, ctx)` runs it (see jobs/runner.py)
    screen: str  # name of the app screen that edits and watches it (ui/screens/registry.py)

    @property
    def name(self) -> str:
        return self.profile.kind

    @property
    def engine_file(self) -> Path:
        """The engine module's file, found without importing it."""
        return _PACKAGE.joinpath(*self.engine.split(".")[1:]).with_suffix(".py")


KINDS: dict[str, RunKind] = {
    k.name: k
    for k in (
        RunKind(AttributionProfile, "gpuopt_tui.jobs.attribution.job", "attribution"),
        RunKind(TracInProfile, "gpuopt_tui.jobs.tracin.job", "tracin"),
        RunKind(AblationProfile, "gpuopt_tui.jobs.ablation.job", "ablation"),
        RunKind(PlanProfile, "gpuopt_tui.jobs.planjob", "planner"),
    )
}


def engine_available(kind: str) -> bool:
    """Whether this installation has an engine for `kind` (checked without importing it, so no torch)."""
    run_kind = KINDS.get(kind)
    return run_kind is not None and run_kind.engine_file.is_file()
