"""Reward 1 when exactly the "Invoice overdue" message is archived."""

import sqlite3

rows = dict(sqlite3.connect("mail.db").execute("SELECT title, archived FROM message").fetchall())
print(1 if rows.get("Invoice overdue") == 1 and sum(rows.values()) == 1 else 0)
