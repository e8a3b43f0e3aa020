"""What the relay and the worker agree on over the broker: the task's name and its queue.

Both are wire format: messages already in Redis name them, so renaming either strands those
messages. The relay publishes by name (it never imports `worker`); the worker registers the
task under the same name and consumes the same queue.
"""

from __future__ import annotations

PROCESS_TASK = "idem.process"
"""The Celery task the relay publishes; the worker registers it under this name."""

PROCESS_KEYS_TASK = "idem.process_keys"
"""The task carrying several keys (`keys`, a list: an event's deliveries, or deliveries that
fell due together): the worker runs each key's attempt as `PROCESS_TASK` would, concurrently,
so the keys share one message."""

TASK_QUEUE = "idem"
"""The one queue workers consume; the relay and the worker both name it."""
