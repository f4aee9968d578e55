"""Reward 1 for exactly one order of two Blue mugs and one Green tea."""

import sqlite3

conn = sqlite3.connect("shop.db")
orders = conn.execute("SELECT id FROM orders").fetchall()
lines = dict(conn.execute("SELECT product, qty FROM order_line").fetchall()) if len(orders) == 1 else {}
print(1 if lines == {"mug-blue": 2, "tea-green": 1} else 0)
