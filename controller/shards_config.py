"""``shards:`` of ``sluice serve``: every gateway of a sharded fleet and which one this is
(controller/shard_forward.py forwards by it; docs/architecture.md §8)."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ShardsConfig(BaseModel):
    """``shards:`` of ``sluice serve``: every gateway of the fleet, and which one this is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # This gateway's place in ``gateways`` (from 0).
    index: Annotated[int, Field(ge=0)]
    # Every gateway's base URL (http or https), the same list in the same order on each:
    # the place of a gateway in it is its shard.
    gateways: Annotated[list[str], Field(min_length=2)]

    @field_validator("gateways")
    @classmethod
    def _urls(cls, gateways: list[str]) -> list[str]:
        cleaned = []
        for url in gateways:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"a gateway must look like http://HOST:PORT, got {url!r}")
            cleaned.append(url.rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("a gateway appears twice")
        return cleaned

    @model_validator(mode="after")
    def _index_in_list(self) -> ShardsConfig:
        if self.index >= len(self.gateways):
            raise ValueError(f"index {self.index} is past the last of {len(self.gateways)} gateways")
        return self
