"""Create the shop database with fixed, deterministic rows."""

import sqlite3
import sys

CUSTOMERS = [
    (1, "Anna Schmidt", "DE"), (2, "Ben Meyer", "DE"), (3, "Chloe Martin", "FR"),
    (4, "Dieter Braun", "DE"), (5, "Emma Wilson", "GB"), (6, "Felix Wagner", "DE"),
    (7, "Greta Hoffmann", "DE"), (8, "Hugo Laurent", "FR"), (9, "Ida Becker", "DE"),
]


def orders():
    order_id = 0
    statuses = ["paid", "paid", "paid", "refunded", "pending"]
    for customer_id, _, _ in CUSTOMERS:
        for k in range(2 + customer_id % 5):
            order_id += 1
            year = 2022 + (order_id * 7 + k) % 3
            month = 1 + (order_id * 5) % 12
            day = 1 + (order_id * 11) % 28
            amount = 500 + (order_id * 7919 + customer_id * 104729) % 20000
            status = statuses[(order_id + customer_id) % len(statuses)]
            yield order_id, customer_id, amount, status, f"{year}-{month:02d}-{day:02d}"


def main(path: str) -> None:
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT NOT NULL);
        CREATE TABLE orders (
            id INTEGER PRIMARY KEY,
            customer_id INTEGER NOT NULL REFERENCES customers(id),
            amount_cents INTEGER NOT NULL,
            status TEXT NOT NULL,
            created_at TEXT NOT NULL
        );
        """
    )
    db.executemany("INSERT INTO customers VALUES (?, ?, ?)", CUSTOMERS)
    db.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)", list(orders()))
    db.commit()
    db.close()


if __name__ == "__main__":
    main(sys.argv[1])
