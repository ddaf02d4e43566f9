"""Final-answer extraction: the content of the last \\boxed{...} in a response.

The DAPO/STAPO rule verifier scores only what the model put in its final box, so a response
without one has no answer (never a guess from the last number in the text).
"""

from __future__ import annotations

import re

# \boxed{..}, \fbox{..}, and the brace-less "\boxed 5" form; \boxed must not be a prefix of a
# longer command (\boxedx is not a box).
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# what an evaluation protocol records of the extraction (eval/protocol.py): bump the version
# whenever a response could extract differently, so numbers before and after never share a table
EXTRACTION = {"rule": "content of the last \\boxed{} or \\fbox{} (brace-less \\boxed 5 too), no fallback",
              "version": 1}


def _balanced(text: str, start: int) -> str | None:
    """Content of the brace group opening at text[start] == '{', or None if never closed."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # escaped brace (\{ \}) is content, not structure
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def _box_content(text: str, end: int) -> str | None:
    """What follows a box command ending at `end`: a brace group or a bare token."""
    i = end
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        return _balanced(text, i)
    if end < len(text) and text[end] == " ":
        # "\boxed 5": the token up to whitespace or the end of math mode
        m = re.match(r"[^\s$]+", text[i:])
        if m:
            return m.group(0).rstrip(".,;")
    return None


def extract_answer(response: str) -> str | None:
    """Content of the last well-formed \\boxed{...} (or \\fbox{...}, "\\boxed 5"); None if none.

    An empty box yields "" (a box, but no answer): callers treat it as incorrect.
    An unclosed last box (a truncated response) is skipped in favour of an earlier closed one.
    """
    if not response:
        return None
    for match in reversed(list(_BOX.finditer(response))):
        content = _box_content(response, match.end())
        if content is not None:
            return content.strip()
    return None
