"""DATABASE_URL in libpq's multi-host forms becomes a URL SQLAlchemy accepts, and back."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import make_url

from outbox.core.conninfo import libpq_dsn, sqlalchemy_url

MULTI = "postgresql://idem:s3cret@pg-1:5432,pg-2:5433/idem?target_session_attrs=read-write"
KEY_VALUE = (
    "host=pg-1,pg-2 port=5432,5433 dbname=idem user=idem password=s3cret"
    " target_session_attrs=read-write"
)


@pytest.mark.parametrize("given", [MULTI, KEY_VALUE, MULTI.replace("postgresql", "postgres", 1)])
def test_each_multi_host_form_reaches_every_host_through_sqlalchemy(given: str) -> None:
    url = make_url(sqlalchemy_url(given))
    assert url.drivername == "postgresql+psycopg"
    assert (url.username, url.password, url.database) == ("idem", "s3cret", "idem")
    assert conninfo_to_dict(libpq_dsn(str(url.render_as_string(hide_password=False)))) == {
        "host": "pg-1,pg-2",
        "port": "5432,5433",
        "dbname": "idem",
        "user": "idem",
        "password": "s3cret",
        "target_session_attrs": "read-write",
    }


def test_hosts_without_ports_take_the_default_port() -> None:
    params = conninfo_to_dict(libpq_dsn(sqlalchemy_url("postgresql://idem@pg-1,pg-2/idem")))
    assert params["host"] == "pg-1,pg-2"
    assert params.get("port", "").replace(",", "") == ""


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u:p@db:5432/idem", "postgresql+psycopg://u:p@db:5432/idem"),
        ("postgres://u@db/idem?sslmode=require", "postgresql+psycopg://u@db/idem?sslmode=require"),
        ("postgresql+psycopg://u@db/idem", "postgresql+psycopg://u@db/idem"),
    ],
)
def test_a_one_host_url_keeps_its_form(given: str, expected: str) -> None:
    assert sqlalchemy_url(given) == expected


def test_a_one_host_url_keeps_its_options_for_libpq() -> None:
    params = conninfo_to_dict(
        libpq_dsn("postgresql+psycopg://u:p%40x@db:6432/idem?sslmode=require")
    )
    assert params == {
        "host": "db",
        "port": "6432",
        "dbname": "idem",
        "user": "u",
        "password": "p@x",
        "sslmode": "require",
    }
