"""Redaction of secret-looking values before they reach logs, excerpts or the model.

Keys named like credentials are masked whole; inside free text, bearer tokens, well-known API key
shapes and `key=value` pairs with credential-like keys are masked. Redaction is deliberately
over-eager: a false positive costs a masked word, a false negative leaks a secret.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import SecretBytes, SecretStr

MASK = "[REDACTED]"
TOO_DEEP = "[NESTED TOO DEEP]"
# Tool arguments come from a model: nesting beyond this is never meaningful, and walking it
# recursively would overflow the stack (json.loads accepts far deeper input than Python recursion).
_MAX_DEPTH = 64
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

_SECRET_KEY = re.compile(
    r"(pass(word|wd|phrase)?|secret|token|api[-_]?key|apikey|auth(orization)?|credential|"
    r"private[-_]?key|session[-_]?id|cookie|signature)",
    re.IGNORECASE,
)
# Every pattern below runs on model-supplied text of any size, so each must stay linear: a match
# may only start where a word starts, and runs that cannot give back characters are possessive
# (`*+`, `++`), so a failed attempt never rescans what it already read.
_TEXT_PATTERNS = [
    # "Bearer abc.def" / "Basic xyz=="
    re.compile(r"(?i)\b(bearer|basic)\s++[A-Za-z0-9._~+/=-]{8,}"),
    # provider-style keys: sk-..., sk-ant-..., ghp_..., xoxb-..., AKIA...
    re.compile(r"\b(sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})\b"),
    # URLs with credentials: scheme://user:pass@host
    re.compile(r"(?<=://)[^/\s:@]*+:[^/\s@]++(?=@)"),
]
# `key=value` / `"key": value` with a credential-like key. The key is a whole word (never a part of
# a longer run of word characters): the lookahead finds the credential word inside it, then the word
# is read once, possessively. The older `[\w.-]*(token|...)[\w.-]*` retried every suffix of a long
# word at every position, which is quadratic (20 KB of base64 took seconds, "token" * 1000 minutes).
_KEY_VALUE = re.compile(
    r"""(?ix)
    (?<![\w.-])
    (?P<key>["']?
        (?=[\w.-]*?(pass(word|wd)?|secret|token|api[-_]?key|apikey|credential))
        [\w.-]++["']?)
    (?P<sep>\s*+[:=]\s*+)
    (?P<value>"[^"]*+"|'[^']*+'|[^\s,;&}]++)
    """
)
# A quoted JSON key named like a credential (the fuller list of is_secret_key) with its value: this
# covers JSON text too large to parse for an excerpt, where `redact` cannot mask by key.
_JSON_SECRET_FIELD = re.compile(
    r"""(?ix)
    (?P<key>"(?=[^"\\]{0,64}+")[^"\\]*?
        (pass(word|wd|phrase)?|secret|token|api[-_]?key|apikey|auth(orization)?|credential|
         private[-_]?key|session[-_]?id|cookie|signature)[^"\\]*+")
    (?P<sep>\s*+:\s*+)
    (?P<value>"(?:[^"\\]|\\.)*+"|[^\s,}\]]++)
    """
)
# An excerpt of a longer string is cut from a redacted head of this many characters; the rest of
# the input is never parsed or scanned, so an excerpt costs the same for 1 KB or 10 MB of input.
_HEAD_WINDOW = 16 * 1024


def is_secret_key(key: str) -> bool:
    """True when a field or variable name looks like it holds a credential."""
    return bool(_SECRET_KEY.search(key))


def redact_text(text: str) -> str:
    """Mask credentials inside free text (tokens, keys, `password=...`, URL credentials)."""
    for pattern in _TEXT_PATTERNS:
        text = pattern.sub(MASK, text)
    text = _JSON_SECRET_FIELD.sub(lambda m: f"{m['key']}{m['sep']}{MASK}", text)
    return _KEY_VALUE.sub(lambda m: f"{m['key']}{m['sep']}{MASK}", text)


def redact(value: Any, _depth: int = 0) -> Any:
    """Return a copy of a JSON-like value with secrets masked (by key name, type, or shape).

    Values nested deeper than 64 levels are replaced by a marker rather than walked.
    """
    if _depth > _MAX_DEPTH:
        return TOO_DEEP
    if isinstance(value, (SecretStr, SecretBytes)):
        return MASK
    if isinstance(value, dict):
        return {
            key: (
                MASK
                if isinstance(key, str) and is_secret_key(key) and val not in (None, "")
                else redact(val, _depth + 1)
            )
            for key, val in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(item, _depth + 1) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def well_formed(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD, so it encodes as UTF-8 and fits a str field.

    JSON escapes such as "\\ud800" decode to lone surrogates, which pydantic refuses in `str` fields
    and UTF-8 cannot encode; echoing such input back in an error must not fail.
    """
    return _LONE_SURROGATE.sub("\ufffd", text)


def excerpt(raw: Any, limit: int = 300) -> str:
    """A redacted, bounded excerpt of some input for error messages and logs.

    Linear in the input, and a string longer than 16 KiB costs no more than one of 16 KiB: only
    its head is redacted (as text, not parsed), and the excerpt gives the full length.
    """
    if isinstance(raw, str) and len(raw) > _HEAD_WINDOW:
        head = well_formed(redact_text(raw[:_HEAD_WINDOW]))
        return f"{head[:limit]}… ({len(raw)} chars)"
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            text = redact_text(raw)
        else:
            text = json.dumps(redact(parsed), ensure_ascii=False) if isinstance(parsed, (dict, list)) else redact_text(raw)
    else:
        text = json.dumps(redact(raw), ensure_ascii=False, default=str)
    text = well_formed(text)
    if len(text) > limit:
        return f"{text[:limit]}… ({len(text)} chars)"
    return text
