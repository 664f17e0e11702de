"""``[views.search]``: the OpenSearch/Elasticsearch server of the search views. Only pydantic here:
``kappaflow.config`` reads it without loading the sink."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Flavor = Literal["opensearch", "elasticsearch"]


class SearchSettings(BaseModel):
    """``url`` of the server (or several, comma-separated) and its ``flavor`` (which client speaks to it)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    url: str | None = None
    flavor: Flavor = "opensearch"

    @property
    def configured(self) -> bool:
        return bool(self.url)


__all__ = ["Flavor", "SearchSettings"]
