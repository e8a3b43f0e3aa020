"""Signed-out console sessions, kept until they would have expired (table revoked_sessions).

The statements take the SHA-256 of the cookie value, never the value itself.
"""

from __future__ import annotations

import hashlib

from sqlalchemy import Engine, TextClause, text

# Records one signed-out session; a repeat sign-out changes nothing.
REVOKE_SESSION: TextClause = text(
    """
    INSERT INTO revoked_sessions (session_hash, expires_at)
    VALUES (:session_hash, to_timestamp(:expires_at))
    ON CONFLICT (session_hash) DO NOTHING
    """
)

# Forgets sessions past their expiry (their cookies are refused by the signature check anyway);
# run at each sign-out, so the table holds only live revocations.
PURGE_EXPIRED_REVOCATIONS: TextClause = text(
    "DELETE FROM revoked_sessions WHERE expires_at < now()"
)

# Whether a session was signed out.
IS_REVOKED: TextClause = text(
    "SELECT EXISTS (SELECT 1 FROM revoked_sessions WHERE session_hash = :session_hash)"
)


def session_hash(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def revoke(engine: Engine, value: str, expires_at: int) -> None:
    """Refuse this session from now on, in every receiver process."""
    with engine.begin() as conn:
        conn.execute(PURGE_EXPIRED_REVOCATIONS)
        conn.execute(
            REVOKE_SESSION, {"session_hash": session_hash(value), "expires_at": expires_at}
        )


def is_revoked(engine: Engine, value: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(IS_REVOKED, {"session_hash": session_hash(value)}).scalar())
