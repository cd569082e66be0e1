"""The one rule for text kvtier prints or logs that came from its user (config values, ``--tier``
specs, URLs, YAML errors, tier names):

1. **Secrets are masked** (``***``):
   - a URL's password: from the first ``:`` after ``scheme://`` to the *last* ``@`` of the text
     (a password may hold ``@``, ``/`` or spaces; masking too much is the safe way to be wrong);
     a user-info without ``:`` is masked whole (it may be a password written alone);
   - the value of a key whose name ends in ``password``, ``passwd``, ``secret`` or ``token``:
     in a mapping, and in a string as ``password=VALUE`` or ``password: VALUE`` up to the end of
     the string (a password may hold ``,`` or a newline, so nothing after it is shown);
   - a YAML syntax error is described by its problem and position only, never by the snippet of
     the line it quotes (which can be the password line); text the problem quotes from the input
     (an alias or tag name) is shown only when it is at most 2 characters or a token name such
     as ``'<stream end>'``.
2. **Control characters are neutralised**: whatever is not printable (ANSI escapes, NUL, bidi
   overrides) is shown as its escape (``\\x1b``), so echoed text cannot drive the terminal.

``ConfigError`` applies both to every value and reason it shows; the CLI applies them once more
to every line it prints about an error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
SECRET_NAME = re.compile(r"(?:password|passwd|secret|token)$", re.IGNORECASE)
"""A key that holds a secret (``password``, ``api_token``); ``tokens`` (a count) does not."""
# The pattern starts a match only where a run of name characters starts (the lookbehind): tried
# from every position inside a long run, it took quadratic time (40,000 characters: 45 s).
_SECRET_ASSIGNMENT = re.compile(
    r"(?<![A-Za-z0-9_-])"
    r"(?P<key>[A-Za-z0-9_-]*(?:password|passwd|secret|token))(?P<sep>['\"]?\s*[=:][ \t]*)"
    r"(?P<value>.+)",
    re.IGNORECASE | re.DOTALL,
)
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_MAX_DEPTH = 6
"""Mappings are redacted this deep; ``errors.shown`` prints no deeper."""


def is_secret_name(name: object) -> bool:
    """Whether a key, or the last part of a field path (``tiers[0].password``), names a secret."""
    if not isinstance(name, str):
        return False
    last = re.split(r"[.\[\]]", name.rstrip("]"))[-1]
    return bool(SECRET_NAME.search(last.strip()))


def mask_url(text: str) -> str:
    """``text`` with a URL's password masked (rule 1); text without ``scheme://...@`` unchanged.

    Plain text work, no URL parsing: a URL that does not parse (``redis://u:pw@[::1``) is shown
    in the error about it."""
    separator = text.find("://")  # whatever precedes it: masking too much beats too little
    if separator < 0:
        return text
    start = separator + 3
    at = text.rfind("@")
    if at < start:
        return text
    userinfo = text[start:at]
    colon = userinfo.find(":")
    user = userinfo[:colon] + ":" if colon >= 0 else ""
    return f"{text[:start]}{user}{MASK}{text[at:]}"


def redact_text(text: str) -> str:
    """Free text (an exception's message, a reason) with URL passwords masked and made
    printable. Idempotent: redacting twice gives the same text."""
    return printable(mask_url(text))


def redact_string(value: str) -> str:
    """A string the user gave (a config value, a ``--tier`` spec): rule 1 in full."""

    def mask(match: re.Match[str]) -> str:
        return f"{match['key']}{match['sep']}{MASK}"

    return mask_url(_SECRET_ASSIGNMENT.sub(mask, value))


def redact_value(value: Any, _depth: int = 0, _seen: dict[int, Any] | None = None) -> Any:
    """A copy of a config value safe to show: secret keys' values masked, strings redacted.
    Shared nodes (YAML aliases) are redacted once each, so an alias bomb costs its size."""
    if isinstance(value, str):
        return redact_string(value)
    if _depth > _MAX_DEPTH or not isinstance(value, Mapping | list | tuple):
        return value
    seen = {} if _seen is None else _seen
    if id(value) in seen:
        return seen[id(value)]
    out: Any
    if isinstance(value, Mapping):
        out = {}
        seen[id(value)] = out
        for key, item in value.items():
            shown_key = redact_value(key, _depth + 1, seen)
            out[shown_key] = MASK if is_secret_name(key) else redact_value(item, _depth + 1, seen)
        return out
    out = []
    seen[id(value)] = out
    out.extend(redact_value(item, _depth + 1, seen) for item in value)
    return tuple(out) if isinstance(value, tuple) else out


def printable(text: str, keep_newlines: bool = False) -> str:
    """``text`` with every character that is not printable shown as its escape (``\\x1b``);
    newlines kept when ``keep_newlines`` (a multi-line report)."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or (keep_newlines and ch == "\n") else _escape(ch) for ch in text
    )


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def yaml_problem(exc: BaseException) -> str:
    """A YAML error as one line without the quoted snippet of the input (rule 1): what went
    wrong and where (``mapping values are not allowed here, line 3, column 9``)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    context = getattr(exc, "context", None)
    if problem is None and context is None:
        # Not a marked error (a YAMLError raised with a plain message): its text, redacted.
        return redact_text(" ".join(redact_string(str(exc)).split()))
    words = [_QUOTED.sub(_short_quote, str(part)) for part in (context, problem) if part]
    if mark is not None:
        words.append(f"line {mark.line + 1}, column {mark.column + 1}")
    return redact_text(" ".join(", ".join(words).split()))


def _short_quote(match: re.Match[str]) -> str:
    """A quoted fragment of a YAML problem, kept when it cannot be a secret."""
    text = match.group(0)
    inner = text[1:-1]
    return text if len(inner) <= 2 or (inner.startswith("<") and inner.endswith(">")) else "'...'"
