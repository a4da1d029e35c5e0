"""The stages a run went through, as its events tell them (for the tests of what each kind reports)."""

from __future__ import annotations

from pathlib import Path

from gpuopt_tui.core.runs.events import read_events


def stages(events_file: Path) -> list[str]:
    """The stage of each progress event in order, a stage repeated in a row once; a stage with a count is marked
    with its unit ("attribution [samples]"), one without none ("loading the model")."""
    events, corrupt = read_events(events_file)
    assert not corrupt
    seen: list[str] = []
    for event in events:
        if event["type"] == "progress":
            assert "stage" in event, event
            name = f"{event['stage']} [{event['unit']}]" if "total" in event else event["stage"]
            if not seen or seen[-1] != name:
                seen.append(name)
    return seen


def hf_load_stages(family: str = "bert", device: str = "cpu") -> list[str]:
    """The stages of loading a local Hugging Face model (jobs/models/hf.py), after "loading the model"."""
    return [
        "importing transformers",
        f"importing the model's transformers modules ({family})",
        "reading the weights",
        "loading the tokenizer",
        f"moving the model to {device}",
    ]
