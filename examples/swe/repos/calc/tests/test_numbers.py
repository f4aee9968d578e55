import pytest

from calc import clamp, fibonacci, gcd, is_prime, lcm


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_below_and_above():
    assert clamp(-3, 0, 10) == 0
    assert clamp(42, 0, 10) == 10


def test_clamp_at_the_bounds():
    assert clamp(0, 0, 10) == 0
    assert clamp(10, 0, 10) == 10


def test_clamp_refuses_an_empty_range():
    with pytest.raises(ValueError):
        clamp(1, 5, 0)


def test_fibonacci_first_values():
    assert [fibonacci(n) for n in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]


def test_fibonacci_negative():
    with pytest.raises(ValueError):
        fibonacci(-1)


def test_gcd():
    assert gcd(12, 18) == 6
    assert gcd(7, 13) == 1


def test_gcd_of_negatives_is_positive():
    assert gcd(-12, 18) == 6


def test_lcm():
    assert lcm(4, 6) == 12
    assert lcm(0, 5) == 0


@pytest.mark.parametrize("n", [2, 3, 5, 7, 11, 13, 97])
def test_primes(n):
    assert is_prime(n)


@pytest.mark.parametrize("n", [0, 1, 4, 9, 25, 49, 100])
def test_non_primes(n):
    assert not is_prime(n)
