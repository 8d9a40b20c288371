"""EPLB's placement algorithm at toy sizes: exact placements and loads."""

import pytest

from shared.model import eplb
from shared.model.config import ModelConfig
from shared.model.ep import check_ep
from shared.model.errors import CheckpointError


def test_initial_is_contiguous_blocks_with_neighbour_replicas():
    assert eplb.initial(8, 2).phys == (0, 1, 2, 3, 4, 5, 6, 7)
    p = eplb.initial(4, 2, spare=1)
    assert p.phys == (0, 1, 2, 2, 3, 0) and p.slots == 3
    assert p.on_rank(1) == (2, 3, 0) and p.replicas(0) == [0, 5] and p.replicas(1) == [1]
    with pytest.raises(ValueError, match="3 ranks do not divide 8 experts"):
        eplb.initial(8, 3)


def test_rank_loads_split_an_expert_over_its_replicas():
    p = eplb.Placement((0, 1, 2, 0), ranks=2)
    assert eplb.rank_loads([10, 4, 6], p) == [5 + 4, 6 + 5]
    assert eplb.imbalance([9, 11]) == pytest.approx(1.1)
    assert eplb.imbalance([0, 0]) == 1.0


def test_moves_only_separate_the_two_hot_experts():
    """No spare slot: the two hot experts (both on rank 0 at start) go to different ranks."""
    load = [50, 40, 5, 5, 1, 1, 1, 1]
    assert eplb.imbalance(eplb.rank_loads(load, eplb.initial(8, 2))) == pytest.approx(100 / 52)
    p = eplb.rebalance(load, ranks=2, slots=4)
    # heaviest first onto the lighter rank (ties: the lower rank): 0->r0, 1->r1, 2,3->r1, 4->r0,
    # 5->r1 (full), 6,7->r0
    assert p.phys == (0, 4, 6, 7, 1, 2, 3, 5)
    assert eplb.rank_loads(load, p) == [53, 51]


def test_spare_slots_replicate_the_hottest_expert():
    load = [90, 10, 10, 10]
    p = eplb.rebalance(load, ranks=2, slots=3)  # 2 spare slots: expert 0 gets 3 replicas
    assert sorted(p.phys) == [0, 0, 0, 1, 2, 3]
    # replicas of 30: r0, then r1 (no second copy while another rank can take it), then r0;
    # 1, 2 fill r1, 3 the last slot of r0. 70 is the best any placement does here
    assert p.phys == (0, 0, 3, 0, 1, 2)
    assert eplb.rank_loads(load, p) == [70, 50]
    # without spare slots expert 0 alone makes its rank hold 90 + 10
    no_spare = eplb.rebalance(load, ranks=2, slots=2)
    assert eplb.rank_loads(load, no_spare) == [100, 20]


def test_uniform_load_stays_balanced_and_deterministic():
    load = [3] * 6
    p = eplb.rebalance(load, ranks=3, slots=2)
    assert p == eplb.rebalance(load, ranks=3, slots=2)
    assert eplb.rank_loads(load, p) == [6, 6, 6]


def test_too_few_slots_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="cannot hold 5 experts"):
        eplb.rebalance([1] * 5, ranks=2, slots=2)
    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        eplb.Placement((0, 1, 2), ranks=2)


@pytest.mark.parametrize(
    "ep,experts,moe,want",
    [
        (16, 8, (0,), "--ep 16 is more ranks than the checkpoint's 8 experts"),
        (3, 8, (0,), "--ep 3 must divide the checkpoint's 8 experts"),
        (2, 0, (), "--ep 2 needs a mixture-of-experts checkpoint"),
        (0, 8, (0,), "expert parallel size must be at least 1"),
    ],
)
def test_check_ep_names_the_problem(ep, experts, moe, want):
    c = ModelConfig.__new__(ModelConfig)
    object.__setattr__(c, "num_experts", experts)
    object.__setattr__(c, "moe_layers", moe)
    with pytest.raises(CheckpointError, match=want.replace("-", r"\-")):
        check_ep(c, ep)
