"""Every message that crosses the bus: pydantic models, one module per subject family.

`subjects` names every subject; `codec` is the one msgpack codec; `errors` is the typed error that
crosses the bus and becomes an HTTP status at the gateway.
"""
