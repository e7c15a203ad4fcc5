"""Fitting a handler's output into the model's budget (docs/architecture.md, "Output shaping")."""

from __future__ import annotations

from toolchord.worker.models import Truncation
from toolchord.worker.redaction import well_formed
from toolchord.worker.spill import SessionSpill

EMPTY_PLACEHOLDER = "(no output)"
# Share of the budget given to the head; the tail usually holds the summary or the error.
_HEAD_SHARE = 0.6


def cap_content(text: str, max_chars: int, spill: SessionSpill | None) -> tuple[str, Truncation | None]:
    """Return text within `max_chars`: head and tail kept, a notice of what was cut and how to read it.

    Empty text becomes a placeholder so the model never gets an empty result. Lone surrogates
    (a handler echoing a JSON "\\udc00" escape) are replaced: the content must encode as UTF-8.
    """
    text = well_formed(text)
    if not text.strip():
        return EMPTY_PLACEHOLDER, None
    if len(text) <= max_chars:
        return text, None
    ref = spill.put(text) if spill is not None else None

    def how(offset: int) -> str:
        if ref is None:
            return "ask for a narrower result (filter, page, or limit)"
        return f'read the rest with read_output(ref="{ref}", offset={offset})'

    # The notice's own length depends on the cut size and offset; reserve enough for the longest.
    reserve = 160 + len(how(len(text)))
    budget = max(max_chars - reserve, 0)
    head = int(budget * _HEAD_SHARE)
    tail = budget - head
    cut = len(text) - head - tail
    # The offset is where the cut starts, so reading on from it continues the head seamlessly.
    notice = f"\n[… {cut} of {len(text)} characters cut from the middle; {how(head)} …]\n"
    shaped = text[:head] + notice + (text[-tail:] if tail else "")
    return shaped, Truncation(original_chars=len(text), kept_chars=head + tail, spill_ref=ref)
