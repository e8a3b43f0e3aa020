"""Configuration from the environment, built by a factory so tests can point at their own servers.

Every knob has a default that runs on a laptop; docs/gen/descriptions.toml says what each does
(the docs site's settings reference, generated from this model).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox.core.conninfo import sqlalchemy_url


class Settings(BaseSettings):
    """The gateway's settings; environment variables are the upper-case field names."""

    model_config = SettingsConfigDict(env_file=None, extra="ignore", frozen=True)

    # Where state lives. Empty means "start embedded servers" under `idem dev`. One host, or
    # libpq's multi-host form with target_session_attrs=read-write for a replicated PostgreSQL
    # (outbox/core/conninfo.py): new connections then find the primary after a failover.
    database_url: str = ""
    # How DATABASE_URL reaches PostgreSQL: `session` (PostgreSQL itself, or a pooler in session
    # mode) or `transaction` (PgBouncer in transaction mode: a server connection per
    # transaction). In `transaction` mode nothing is prepared, the statement timeout is the
    # pooler's or the role's (PgBouncer passes no startup option), and what needs a session of
    # its own (the relay's LISTEN, the sweeper's lock, migrations) uses DATABASE_DIRECT_URL.
    database_pool_mode: Literal["session", "transaction"] = "session"
    # PostgreSQL itself, for the parts that need a session when DATABASE_URL is a transaction
    # pool; unset, DATABASE_URL.
    database_direct_url: str = ""
    # The broker: redis:// (Redis) or amqp:// (RabbitMQ), outbox/core/broker.py. Unset, the
    # broker is REDIS_URL's Redis (the setting of before BROKER_URL).
    broker_url: str = ""
    redis_url: str = ""
    data_dir: Path = Path(".idem")

    routes_file: Path | None = None

    # The receiver.
    host: str = "127.0.0.1"
    port: int = 8000
    # 1 MiB: large enough for any webhook body we have seen, small enough to refuse abuse early.
    max_body_bytes: int = Field(default=1_048_576, gt=0)
    # Told to callers in Retry-After when the database is unreachable.
    unavailable_retry_after: int = Field(default=2, ge=1)
    # A request never waits longer than this for a connection or a statement, so a dead
    # database yields a quick 503 instead of a hang.
    db_timeout_seconds: float = Field(default=3.0, gt=0)
    # The receiver's connections, all opened on demand and kept: a fixed pool, because
    # connections opened for a burst and closed after it cost a server process each.
    db_pool_size: int = Field(default=20, ge=1)
    # Connections, bounded before the app sees them (outbox/core/connections.py). A request's
    # headers must arrive within this long of its first byte (of the connection's opening,
    # for the first request): any real client sends them in one packet; a slow sender is
    # cut off instead of holding a connection for as long as it likes.
    header_read_timeout_seconds: float = Field(default=10.0, gt=0)
    # A request's line, headers and body must all arrive within this long of its first byte
    # (nginx's client_body_timeout, Envoy's request_timeout): a 1 MiB body needs 18 KiB/s.
    request_timeout_seconds: float = Field(default=60.0, gt=0)
    # Once its headers are in, a body must keep arriving at this many bytes a second, judged
    # over each BODY_RATE_WINDOW_SECONDS (the first window is its grace): a sender trickling a
    # byte every few seconds is cut off within a window, not at the whole-request deadline.
    # 1 KiB/s is far below any real client, even on a poor mobile link.
    min_body_rate_bytes: int = Field(default=1024, ge=0)
    body_rate_window_seconds: float = Field(default=5.0, gt=0)
    # Open connections served at once per receiver process; a request on one more is answered
    # 503 server_busy. A proxy in front reuses tens of connections; 512 leaves room for the
    # database pool and the logs under a 1 024 open-file limit.
    max_connections: int = Field(default=512, ge=1)
    # An idle keep-alive connection is closed after this long (uvicorn's default); a proxy in
    # front must close its idle upstream connections sooner.
    keep_alive_seconds: float = Field(default=5.0, gt=0)
    # The reverse proxies whose X-Forwarded-For is trusted (addresses or networks, comma-
    # separated): the client address that the throttle, logs and loopback checks use. Never
    # `*`: a client could then name any address, 127.0.0.1 included.
    forwarded_allow_ips: str = "127.0.0.1"

    # The relay. Polling is the fallback for a lost NOTIFY; one second bounds the extra latency.
    relay_poll_seconds: float = Field(default=1.0, gt=0)
    # Rows locked and published per transaction: large enough to amortise the round trips,
    # small enough that a crash re-publishes little.
    relay_batch_size: int = Field(default=500, ge=1, le=10_000)
    # How long a relay holds the rows it took before another relay may take them: far above
    # one publish (bounded by broker_timeout_seconds), short enough that rows of a relay
    # killed mid-publish wait half a minute, not until someone notices.
    relay_claim_seconds: float = Field(default=30.0, gt=0)
    # Deliveries due together travel in one message of up to this many keys: they share the
    # worker's per-message cost and one claim statement, each key still its own attempt (a
    # worker's attempts in flight stay within its concurrency: worker/slots.py). 1: one key
    # per message (an event's fanned-out deliveries still travel together). An event's
    # deliveries are never split, so 12 fills with whole events of two, three, four or six
    # destinations (8 would carry two events of three: six keys).
    relay_keys_per_message: int = Field(default=12, ge=1, le=64)
    # After a pass that published rows (and did not fill its batch), the relay waits this
    # long before it looks again, so that rows accepted meanwhile share messages and the
    # worker's statements (outbox/relay/loop.py, gather_wait). A row that comes while the
    # relay idles goes out at once; one accepted within this after a publish waits at most
    # this long. 0: the next pass at once (each pass then takes what came during the last).
    relay_gather_seconds: float = Field(default=0.01, ge=0, le=1)
    # Several relays: one leads and publishes, the others stand by and check every third of
    # this; the lead is renewed that often and passes to a standby this long after its holder
    # died or stopped publishing (at once when it stops). 0: every relay publishes, each woken
    # by every NOTIFY (safe, but each extra relay repeats the same statements).
    relay_lead_seconds: float = Field(default=10.0, ge=0)
    # Pacing: once the rows a relay takes have waited longer than relay_backlog_age_seconds
    # (a backlog after an outage, not fresh events), it publishes at most relay_backlog_rate
    # rows per second and leaves the rest of the CPU to the receivers. Workers take a few
    # hundred events per second per host, so a faster drain only moves the backlog from the
    # database into Redis. 0 publishes as fast as the relay can.
    relay_backlog_rate: float = Field(default=2000.0, ge=0)
    relay_backlog_age_seconds: float = Field(default=5.0, ge=0)
    # A publish (socket connect, send, answer) never waits longer than this for the broker;
    # then the relay backs off and the rows stay due.
    broker_timeout_seconds: float = Field(default=5.0, gt=0)

    # The worker. A lease long enough for a slow CRM call, short enough that a crashed
    # worker's key is recovered within a minute.
    lease_seconds: int = Field(default=30, ge=1)
    # How a worker runs attempts. `threads`: many attempts in flight per process, for actions
    # that spend their time waiting on a downstream (http); `prefork`: one process per attempt,
    # for python actions that need process isolation (a crash takes only its own attempt).
    worker_pool: Literal["threads", "prefork"] = "threads"
    # Messages in flight per worker (a fan-out event's message runs one attempt per destination,
    # each in a thread of its own): threads per process, or processes under prefork. Unset:
    # 128 threads (a 1 s downstream then allows ~128 attempts/s per process; the database
    # pool does not grow with it), or 2 processes.
    worker_concurrency: int | None = Field(default=None, ge=1)
    # Connections each worker process (each prefork child) keeps for claims, finishes and lease
    # renewals: statements of about a millisecond, so a few serve dozens of attempts in flight.
    worker_db_pool_size: int = Field(default=4, ge=1, le=50)
    # How long Redis keeps an unacknowledged message before giving it to another worker; far
    # above any lease so a running task is not handed out twice. Not used with RabbitMQ, which
    # gives a message back only when the connection of the worker holding it ends.
    visibility_timeout: int = Field(default=3600, ge=1)
    # Celery task events (task-received, -started, -succeeded) sent by every worker from the
    # start. Off by default: each is a synchronous PUBLISH in the worker's main process, about a
    # third of its CPU per task. Flower turns them on by itself while it runs (its
    # enable_events option), so watching the workers needs nothing here.
    worker_task_events: bool = False
    # The worker's Celery node name (`%h`: the host's name). Unset: `idem-<pid>@<host>`, one
    # per process, since on RabbitMQ a name's control queue belongs to one connection: a
    # second worker started with a running one's name stops at once (`worker.name_in_use`,
    # exit 75), while a running worker whose old connection still holds it after a reconnect
    # goes on (worker/control.py). Set it where a healthcheck pings the worker by name
    # (compose: `idem@%h`, one worker per container).
    worker_name: str = ""

    # The sweeper: how often it looks, and how long a key may wait on a published message
    # before the message is presumed lost (Redis restarted or flushed) and re-sent. Longer
    # than a busy queue's wait, short enough that a lost message costs a minute, not a day.
    sweep_interval_seconds: float = Field(default=5.0, gt=0)
    sweep_grace_seconds: float = Field(default=60.0, ge=0)
    sweep_batch_size: int = Field(default=500, ge=1)

    # Keys older than their route's TTL are purged by the sweeper; published outbox rows are
    # kept this long (a week answers "was it sent, and when?").
    outbox_retention_seconds: float = Field(default=7 * 86_400, ge=0)

    # Keys created through the claims API live this long (like a route's ttl_days).
    claims_ttl_days: float = Field(default=30, gt=0)
    # How long a workflow's request may still land after its claim's lease ran out, or after
    # it failed a claim with the effect unknown: no one claims the key again before that (the
    # in-flight rule). At least the workflow's own request timeout.
    claims_in_flight_seconds: float = Field(default=30.0, ge=0, le=3600)

    # Signed webhooks: per-source HMAC-SHA256 secrets as "source=secret,source2=secret2"
    # (the routes file's [[sources]] tables may set them too, with their own header names).
    webhook_secrets: str = ""
    # Refuse events from sources that have no secret (instead of accepting them unsigned).
    require_signed_webhooks: bool = False
    # How far a signature's timestamp may be from now: bounds replays of a captured request.
    signature_tolerance_seconds: int = Field(default=300, ge=1)

    # The claims API's bearer token (workflows send it; it also lets them read GET
    # /v1/events/{key}). Unset: only clients on this machine are served.
    claims_token: str = ""

    # The operator API's bearer token. Unset: the operator endpoints answer 503 (never open).
    # At least 32 characters (outbox/core/tokens.py), or the processes refuse to start.
    operator_token: str = ""
    # Signs replay confirm tokens (HMAC), so only a dry run can issue one. Unset: derived from
    # operator_token. The same value on every receiver and wherever `idem replay` runs.
    replay_secret: str = ""
    # The bearer token of the receiver's /metrics. Unset: /metrics answers loopback clients only.
    metrics_token: str = ""
    # Flower's basic-auth password (compose hands it to Flower and to the receiver, which checks
    # it with the other tokens at start; Flower waits for the receiver). Read here only to judge.
    flower_password: str = ""
    # Wrong bearer tokens and console sign-ins allowed per client address within the window,
    # then that address's wrong ones get 429 until the oldest leaves it (a right one always
    # passes): a handful of typos pass quietly; the tokens' length is what defeats guessing.
    auth_failure_limit: int = Field(default=10, ge=1)
    auth_failure_window_seconds: float = Field(default=300.0, gt=0)
    # /docs, /redoc and /openapi.json: off in production (they map the attack surface), on
    # under `idem dev`.
    api_docs: bool = False
    # Worker metrics (Prometheus) are served on this port by the worker's main process (0:
    # not served), on this machine only unless WORKER_METRICS_HOST names another interface;
    # then METRICS_TOKEN is required, or the worker refuses to start (worker/metrics.py).
    worker_metrics_port: int = Field(default=9808, ge=0)
    worker_metrics_host: str = "127.0.0.1"

    # The relay and the sweeper touch this file on every turn of their loop; `idem alive`
    # checks that it is recent (container healthchecks). Unset: no file.
    heartbeat_file: Path | None = None

    log_format: Literal["json", "console"] = "json"
    log_level: str = "INFO"

    def concurrency(self) -> int:
        """Messages in flight per worker, by pool."""
        if self.worker_concurrency is not None:
            return self.worker_concurrency
        return 128 if self.worker_pool == "threads" else 2

    def broker(self) -> str:
        """The broker's URL: BROKER_URL, else REDIS_URL."""
        return self.broker_url or self.redis_url

    def sqlalchemy_url(self) -> str:
        """The database URL with the psycopg 3 driver named, whatever form it was given in."""
        return sqlalchemy_url(self.database_url)

    @property
    def transaction_pooled(self) -> bool:
        """DATABASE_URL hands out a server connection per transaction (PgBouncer's mode)."""
        return self.database_pool_mode == "transaction"

    def session_url(self) -> str | None:
        """A URL on which a connection is one PostgreSQL session (LISTEN, a session lock,
        migrations): DATABASE_DIRECT_URL, else DATABASE_URL unless that is a transaction pool."""
        if self.database_direct_url:
            return sqlalchemy_url(self.database_direct_url)
        return None if self.transaction_pooled else self.sqlalchemy_url()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment once, on first use; what the
    environment leaves unset is taken from a running `idem dev`'s file (`dev_env_file`)."""
    env_file = dev_env_file()
    # `_env_file` is BaseSettings' own argument; mypy sees only the fields' __init__.
    return Settings(_env_file=env_file if env_file.is_file() else None)  # type: ignore[call-arg]


def dev_env_file() -> Path:
    """Where `idem dev` writes the URLs of the embedded servers it started and its operator
    token (in DATA_DIR, `.idem/env` by default), so that every `idem` command run from the
    same folder reaches them with nothing set; it is removed when `idem dev` stops."""
    return Path(os.environ.get("DATA_DIR") or ".idem") / "env"
