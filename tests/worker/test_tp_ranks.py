"""How `--tp N` splits a process's threads and devices over its ranks."""

from shared.worker.tp import rank_device, rank_threads


def test_each_rank_gets_its_share_of_the_threads():
    assert [rank_threads(t, 2) for t in (1, 2, 3, 8)] == [1, 1, 1, 4]
    assert rank_threads(8, 3) == 2


def test_rank_r_uses_the_rth_device_after_rank_0s():
    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert rank_device("cuda:2", 1) == "cuda:3"
    assert rank_device("cpu", 1) == "cpu"
