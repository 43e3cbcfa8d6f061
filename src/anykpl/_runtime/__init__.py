"""The runtime around the core: the producer's lifecycle, admission and its waits, each
stream's tasks, the spool's store and syncer, and which event loop runs them (anyio, on
asyncio or trio). It talks to Kinesis only through a transport (``_transport/``).
"""

from .._core._records import use_waiting
from . import _awaiting

use_waiting(_awaiting)  # the core's records are awaited through the runtime's event loop
_awaiting.use_interpreted_await()  # the pure build's records: a cheaper await
