"""Small text helpers."""

from textkit.case import camel_to_snake, snake_to_camel, title_case
from textkit.text import count_words, is_palindrome, slugify, truncate, wrap

__all__ = ["camel_to_snake", "count_words", "is_palindrome", "slugify", "snake_to_camel", "title_case",
           "truncate", "wrap"]
