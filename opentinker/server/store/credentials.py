"""The store's users, API keys (hashed) and dashboard sessions."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentinker.server.store.records import KEY_USE_RESOLUTION_S, ApiKeyInfo, DashboardSession, User


class CredentialTables:
    """Users, API keys and dashboard sessions: a part of :class:`~opentinker.server.store.Store`
    (its connection, lock and transactions)."""

    # Called with (user, key prefix) at a key's first use in each UTC hour (the audit log's key_use).
    on_key_use: Callable[[User, str], None] | None = None

    # users and keys -------------------------------------------------------------------

    def create_user(self, name: str) -> User:
        """Raises ValueError when the name is taken."""
        now = time.time()
        try:
            with self._transaction() as conn:
                cur = conn.execute("INSERT INTO users (name, created_at) VALUES (?, ?)", (name, now))
        except sqlite3.IntegrityError as exc:
            raise ValueError(f"user {name!r} already exists") from exc
        return User(id=int(cur.lastrowid), name=name, created_at=now)

    def get_user(self, name: str) -> User | None:
        rows = self._query("SELECT id, name, created_at, is_admin FROM users WHERE name = ?", (name,))
        return _user(rows[0]) if rows else None

    def user_by_id(self, user_id: int) -> User | None:
        rows = self._query("SELECT id, name, created_at, is_admin FROM users WHERE id = ?", (user_id,))
        return _user(rows[0]) if rows else None

    def set_admin(self, name: str, is_admin: bool) -> bool:
        """Make the user an admin (or not); False if there is no such user."""
        with self._transaction() as conn:
            cur = conn.execute("UPDATE users SET is_admin = ? WHERE name = ?", (int(is_admin), name))
        return cur.rowcount > 0

    def list_users(self) -> list[tuple[User, int]]:
        """Every user with the number of its active keys."""
        rows = self._query(
            "SELECT u.id, u.name, u.created_at, u.is_admin, "
            "(SELECT COUNT(*) FROM api_keys k WHERE k.user_id = u.id AND k.revoked = 0) AS active_keys "
            "FROM users u ORDER BY u.name"
        )
        return [(_user(r), r["active_keys"]) for r in rows]

    def add_api_key(self, user: User, key_hash: str, prefix: str) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO api_keys (user_id, key_hash, prefix, created_at) VALUES (?, ?, ?, ?)",
                (user.id, key_hash, prefix, time.time()),
            )

    def user_for_key_hash(self, key_hash: str) -> User | None:
        """The owner of the (unrevoked) key of ``key_hash``; notes when the key was last used."""
        rows = self._query(
            "SELECT u.id, u.name, u.created_at, u.is_admin, k.id AS key_id, k.prefix, k.last_used_at FROM api_keys k "
            "JOIN users u ON u.id = k.user_id WHERE k.key_hash = ? AND k.revoked = 0",
            (key_hash,),
        )
        if not rows:
            return None
        row, now, last = rows[0], time.time(), rows[0]["last_used_at"]
        new_hour = last is None or int(last // 3600) != int(now // 3600)
        # A write at most once a minute per key (and at a new hour), not one per request.
        if new_hour or now - last >= KEY_USE_RESOLUTION_S:
            with self._transaction() as conn:
                conn.execute("UPDATE api_keys SET last_used_at = ? WHERE id = ?", (now, row["key_id"]))
        if new_hour and self.on_key_use is not None:
            self.on_key_use(_user(row), row["prefix"])
        return _user(row)

    def list_api_keys(self, user: User | None = None, key_hash: str | None = None) -> list[ApiKeyInfo]:
        """Every key (or ``user``'s, or the one of ``key_hash``), oldest first."""
        sql = (
            "SELECT k.id, u.name AS user_name, k.prefix, k.created_at, k.revoked, k.last_used_at "
            "FROM api_keys k JOIN users u ON u.id = k.user_id WHERE 1"
        )
        params: list[Any] = []
        if user is not None:
            sql += " AND k.user_id = ?"
            params.append(user.id)
        if key_hash is not None:
            sql += " AND k.key_hash = ?"
            params.append(key_hash)
        rows = self._query(sql + " ORDER BY k.id", params)
        return [ApiKeyInfo(**{**dict(r), "revoked": bool(r["revoked"])}) for r in rows]

    def revoke_api_key(self, key_hash: str) -> bool:
        """Revoke the key; its dashboard sessions end with it."""
        rows = self._query("SELECT id FROM api_keys WHERE key_hash = ?", (key_hash,))
        return bool(rows) and self.revoke_api_key_id(rows[0]["id"])

    def revoke_api_key_id(self, key_id: int) -> bool:
        """Revoke the key with this id (``list_api_keys``); False if there is none or it was
        revoked already. Its dashboard sessions end with it."""
        with self._transaction() as conn:
            cur = conn.execute("UPDATE api_keys SET revoked = 1 WHERE id = ? AND revoked = 0", (key_id,))
            conn.execute("DELETE FROM dashboard_sessions WHERE api_key_id = ?", (key_id,))
        return cur.rowcount > 0

    # dashboard sessions ---------------------------------------------------------------

    def create_session(self, key_hash: str, token_hash: str, ttl_s: float) -> DashboardSession | None:
        """A browser session for the (unrevoked) key of ``key_hash``, found by ``token_hash``
        for ``ttl_s`` seconds; None for an unknown or revoked key. Expired rows go meanwhile."""
        now = time.time()
        with self._transaction() as conn:
            conn.execute("DELETE FROM dashboard_sessions WHERE expires_at <= ?", (now,))
            cur = conn.execute(
                "INSERT INTO dashboard_sessions (token_hash, user_id, api_key_id, created_at, expires_at) "
                "SELECT ?, user_id, id, ?, ? FROM api_keys WHERE key_hash = ? AND revoked = 0",
                (token_hash, now, now + ttl_s, key_hash),
            )
        return self.session(token_hash) if cur.rowcount else None

    def session(self, token_hash: str) -> DashboardSession | None:
        """The live session of ``token_hash``: not expired, its API key not revoked."""
        rows = self._query(
            "SELECT u.id, u.name, u.created_at AS user_created_at, u.is_admin, k.prefix, s.created_at, s.expires_at "
            "FROM dashboard_sessions s JOIN api_keys k ON k.id = s.api_key_id JOIN users u ON u.id = s.user_id "
            "WHERE s.token_hash = ? AND s.expires_at > ? AND k.revoked = 0",
            (token_hash, time.time()),
        )
        if not rows:
            return None
        r = rows[0]
        return DashboardSession(user=User(r["id"], r["name"], r["user_created_at"], bool(r["is_admin"])),
                                key_prefix=r["prefix"], created_at=r["created_at"], expires_at=r["expires_at"])

    def ended_credentials(self, key_hashes: Sequence[str], token_hashes: Sequence[str]) -> tuple[set[str], set[str]]:
        """Of ``key_hashes`` those whose key is revoked (or unknown), and of ``token_hashes``
        those whose dashboard session has ended (logged out, expired, its key revoked)."""
        live_keys: set[str] = set()
        live_sessions: set[str] = set()
        now = time.time()
        for start in range(0, len(key_hashes), 500):  # SQLite's limit on parameters is 999 in old builds
            chunk = list(key_hashes[start:start + 500])
            rows = self._query(f"SELECT key_hash FROM api_keys WHERE revoked = 0 AND key_hash IN "
                               f"({', '.join('?' * len(chunk))})", chunk)
            live_keys.update(row["key_hash"] for row in rows)
        for start in range(0, len(token_hashes), 500):
            chunk = list(token_hashes[start:start + 500])
            rows = self._query(f"SELECT s.token_hash FROM dashboard_sessions s JOIN api_keys k ON k.id = s.api_key_id "
                               f"WHERE s.expires_at > ? AND k.revoked = 0 AND s.token_hash IN "
                               f"({', '.join('?' * len(chunk))})", [now, *chunk])
            live_sessions.update(row["token_hash"] for row in rows)
        return set(key_hashes) - live_keys, set(token_hashes) - live_sessions

    def delete_session(self, token_hash: str) -> bool:
        with self._transaction() as conn:
            cur = conn.execute("DELETE FROM dashboard_sessions WHERE token_hash = ?", (token_hash,))
        return cur.rowcount > 0


def _user(row: sqlite3.Row) -> User:
    return User(id=row["id"], name=row["name"], created_at=row["created_at"], is_admin=bool(row["is_admin"]))
