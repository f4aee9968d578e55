"""Converting between naming styles."""

import re

_SMALL_WORDS = {"a", "an", "and", "of", "the", "in", "on", "to"}


def camel_to_snake(name):
    """Return camelCase or PascalCase name in snake_case."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return spaced.lower()


def snake_to_camel(name, *, upper_first=False):
    """Return snake_case name in camelCase (PascalCase with upper_first=True)."""
    parts = [p for p in name.split("_") if p]
    if not parts:
        return ""
    first = parts[0].capitalize() if upper_first else parts[0].lower()
    return first + "".join(p.capitalize() for p in parts[1:])


def title_case(text):
    """Capitalize each word but the small ones (always capitalizing the first)."""
    words = text.split()
    out = []
    for i, word in enumerate(words):
        if i > 0 and word.lower() in _SMALL_WORDS:
            out.append(word.lower())
        else:
            out.append(word[:1].upper() + word[1:].lower())
    return " ".join(out)
