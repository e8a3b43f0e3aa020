"""DATABASE_URL in each form libpq accepts, turned into what each consumer needs.

A highly available PostgreSQL (Patroni, a managed database's replicas) is reached through
libpq's multi-host form: a URL with several hosts (`postgresql://u@a:5432,b:5432/db?...`) or
key/value pairs (`host=a,b port=5432,5432 dbname=db ...`), with
`target_session_attrs=read-write` so that every new connection lands on the primary, whichever
node that is now. SQLAlchemy's URL parser refuses several hosts in the netloc (it reads the
port as a number), so such a URL is rewritten into SQLAlchemy's own multi-host form
(`?host=a,b&port=5432,5432`), which its psycopg dialect hands back to libpq unchanged. The
plain one-host URL keeps the form it was given in.
"""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import URL, make_url

DRIVER = "postgresql+psycopg"
_SCHEMES = ("postgres://", "postgresql://")


def sqlalchemy_url(url: str) -> str:
    """Accept `postgres://`, `postgresql://` (one host or several), libpq's key/value form,
    or a full SQLAlchemy URL, and name psycopg 3."""
    if "://" not in url and "=" in url:
        return _from_conninfo(url)
    for scheme in _SCHEMES:
        if url.startswith(scheme):
            rest = url[len(scheme) :]
            netloc = rest.split("/", 1)[0].split("?", 1)[0]
            if "," in netloc:
                return _from_conninfo(url)
            return f"{DRIVER}://{rest}"
    return url


def _from_conninfo(conninfo: str) -> str:
    """A SQLAlchemy URL for any libpq connection string (libpq itself parses it)."""
    params = conninfo_to_dict(conninfo)
    user = params.pop("user", None)
    password = params.pop("password", None)
    dbname = params.pop("dbname", None)
    # Hosts given without ports: libpq reports one empty port per host; the default applies.
    if not str(params.get("port", "")).replace(",", ""):
        params.pop("port", None)
    return URL.create(
        DRIVER,
        username=str(user) if user is not None else None,
        password=str(password) if password is not None else None,
        database=str(dbname) if dbname is not None else None,
        query={key: str(value) for key, value in params.items()},
    ).render_as_string(hide_password=False)


def libpq_dsn(url: str) -> str:
    """The same database as a libpq connection string (for a plain psycopg connection, such
    as the relay's LISTEN): every host, port and option the engine would use."""
    _, params = PGDialect_psycopg().create_connect_args(make_url(sqlalchemy_url(url)))  # type: ignore[no-untyped-call]
    return make_conninfo("", **{key: str(value) for key, value in params.items()})
