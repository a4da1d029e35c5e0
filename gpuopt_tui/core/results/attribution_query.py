"""Searching and ordering an attribution run's samples (the sample list's `/` filter and sort)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.results.attribution import SampleEntry

SORTS: dict[str, tuple[str, Callable[[SampleEntry], Any]]] = {
    "index": ("dataset order", lambda e: e.index),
    "delta": ("largest relative delta first", lambda e: -e.relative_delta),
    "probability": ("least confident first", lambda e: e.probability),
}
QUERY_HELP = "words in the text, top:TOKEN, pred:N, target:N, label:N, wrong, lowmargin, fullprecision, abovetol"
FLAGS: dict[str, Callable[[SampleEntry], bool]] = {  # a word of the query -> the samples it keeps
    "wrong": lambda e: e.wrong,
    "lowmargin": lambda e: e.low_margin,
    "fullprecision": lambda e: e.full_precision,
    "abovetol": lambda e: e.within_tolerance is False,
}
_CLASS_FILTERS = ("pred", "target", "label")


@dataclass(frozen=True)
class SampleQuery:
    """A search: every word must occur in the sample's text; `top:` tokens among its top tokens; `pred:`,
    `target:`, `label:` classes must match; each of FLAGS keeps the samples it names: `wrong` those whose
    prediction differs from the label, `lowmargin` those whose top two outputs are within the steps' precision
    error, `fullprecision` those whose steps ran in full precision, `abovetol` those above the tolerance."""

    words: tuple[str, ...] = ()
    top: tuple[str, ...] = ()
    classes: tuple[tuple[str, int], ...] = ()
    flags: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> SampleQuery:
        """UserError names the part that is not understood."""
        words: list[str] = []
        top: list[str] = []
        classes: list[tuple[str, int]] = []
        flags: set[str] = set()
        for part in text.split():
            key, sep, value = part.partition(":")
            key = key.lower()
            if not sep:
                (flags.add if key in FLAGS else words.append)(key)
            elif key == "top" and value:
                top.append(value.lower())
            elif key in _CLASS_FILTERS and value.isdigit():
                classes.append((key, int(value)))
            else:
                raise UserError(f'"{part}": expected {QUERY_HELP}')
        return cls(tuple(words), tuple(top), tuple(classes), frozenset(flags))

    def matches(self, entry: SampleEntry) -> bool:
        if not all(FLAGS[flag](entry) for flag in self.flags):
            return False
        if any(word not in entry.search_text for word in self.words):
            return False
        tops = {t.lower() for t in entry.top_tokens} if self.top else set()
        if any(t not in tops for t in self.top):
            return False
        values = {"pred": entry.prediction, "target": entry.target, "label": entry.label}
        return all(values[key] == value for key, value in self.classes)


def select(entries: Iterable[SampleEntry], query: SampleQuery, sort: str = "index") -> list[SampleEntry]:
    """The entries that match `query`, ordered by one of SORTS (ties in dataset order)."""
    key = SORTS[sort][1]
    return sorted((e for e in entries if query.matches(e)), key=lambda e: (key(e), e.index))
