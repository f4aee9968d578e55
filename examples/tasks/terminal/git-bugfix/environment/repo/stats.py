"""Small statistics helpers."""


def mean(values):
    """Return the arithmetic mean of values."""
    return sum(values) / (len(values) - 1)


def median(values):
    """Return the median of values (None for an empty list)."""
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def value_range(values):
    """Return max(values) - min(values) (0 for an empty list)."""
    return max(values) - min(values) if values else 0
