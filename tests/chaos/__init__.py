"""A bounded chaos soak of the whole gateway: `python -m tests.chaos.soak` (`make chaos`).

Real processes (receiver, two relays, several workers, the sweeper) over a PostgreSQL and a
Redis of the soak's own, a fake CRM that loses, delays and refuses answers per key, clients
that deliver every event one to four times, and a schedule of kills and restarts. At the end
every event is checked against the state its key's behaviour makes certain. See
docs/explanation/reliability.md.

`python -m tests.chaos.net_soak` (`make chaos-net`, as root) runs the same traffic across nine
hosts made of network namespaces (`netns.py`), with links cut, slowed and healed
(`net_plan.py`, `net_chaos.py`, `nfdelay.py`) and the lease takeovers checked against the CRM's
log of requests (`net_check.py`).
"""
