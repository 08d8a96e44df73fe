"""Server-sent events stay one line per event whatever text they carry."""

from __future__ import annotations

import json

import pydantic

from tokenserve.entrypoints.openai.serving_base import sse


class _Delta(pydantic.BaseModel):
    text: str


def test_text_with_unicode_line_breaks_stays_one_event_line():
    # NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR: str.splitlines (and so httpx's
    # aiter_lines) breaks lines at each; JSON encoders may leave them raw.
    text = "a\x85b\u2028c\u2029d\n\r\x0be"
    for payload in (_Delta(text=text), {"text": text}):
        event = sse(payload)
        lines = event.splitlines()
        assert lines == [lines[0], ""] and lines[0].startswith("data: "), lines
        assert json.loads(lines[0][len("data: "):]) == {"text": text}
