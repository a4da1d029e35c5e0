from gpuopt_tui.core.format import human_time, safe_text, with_article


def test_safe_text_replaces_escape_sequences_and_keeps_tabs_and_newlines() -> None:
    assert safe_text("a\x1b[2Jb\tc\nd\x07\x9b") == "a?[2Jb\tc\nd??"


def test_safe_text_takes_any_object() -> None:
    assert safe_text(3.5) == "3.5"


def test_human_time_of_an_impossible_timestamp_is_a_question_mark() -> None:
    assert human_time(1e300) == "?"
    assert human_time(float("nan")) == "?"
    assert human_time(None) == "--"


def test_with_article_follows_the_first_letter() -> None:
    assert [with_article(k) for k in ("ablation", "attribution", "tracin", "plan")] == [
        "an ablation",
        "an attribution",
        "a tracin",
        "a plan",
    ]
