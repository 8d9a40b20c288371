"""`strata.<role>.ping`: a cheap liveness probe of a queue-group role (tokenizer, vision).

The gateway's readiness check asks it; any instance of the role answers with who it is. No
responder (the server's immediate no-responders status) means no instance is listening.
"""

from __future__ import annotations

from shared.protocol.base import Msg


class Ping(Msg):
    """Empty probe; ``sender`` is only for logs."""

    sender: str = ""


class Pong(Msg):
    """The answering instance."""

    role: str = ""
    instance_id: str = ""
