"""Run /app/query.sql and a reference query against a read-only shop.db and compare."""

import sqlite3
import sys
from pathlib import Path

REFERENCE = """
SELECT c.name AS name, SUM(o.amount_cents) AS total_cents
FROM customers AS c JOIN orders AS o ON o.customer_id = c.id
WHERE c.country = 'DE' AND o.status = 'paid' AND o.created_at >= '2023-01-01' AND o.created_at < '2024-01-01'
GROUP BY c.id
ORDER BY total_cents DESC, name
"""


def main() -> int:
    query_file = Path("/app/query.sql")
    if not query_file.is_file():
        print("FAIL: /app/query.sql does not exist")
        return 1
    db = sqlite3.connect("file:/app/shop.db?mode=ro", uri=True)
    try:
        cursor = db.execute(query_file.read_text().strip().rstrip(";"))
        got_columns = [d[0].lower() for d in cursor.description or []]
        got = cursor.fetchall()
    except sqlite3.Error as exc:
        print(f"FAIL: the query does not run: {exc}")
        return 1
    want = db.execute(REFERENCE).fetchall()
    if len(want) < 3:
        print("FAIL: the database was modified")
        return 1
    if got_columns != ["name", "total_cents"]:
        print(f"FAIL: columns are {got_columns}, want ['name', 'total_cents']")
        return 1
    if got != want:
        print(f"FAIL: rows differ\ngot:  {got}\nwant: {want}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
