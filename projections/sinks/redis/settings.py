"""``[views.redis]``: the Redis server of the Redis views. Only pydantic here: ``kappaflow.config``
reads it without loading the sink."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RedisSettings(BaseModel):
    """``url`` of the server (``redis://host:6379/0``; ``rediss://`` for TLS)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    url: str | None = None

    @property
    def configured(self) -> bool:
        return bool(self.url)


__all__ = ["RedisSettings"]
