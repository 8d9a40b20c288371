"""How `--tp N` splits a process's threads and devices over its ranks."""

from shared.worker.tp import rank_device, rank_threads


def test_each_rank_gets_its_share_of_the_threads():
    assert [rank_threads(t, 2) for t in (1, 2, 3, 8)] == [1, 1, 1, 4]
    assert rank_threads(8, 3) == 2


def test_rank_r_uses_the_rth_device_after_rank_0s():
    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert rank_device("cuda:2", 1) == "cuda:3"
    assert rank_device("cpu", 1) == "cpu"


def test_a_collective_failure_of_a_sharded_engine_is_the_instances_not_the_requests():
    """A step that fails in the runtime on a model sharded over ranks (gloo: "Connection closed
    by peer" when a follower died) reaches the streams as ``unavailable``, which the gateway
    fails over (`INSTANCE_ERRORS`); an unsharded engine's error stays what it was."""
    from types import SimpleNamespace

    from shared.engine.port import _group_failure
    from shared.protocol.errors import INSTANCE_ERRORS, StrataError

    def engine(world: int | None):
        tp = None if world is None else SimpleNamespace(world_size=world)
        return SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(tp=tp)))

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer")
    got = _group_failure(engine(2), lost)
    assert isinstance(got, StrataError) and got.code in INSTANCE_ERRORS
    assert "Connection closed by peer" in got.message
    assert _group_failure(engine(None), lost) is lost
    assert _group_failure(engine(1), lost) is lost
    bad = ValueError("a request's own problem")
    assert _group_failure(engine(2), bad) is bad
