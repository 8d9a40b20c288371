"""Base class of every bus message."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Msg(BaseModel):
    """A bus message: strict about unknown fields so schema drift fails loudly."""

    model_config = ConfigDict(extra="forbid", frozen=True)
