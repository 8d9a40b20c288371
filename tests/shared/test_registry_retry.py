"""Registering an instance rides out a JetStream stream without a leader (a NATS cluster electing
one, a replicated bucket just created): the write is retried with backoff, then the last error
is raised. Pure logic with a scripted JetStream context; the real election is exercised by
tests/multihost/test_nats_cluster.py."""

from __future__ import annotations

import pytest
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from shared.protocol.sched import InstanceRecord
from shared.registry import register_instance

REC = InstanceRecord(instance_id="decode-0", role="decode", incarnation="a")


class Bucket:
    def __init__(self, failures: list[Exception]):
        self.failures = failures
        self.puts: list[str] = []

    async def put(self, key: str, value: bytes) -> int:
        if self.failures:
            raise self.failures.pop(0)
        self.puts.append(key)
        return 7


class JS:
    def __init__(self, bucket: Bucket):
        self.bucket = bucket

    async def key_value(self, name: str) -> Bucket:
        return self.bucket


async def test_the_write_waits_for_a_leader():
    bucket = Bucket([NoStreamResponseError(), ServiceUnavailableError(), TimeoutError()])
    assert await register_instance(JS(bucket), REC, retry_s=5) == 7
    assert bucket.puts == ["decode-0"] and not bucket.failures


async def test_the_last_error_is_raised_after_the_deadline():
    bucket = Bucket([NoStreamResponseError() for _ in range(100)])
    with pytest.raises(NoStreamResponseError):
        await register_instance(JS(bucket), REC, retry_s=0.5)
    assert bucket.puts == [] and len(bucket.failures) < 100  # it did retry


async def test_other_errors_are_not_retried():
    bucket = Bucket([ValueError("bad record")])
    with pytest.raises(ValueError, match="bad record"):
        await register_instance(JS(bucket), REC, retry_s=5)
