"""Gateway: OpenAI-compatible REST and the same API on NATS (`strata.api.v1.generate`)."""
