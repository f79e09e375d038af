"""How our ops become code inside Inductor (see ``register``)."""

import functools


@functools.cache
def register() -> None:
    """Register what Inductor needs for our ops (idempotent; called by ``enable()``)."""
