"""Stop strings: find the one the newest text completed, and how much text is safe to stream.

Text grows by a delta per step. A stop string that ends inside the delta may start before it (it
can span token boundaries), so the search window for a stop string ``s`` starts
``len(s) - 1`` characters before the delta. Anything that ended earlier was found at an earlier
step, so the window never needs to reach further back. Of all the matches in the window the one
that starts earliest wins (ties: the one listed first in ``stop``).

A streaming engine must not release text that may turn out to be the start of a stop string
(it would be cut later): ``safe_text_len`` holds back the longest suffix of the text that is a
prefix of some stop string.
"""

from __future__ import annotations


def find_stop(text: str, new_text_len: int, stop: list[str], include_stop_str_in_output: bool) -> tuple[str | None, int]:
    """The stop string completed by the last ``new_text_len`` characters of ``text``, if any.

    Returns ``(stop_string, cut)`` where ``text[:cut]`` is the output to keep: the text before the
    match, or through its end when ``include_stop_str_in_output``. Without a match returns
    ``(None, len(text))``.
    """
    if new_text_len < 0:
        raise ValueError(f"new_text_len must be >= 0, got {new_text_len}")
    best: str | None = None
    best_start = len(text)
    delta_start = len(text) - min(new_text_len, len(text))
    for s in stop:
        if not s:
            raise ValueError("stop must not contain empty strings")
        window_start = max(0, delta_start - len(s) + 1)
        start = text.find(s, window_start)
        if start != -1 and start < best_start:
            best, best_start = s, start
    if best is None:
        return None, len(text)
    return best, best_start + len(best) if include_stop_str_in_output else best_start


def safe_text_len(text: str, stop: list[str]) -> int:
    """How many leading characters of ``text`` can be streamed now.

    Holds back the longest suffix of ``text`` that is a prefix of some stop string (a complete
    stop string included): later text could complete it and the output would be cut there.
    """
    held = 0
    for s in stop:
        for k in range(min(len(s), len(text)), held, -1):  # longest first; shorter than held: no use
            if text.endswith(s[:k]):
                held = k
                break
    return len(text) - held
