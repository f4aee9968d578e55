#!/bin/bash
# Oracle for sqlite-revenue: write the query, then show its result with Python's sqlite3.
set -euo pipefail
cat > /app/query.sql <<'SQL'
SELECT c.name AS name, SUM(o.amount_cents) AS total_cents
FROM customers AS c
JOIN orders AS o ON o.customer_id = c.id
WHERE c.country = 'DE'
  AND o.status = 'paid'
  AND o.created_at BETWEEN '2023-01-01' AND '2023-12-31'
GROUP BY c.id, c.name
ORDER BY total_cents DESC, name;
SQL
python3 -c '
import sqlite3
db = sqlite3.connect("file:/app/shop.db?mode=ro", uri=True)
for row in db.execute(open("/app/query.sql").read()):
    print(*row)
'
