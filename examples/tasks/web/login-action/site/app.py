"""A tiny mail app: a login form, cookie sessions and messages, all kept in SQLite (a restart keeps them)."""

import html
import http.server
import secrets
import sqlite3
import urllib.parse

DB = "mail.db"
USERS = {"mira": "orchid-42"}


def db() -> sqlite3.Connection:
    conn = sqlite3.connect(DB)
    conn.execute("CREATE TABLE IF NOT EXISTS message (id INTEGER PRIMARY KEY, title TEXT, archived INTEGER)")
    conn.execute("CREATE TABLE IF NOT EXISTS session (token TEXT PRIMARY KEY, user TEXT)")
    if not conn.execute("SELECT 1 FROM message").fetchone():
        conn.executemany("INSERT INTO message (title, archived) VALUES (?, 0)",
                         [("Lunch on Friday?",), ("Invoice overdue",), ("Your weekly digest",)])
        conn.commit()
    return conn


def page(title: str, body: str) -> bytes:
    return f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{title}</title></head>" \
           f"<body><h1>{title}</h1>{body}</body></html>".encode()


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def user(self):
        for part in self.headers.get("Cookie", "").split(";"):
            key, _, value = part.strip().partition("=")
            if key == "session":
                row = db().execute("SELECT user FROM session WHERE token = ?", (value,)).fetchone()
                if row:
                    return row[0]
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
        if self.path.startswith("/inbox"):
            if not self.user():
                return self.send(303, headers=[("Location", "/login")])
            rows = db().execute("SELECT id, title FROM message WHERE archived = 0 ORDER BY id").fetchall()
            items = "".join(
                f"<li>{html.escape(t)} <form method=post action=/archive style=display:inline>"
                f"<input type=hidden name=id value={i}><button bid=archive-{i} aria-label='Archive {html.escape(t)}'>"
                "Archive</button></form></li>" for i, t in rows)
            return self.send(200, page("Inbox", f"<p>Signed in as {self.user()}.</p><ul>{items or '<li>Empty</li>'}</ul>"))
        form = ("<form method=post action=/login><label>User <input name=user bid=user></label>"
                "<label>Password <input name=password type=password bid=password></label>"
                "<button bid=login>Log in</button></form>")
        error = "<p role=alert>Wrong user or password.</p>" if "failed" in self.path else ""
        return self.send(200, page("Sign in", error + form))

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        fields = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode()))
        if self.path == "/login":
            if USERS.get(fields.get("user", "")) == fields.get("password"):
                token = secrets.token_hex(16)
                conn = db()
                conn.execute("INSERT INTO session VALUES (?, ?)", (token, fields["user"]))
                conn.commit()
                return self.send(303, headers=[("Location", "/inbox"), ("Set-Cookie", f"session={token}; Path=/")])
            return self.send(303, headers=[("Location", "/login?failed")])
        if self.path == "/archive" and self.user():
            conn = db()
            conn.execute("UPDATE message SET archived = 1 WHERE id = ?", (fields.get("id"),))
            conn.commit()
            return self.send(303, headers=[("Location", "/inbox")])
        return self.send(403, page("Forbidden", "<p>Sign in first.</p>"))


if __name__ == "__main__":
    db().close()
    http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Handler).serve_forever()
