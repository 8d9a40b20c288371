"""KV data plane: tensors <-> gRPC `BlockFrame`s (``frames``; the torch-free byte level in
``wire``), the KVTransfer server/client helpers, and the `PoolClient` that spreads
content-addressed blocks over kvstore instances. Import the modules; the package imports
nothing (the kvstore must not pull torch in)."""
