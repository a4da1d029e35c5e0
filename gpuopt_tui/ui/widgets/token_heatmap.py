"""A sample's text with each token's background coloured by its attribution.

Red for tokens that push the explained output up, blue for those that pull it down; the shade grows with
|score| / max |score| of the sample. The ten shades are entries of the xterm 256-colour cube, so a terminal
without true colour (SSH does not forward COLORTERM) shows exactly the same colours.
"""

from __future__ import annotations

import re

from textual.content import Content

from gpuopt_tui.core.results.attribution import JSONL_NAME, Sample, Segment

# lightest to strongest, with a text colour that stays readable on each
POSITIVE = (("#ffd7d7", "#000000"), ("#ffafaf", "#000000"), ("#ff8787", "#000000"), ("#ff5f5f", "#000000"),
            ("#d70000", "#ffffff"))  # fmt: skip
NEGATIVE = (("#d7d7ff", "#000000"), ("#afafff", "#000000"), ("#8787ff", "#000000"), ("#5f5fff", "#ffffff"),
            ("#0000d7", "#ffffff"))  # fmt: skip
UNCOLOURED_BELOW = 0.05  # shares of the sample's max |score| too small to shade
SPECIAL = re.compile(r"\[[A-Z]+\]|<[a-z/]+>|<\|[a-z]+\|>")  # [CLS], <s>, </s>, <pad>, <|endoftext|>
WORD_START = ("Ġ", "▁")  # byte-level BPE and SentencePiece mark a token that starts a word


def shade(score: float, max_abs: float) -> str | None:
    """The style of a token with `score` in a sample whose largest |score| is `max_abs` (None: unshaded)."""
    if max_abs <= 0 or score == 0:
        return None
    fraction = abs(score) / max_abs
    if fraction < UNCOLOURED_BELOW:
        return None
    ramp = POSITIVE if score > 0 else NEGATIVE
    background, foreground = ramp[min(len(ramp) - 1, int(fraction * len(ramp)))]
    return f"{foreground} on {background}"


def word_pieces(tokens: tuple[str, ...]) -> list[tuple[str, bool]]:
    """Each token as shown, and whether a space goes before it: WordPiece continues a word with "##", byte-level
    BPE and SentencePiece start one with "Ġ" or "▁"."""
    marks_starts = any(t.startswith(WORD_START) for t in tokens)
    pieces = []
    for i, token in enumerate(tokens):
        if marks_starts:
            starts = token.startswith(WORD_START) or bool(SPECIAL.fullmatch(token))
            text = token[1:] if token.startswith(WORD_START) else token
        else:
            starts = not token.startswith("##")
            text = token[2:] if not starts else token
        pieces.append((text or token, starts and i > 0))
    return pieces


def segment_content(segment: Segment, max_abs: float) -> Content:
    parts: list[str | tuple[str, str]] = []
    for (text, space), score in zip(word_pieces(segment.tokens), segment.scores):
        if space:
            parts.append(" ")
        style = "dim" if SPECIAL.fullmatch(text) else shade(score, max_abs)
        parts.append((text, style) if style else text)
    return Content.assemble(*parts)


def heatmap(sample: Sample) -> Content:
    """The sample's tokens, shaded; a two-tower sample shows every candidate's title on its own line, the
    explained (target), predicted and labelled candidates marked; a note counts the tokens past those kept."""
    shown = _shaded(sample)
    if not sample.hidden:
        return shown
    more = f"… {sample.hidden:,} more token{'s' if sample.hidden > 1 else ''}: see {JSONL_NAME}"
    return Content.assemble(shown, "\n", (more, "dim italic"))


def _shaded(sample: Sample) -> Content:
    max_abs = sample.max_abs
    if not sample.two_tower:
        return segment_content(sample.segments[0], max_abs)
    lines = []
    entry = sample.entry
    for c, segment in enumerate(sample.segments):
        hits = (("target", c == entry.target), ("predicted", c == entry.prediction), ("label", c == entry.label))
        marks = [name for name, hit in hits if hit]
        label = f"candidate {c}" + (f" ({', '.join(marks)})" if marks else "")
        lines.append(Content.assemble((label, "bold" if marks else "dim"), "\n", segment_content(segment, max_abs)))
    return Content("\n").join(lines)


def legend(max_abs: float) -> Content:
    """The colour scale: blue against the explained output, red for it, strongest at the sample's max |score|."""
    swatches = [(" ", f"on {bg}") for bg, _ in (*reversed(NEGATIVE), *POSITIVE)]
    return Content.assemble("against ", *swatches, f" for · max |score| {max_abs:.3g}")
