"""Statistics over sequences of numbers."""

from collections import Counter


def mean(values):
    """Return the arithmetic mean; raise ValueError for an empty sequence."""
    values = list(values)
    if not values:
        raise ValueError("mean of an empty sequence")
    return sum(values) / len(values)


def median(values):
    """Return the median (the mean of the two middle values for an even count)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of an empty sequence")
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def mode(values):
    """Return the most common value; ties go to the value seen first."""
    values = list(values)
    if not values:
        raise ValueError("mode of an empty sequence")
    counts = Counter(values)
    best = max(counts.values())
    for value in values:
        if counts[value] == best:
            return value


def variance(values, *, sample=False):
    """Return the population variance (or the sample variance with sample=True)."""
    values = list(values)
    n = len(values)
    if n == 0 or (sample and n < 2):
        raise ValueError("not enough values for a variance")
    m = mean(values)
    total = sum((v - m) ** 2 for v in values)
    return total / (n - 1 if sample else n)
