"""One line of a JSONL file parsed, with every way it can fail as one error carrying a short reason."""

from __future__ import annotations

import json
from typing import Any


class JsonLineError(ValueError):
    """The line is not JSON; str() is the reason ("Expecting value", "nested too deeply", ...)."""


def parse_json_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise JsonLineError(error.msg) from None
    except ValueError as error:  # e.g. an integer of thousands of digits
        raise JsonLineError(str(error)) from None
    except RecursionError:
        raise JsonLineError("nested too deeply") from None
