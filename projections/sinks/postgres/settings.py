"""``[views.postgres]``: where the PostgreSQL views live (also kappaflow's registry, positions and
metrics history). Only pydantic here: ``kappaflow.config`` reads it without loading the sink."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from kappaflow.errors import ConfigError


class PostgresSettings(BaseModel):
    """The views database: ``dsn`` (``postgresql://user@host:port/db``, no password) and the environment
    variable holding its password (``password_env``), if any."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    dsn: str | None = None
    password_env: str | None = None

    @property
    def configured(self) -> bool:
        return bool(self.dsn)

    def connect_dsn(self) -> str:
        """The DSN to connect with (the password from ``password_env`` put in)."""
        if not self.dsn:
            raise ConfigError("views.postgres.dsn: not set; add dsn under [views.postgres] in kappaflow.toml or "
                              "set KAPPAFLOW_VIEWS__POSTGRES__DSN")
        if not self.password_env:
            return self.dsn
        from kappaflow.config import PostgresSourceConfig

        return PostgresSourceConfig(name="views", dsn=self.dsn, password_env=self.password_env).connect_dsn()


__all__ = ["PostgresSettings"]
