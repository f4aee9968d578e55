import pytest

from calc import mean, median, mode, variance


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_of_nothing():
    with pytest.raises(ValueError):
        mean([])


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_mode_ties_go_to_the_first_seen():
    assert mode([3, 1, 1, 3, 2]) == 3


def test_mode_single():
    assert mode([5]) == 5


def test_population_variance():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9]) == 4


def test_sample_variance():
    assert variance([1, 2, 3, 4], sample=True) == pytest.approx(1.6666666666666667)


@pytest.mark.skipif(True, reason="kept to show how skipped tests are graded")
def test_variance_of_generators():
    assert variance(x for x in [1, 2, 3]) == pytest.approx(2 / 3)
