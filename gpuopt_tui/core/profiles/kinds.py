"""The run kinds and their profile classes."""

from __future__ import annotations

from gpuopt_tui.core.profiles.ablation import AblationProfile
from gpuopt_tui.core.profiles.attribution import AttributionProfile
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.profiles.tracin import TracInProfile

PROFILE_CLASSES: dict[str, type[ProfileBase]] = {
    cls.kind: cls for cls in (AttributionProfile, TracInProfile, AblationProfile, PlanProfile)
}
