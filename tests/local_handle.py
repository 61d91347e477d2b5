"""In-process stand-ins for Ray actor handles: the controller and its
workers run in one event loop (``handle.method.remote(...)`` gives an
awaitable), so the runtime's mechanisms run exactly as deployed without
Ray's start-up cost."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetserve.runtime.worker import Worker


class _Method:
    def __init__(self, obj: Any, name: str) -> None:
        self.fn = getattr(obj, name)

    def remote(self, *args: Any) -> Any:
        return asyncio.ensure_future(self.fn(*args))


class LocalHandle:
    """An in-process stand-in for a Ray actor handle of a :class:`Worker`."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.dead = False

    def __getattr__(self, name: str) -> _Method:
        if self.__dict__.get("dead"):
            return _Dead()  # type: ignore[return-value]
        return _Method(self.worker, name)


class _Dead:
    def __getattr__(self, name: str) -> Any:
        return self

    def remote(self, *args: Any) -> Any:
        import ray.exceptions

        async def fail() -> None:
            raise ray.exceptions.RayActorError()

        return asyncio.ensure_future(fail())
