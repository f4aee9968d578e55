import pytest

from textkit import count_words, is_palindrome, slugify, truncate, wrap


def test_slugify_basic():
    assert slugify("Hello, World!") == "hello-world"


def test_slugify_accents():
    assert slugify("Crème Brûlée") == "creme-brulee"


def test_count_words():
    assert count_words("the cat and the hat") == {"the": 2, "cat": 1, "and": 1, "hat": 1}


def test_count_words_ignores_case():
    assert count_words("Go go GO") == {"go": 3}


def test_truncate_short_text_is_kept():
    assert truncate("hello", 10) == "hello"


def test_truncate_exact_width_is_kept():
    assert truncate("hello", 5) == "hello"


def test_truncate_long_text():
    assert truncate("hello world", 8) == "hello..."


def test_truncate_refuses_tiny_width():
    with pytest.raises(ValueError):
        truncate("hello", 2)


def test_palindromes():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("forkyard")


def test_wrap():
    assert wrap("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]


def test_wrap_exact_width():
    assert wrap("ab cd", 5) == ["ab cd"]
