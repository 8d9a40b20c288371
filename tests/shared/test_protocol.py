"""Round-trip every bus message through the one codec; typed errors survive the trip."""

from __future__ import annotations

import collections.abc
import enum
import importlib
import inspect
import pkgutil
import types
import typing

import pytest
from pydantic import BaseModel, ValidationError

import shared.protocol as protocol_pkg
from shared.protocol.codec import decode, encode, encode_error
from shared.protocol.errors import HTTP_STATUS, StrataError
from shared.protocol.load import LoadReport
from shared.protocol.sampling import SamplingParams
from shared.protocol.sched import RoleChange
from shared.protocol.stream import TokenChunk, Usage
from shared.protocol.work import DecodeWork, ImageRef, PrefillWork, WorkItem


def _all_message_models() -> list[type[BaseModel]]:
    models = []
    for info in pkgutil.iter_modules(protocol_pkg.__path__):
        mod = importlib.import_module(f"shared.protocol.{info.name}")
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, BaseModel) and obj.__module__ == mod.__name__:
                models.append(obj)
    return models


SAMPLES = {
    "WorkItem": WorkItem(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=5, temperature=0.5, seed=7, stop=["\n"]),
        images=[ImageRef(offset=1, length=2, hash="ab" * 32, source_addr="127.0.0.1:1")],
        tenant="team-a",
        tenant_weight=3.0,
    ),
    "PrefillWork": PrefillWork(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=5),
        decode_instance="d0",
        decode_addr="127.0.0.1:2",
        transfer_mode="pool",
    ),
    "DecodeWork": DecodeWork(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=5),
        output_token_ids=[4],
        first_token_id=9,
        kv_pushed=True,
        kv_num_tokens=3,
    ),
    "TokenChunk": TokenChunk(
        request_id="r1",
        index=3,
        token_ids=[5, 6],
        text="hé",
        logprobs=[{5: -0.5}, {6: -1.0}],
        finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=5),
    ),
    "LoadReport": LoadReport(instance_id="d0", role="decode", incarnation="x", ts=1.5),
    "LoadReportDraining": LoadReport(
        instance_id="d0", role="decode", incarnation="x", ts=1.5, draining=True
    ),
    "RoleChange": RoleChange(
        instance_id="d1", incarnation="i1", from_role="decode", to_role="prefill", ts=2.0
    ),
}


@pytest.mark.parametrize("name,msg", list(SAMPLES.items()))
def test_round_trip_samples(name, msg):
    assert decode(encode(msg), type(msg)) == msg


def sample_value(tp, name: str = ""):
    """A valid, non-default value of type ``tp`` (recursing into models, lists and dicts)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return sample_value(args[0], name)
    if origin in (typing.Union, types.UnionType):
        return sample_value(next(a for a in args if a is not type(None)), name)
    if origin is typing.Literal:
        return args[-1]
    if origin in (list, tuple, set, frozenset, collections.abc.Sequence):
        return [sample_value(args[0] if args else str, name)]
    if origin is dict:
        return {sample_value(args[0], name): sample_value(args[1], name)}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return full_sample(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return list(tp)[-1]
    simple = {bool: True, int: 3, float: 0.5, bytes: b"\x00\xff", typing.Any: "any"}
    if tp in simple:
        return simple[tp]
    if tp is str:
        return "ab" * 32 if "hash" in name else "x1"
    raise TypeError(f"no sample for {name}: {tp}")


def full_sample(model: type[BaseModel]) -> BaseModel:
    """``model`` with every field set, required or not, from its annotation."""
    return model.model_validate(
        {n: sample_value(f.annotation, n) for n, f in model.model_fields.items()}
    )


def test_every_message_model_round_trips_with_every_field_set():
    models = _all_message_models()
    assert len(models) >= 27
    for model in models:
        sample = full_sample(model)
        assert sample.model_fields_set == set(model.model_fields), model.__name__
        assert decode(encode(sample), model) == sample, model.__name__


def test_error_reply_becomes_typed_exception():
    data = encode_error(StrataError("overloaded", "batch class refused", retry_after=2.0))
    with pytest.raises(StrataError) as exc:
        decode(data, TokenChunk)
    assert exc.value.code == "overloaded"
    assert exc.value.http_status == 429
    assert exc.value.retry_after == 2.0


def test_unknown_code_maps_to_internal_and_statuses_are_http():
    assert StrataError("nonsense", "x").code == "internal"
    assert all(100 <= s < 600 for s in HTTP_STATUS.values())


def test_garbage_bytes_are_a_bad_request():
    with pytest.raises(StrataError) as exc:
        decode(b"\xc1\xc1", TokenChunk)
    assert exc.value.code == "bad_request"


def test_work_item_tenant_defaults_and_weight_must_be_positive():
    item = WorkItem(request_id="r", prompt_token_ids=[1], sampling=SamplingParams())
    assert (item.tenant, item.tenant_weight) == ("default", 1.0)
    with pytest.raises(ValidationError, match="tenant_weight"):
        WorkItem(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(), tenant_weight=0)


def test_routed_submit_carries_the_tenant_to_either_instance():
    from shared.protocol.sched import RouteReply, routed_submit

    item = WorkItem(
        request_id="r", prompt_token_ids=[1], sampling=SamplingParams(), tenant="t", tenant_weight=2
    )
    for prefill in ("p0", ""):
        route = RouteReply(prefill_instance=prefill, decode_instance="d0", decode_addr="a")
        _, work = routed_submit(item, route)
        assert (work.tenant, work.tenant_weight) == ("t", 2.0)
