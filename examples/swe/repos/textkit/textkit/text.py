"""Helpers over whole strings."""

import re
import unicodedata


def slugify(text):
    """Return a lowercase, dash-separated ASCII slug of text."""
    normalized = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    words = re.findall(r"[a-z0-9]+", normalized.lower())
    return "-".join(words)


def count_words(text):
    """Return how many times each lowercased word occurs, as a dict."""
    counts = {}
    for word in re.findall(r"[a-z']+", text.lower()):
        counts[word] = counts.get(word, 0) + 1
    return counts


def truncate(text, width, *, ellipsis="..."):
    """Return text cut to at most width characters, ending with ellipsis when cut."""
    if width < len(ellipsis):
        raise ValueError("width is smaller than the ellipsis")
    if len(text) <= width:
        return text
    return text[: width - len(ellipsis)] + ellipsis


def is_palindrome(text):
    """Tell whether text reads the same backwards, ignoring case, spaces and punctuation."""
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]


def wrap(text, width):
    """Split text into lines of at most width characters, breaking between words."""
    if width < 1:
        raise ValueError("width must be positive")
    lines, current = [], ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines
