"""A small shop: products, a cart per cookie and orders, kept in SQLite; checked server-side."""

import html
import http.server
import secrets
import sqlite3
import urllib.parse

DB = "shop.db"
PRODUCTS = [("mug-blue", "Blue mug", 8.0), ("mug-red", "Red mug", 8.0), ("tea-green", "Green tea", 5.5),
            ("tea-black", "Black tea", 5.0)]


def db() -> sqlite3.Connection:
    conn = sqlite3.connect(DB)
    conn.executescript("""
        CREATE TABLE IF NOT EXISTS cart (cart TEXT, product TEXT, qty INTEGER, PRIMARY KEY (cart, product));
        CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, cart TEXT);
        CREATE TABLE IF NOT EXISTS order_line (order_id INTEGER, product TEXT, qty INTEGER);
    """)
    return conn


def page(title: str, body: str) -> bytes:
    nav = "<nav><a href=/ bid=nav-shop>Shop</a> <a href=/cart bid=nav-cart>Cart</a></nav>"
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{title}</title></head>"
            f"<body>{nav}<h1>{title}</h1>{body}</body></html>").encode()


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def cart_id(self):
        for part in self.headers.get("Cookie", "").split(";"):
            key, _, value = part.strip().partition("=")
            if key == "cart" and value:
                return value
        return None

    def send(self, status, body=b"", headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/cart":
            lines = db().execute("SELECT product, qty FROM cart WHERE cart = ? ORDER BY product",
                                 (self.cart_id() or "",)).fetchall()
            names = {p: n for p, n, _ in PRODUCTS}
            items = "".join(f"<li>{q} × {html.escape(names[p])}</li>" for p, q in lines) or "<li>Empty</li>"
            checkout = ("<form method=post action=/checkout><button bid=checkout>Check out</button></form>"
                        if lines else "")
            return self.send(200, page("Your cart", f"<ul>{items}</ul>{checkout}"))
        if self.path.startswith("/done"):
            return self.send(200, page("Thank you", "<p role=status>Your order is placed.</p>"))
        cards = "".join(
            f"<li>{html.escape(name)}, ${price:.2f} <form method=post action=/add style=display:inline>"
            f"<input type=hidden name=product value={pid}>"
            f"<button bid=add-{pid} aria-label='Add {html.escape(name)} to cart'>Add to cart</button></form></li>"
            for pid, name, price in PRODUCTS)
        return self.send(200, page("Shop", f"<ul>{cards}</ul>"))

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        fields = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode()))
        cart = self.cart_id() or secrets.token_hex(8)
        conn = db()
        if self.path == "/add" and fields.get("product") in {p for p, _, _ in PRODUCTS}:
            conn.execute("INSERT INTO cart VALUES (?, ?, 1) ON CONFLICT (cart, product) DO UPDATE SET qty = qty + 1",
                         (cart, fields["product"]))
            conn.commit()
            return self.send(303, headers=[("Location", "/"), ("Set-Cookie", f"cart={cart}; Path=/")])
        if self.path == "/checkout":
            lines = conn.execute("SELECT product, qty FROM cart WHERE cart = ?", (cart,)).fetchall()
            if lines:
                order = conn.execute("INSERT INTO orders (cart) VALUES (?)", (cart,)).lastrowid
                conn.executemany("INSERT INTO order_line VALUES (?, ?, ?)", [(order, p, q) for p, q in lines])
                conn.execute("DELETE FROM cart WHERE cart = ?", (cart,))
                conn.commit()
            return self.send(303, headers=[("Location", "/done")])
        return self.send(400, page("Bad request", ""))


if __name__ == "__main__":
    db().close()
    http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Handler).serve_forever()
