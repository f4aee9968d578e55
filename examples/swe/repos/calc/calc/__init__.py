"""Small arithmetic and statistics helpers."""

from calc.numbers import clamp, fibonacci, gcd, is_prime, lcm
from calc.stats import mean, median, mode, variance

__all__ = ["clamp", "fibonacci", "gcd", "is_prime", "lcm", "mean", "median", "mode", "variance"]
