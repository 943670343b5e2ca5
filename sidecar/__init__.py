"""hybridkv.sidecar: the dual-pool inference engine and its gRPC server."""

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int) -> None:
    """The sidecar's log lines at `level`: `hybridkv serve` sets them up, and so does every process it spawns (the
    engine process, its tensor-parallel ranks) with the level of the process that spawned it, since a spawned
    interpreter starts without its parent's handlers and would drop the engine's start-up report."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
