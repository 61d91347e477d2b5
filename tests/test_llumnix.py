"""Llumnix-style migration policy (Mell's LB baseline), on fake cluster views."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.cluster.state import ClusterState, blocks_for
from fleetserve.config import config_from_dict
from fleetserve.policy import MIGRATION, Migrate
from fleetserve.policy.llumnix import Llumnix, freeness, freeness_after

BS = 16  # tokens per block
RNG = np.random.default_rng(0)


@dataclass
class Seq:
    """A fake SeqView: running when it holds KV, waiting otherwise."""

    id: int
    kv_tokens: int
    generated: int = 1
    migrating: bool = False
    model: str = "m"
    arrival_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 100
    re_prefilling: bool = False  # holds KV and has tokens, but its re-prefill runs

    @property
    def demand_tokens(self) -> int:
        return max(self.kv_tokens, self.prompt_tokens + self.generated)

    @property
    def decoding(self) -> bool:
        return self.kv_tokens > 0 and self.generated > 0 and not self.re_prefilling


@dataclass
class Inst:
    """A fake InstanceView; ``available_blocks`` is given, counts come from ``reqs``."""

    id: int
    available_blocks: int
    reqs: list[Seq] = field(default_factory=list)
    model: str = "m"
    block_size: int = BS
    total_blocks: int = 1000

    @property
    def gpus(self) -> tuple[int, ...]:
        return (self.id,)

    @property
    def tp(self) -> int:
        return 1

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.reqs if s.kv_tokens > 0)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.reqs if s.kv_tokens == 0)

    @property
    def free_blocks(self) -> int:
        return self.available_blocks

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.available_blocks

    @property
    def reserved_blocks(self) -> int:
        return 0

    @property
    def decode_steps(self) -> int:
        return 0

    @property
    def idle(self) -> bool:
        return not self.reqs

    def seqs(self) -> list[Any]:
        return list(self.reqs)


_next_id = iter(range(10_000, 1_000_000))


def inst(iid: int, avail: int, sizes: list[int], model: str = "m", base: int = 0) -> Inst:
    """Instance ``iid`` with ``avail`` available blocks and running requests of
    ``sizes`` tokens, ids ``base + k`` (or fresh ids when ``base`` is 0)."""
    reqs = [Seq(base + k if base else next(_next_id), s, model=model) for k, s in enumerate(sizes)]
    return Inst(iid, avail, reqs, model=model)


def cluster(*views: Inst) -> ClusterState:
    st_ = ClusterState(gpus_per_node=8)
    for v in views:
        st_.add(v)
    return st_


def plan(state: ClusterState, policy: Llumnix | None = None) -> list[Migrate]:
    p = policy or Llumnix(migrate_out_threshold=None)
    return p.plan(state, 0.0, RNG)


# ------------------------------------------------------------------ basics


def test_registered_and_configured() -> None:
    assert MIGRATION.get("llumnix") is Llumnix
    p = Llumnix.from_config(config_from_dict({"migration": {"epoch_s": 2.5}}))
    assert p.interval_s == 2.5
    assert p.migrate_out_threshold == 3.0


def test_freeness() -> None:
    assert freeness(inst(0, 100, [])) == math.inf
    assert freeness(inst(0, 100, [16, 32])) == 50
    v = Inst(0, 30, [Seq(1, 16), Seq(2, 0)])  # a waiting request counts too
    assert freeness(v) == 15
    assert freeness(Inst(0, -10, [Seq(1, 16), Seq(2, 0)])) == -5
    assert freeness_after(inst(0, 10, [16]), 5, -1) == math.inf
    assert freeness_after(inst(0, 10, [16]), -4, 1) == 3


# ------------------------------------------------------------------ pairing


def test_pairs_lowest_with_highest_then_second_with_second() -> None:
    # Freeness: A=1, B=2, C=40, D=100 (one-block requests).
    a = inst(1, 4, [16] * 4, base=100)
    b = inst(2, 8, [16] * 4, base=200)
    c = inst(3, 80, [16] * 2, base=300)
    d = inst(4, 100, [16], base=400)
    moves = plan(cluster(c, a, d, b))
    assert [(m.request_id // 100, m.dst) for m in moves] == [(1, 4), (2, 3)]
    assert all(m.mode is None for m in moves)


def test_odd_count_leaves_the_middle_instance_alone() -> None:
    a = inst(1, 4, [16] * 4, base=100)
    m = inst(2, 20, [16] * 2, base=200)
    d = inst(3, 100, [16], base=300)
    moves = plan(cluster(a, m, d))
    assert [(mv.request_id // 100, mv.dst) for mv in moves] == [(1, 3)]


def test_empty_instance_is_the_freest_destination() -> None:
    a = inst(1, 4, [16] * 4, base=100)
    b = inst(2, 50, [16] * 2, base=200)
    empty = inst(3, 500, [])
    moves = plan(cluster(a, b, empty))
    assert [(mv.request_id // 100, mv.dst) for mv in moves] == [(1, 3)]


def test_no_move_when_balanced() -> None:
    views = [inst(i, 20, [16, 16], base=100 * i) for i in range(1, 5)]
    assert plan(cluster(*views)) == []
    assert plan(cluster(*views), Llumnix()) == []


def test_no_move_for_a_single_instance_or_none() -> None:
    assert plan(cluster(inst(1, 0, [16] * 5))) == []
    assert plan(cluster()) == []


def test_models_are_never_paired_together() -> None:
    hot = inst(1, 0, [16] * 4, model="a")
    cold = inst(2, 500, [16], model="b")
    assert plan(cluster(hot, cold)) == []
    # Each model is balanced on its own.
    hot_b = inst(3, 0, [16] * 4, model="b", base=300)
    moves = plan(cluster(hot, cold, hot_b))
    assert [(m.request_id // 100, m.dst) for m in moves] == [(3, 2)]


# ------------------------------------------------------------------ the request


def test_moves_the_running_request_with_fewest_kv_tokens() -> None:
    src = Inst(
        1,
        0,
        [
            Seq(11, 64),
            Seq(12, 32),
            Seq(13, 16, migrating=False, generated=0),  # still prefilling
            Seq(14, 0),  # waiting
            Seq(15, 32),  # same size as 12: higher id
            Seq(16, 16, generated=3, re_prefilling=True),  # preempted, re-prefilling
        ],
    )
    dst = inst(2, 400, [16])
    assert plan(cluster(src, dst)) == [Migrate(12, 2)]


def test_ties_on_freeness_go_to_lower_instance_id() -> None:
    a = inst(5, 0, [16, 16], base=500)
    b = inst(3, 0, [16, 16], base=300)
    d = inst(9, 300, [16], base=900)
    moves = plan(cluster(a, b, d), Llumnix())
    assert [(m.request_id // 100, m.dst) for m in moves] == [(3, 9)]


def test_no_overshoot() -> None:
    # src: 2 requests, 10 available -> 5; dst: 1 request, 30 available -> 30.
    # Moving a 1-block request: src 11/1 = 11, dst 29/2 = 14.5: fine.
    src = inst(1, 10, [16, 160], base=100)
    dst = inst(2, 30, [16])
    assert plan(cluster(src, dst)) == [Migrate(100, 2)]
    # Moving a 10-block request (the smallest here): src 20, dst 10: overshoot.
    src = inst(1, 10, [160, 320], base=100)
    assert plan(cluster(src, dst)) == []


def test_exact_balance_is_allowed() -> None:
    # src: 4 avail / 2 req = 2; dst: 12 / 1 = 12. Move 4 blocks: src 8/1 = 8, dst 8/2 = 4.
    # That overshoots; with a 2-block request: src 6, dst 5: overshoot; 1 block: 5 vs 5.5.
    src = inst(1, 4, [16, 64], base=100)
    dst = inst(2, 12, [16])
    assert plan(cluster(src, dst)) == [Migrate(100, 2)]
    # src 3 avail / 2 = 1.5, dst 9 / 1 = 9; 1 block: src 4, dst 4: equal, allowed.
    src = inst(1, 3, [16, 64], base=100)
    dst = inst(2, 9, [16])
    moves = plan(cluster(src, dst))
    assert moves == [Migrate(100, 2)]
    assert freeness_after(src, 1, -1) == freeness_after(dst, -1, 1)


def test_source_with_one_request_keeps_it() -> None:
    src = inst(1, -5, [16])
    dst = inst(2, 500, [])
    assert plan(cluster(src, dst)) == []


def test_smaller_requests_that_widen_the_gap_are_skipped() -> None:
    # src: 2 requests, -200 available (a starved queue) -> -100; dst: 9 requests, 18 -> 2.
    # 1 block: src -199/1 (less free than before!), dst 17/10: the gap grows, skipped.
    # 150 blocks: src -50, dst -132/10 = -13.2: gap 36.8 < 102, no overshoot: chosen.
    src = Inst(1, -200, [Seq(1, 16), Seq(2, 150 * BS)])
    dst = inst(2, 18, [16] * 9)
    assert plan(cluster(src, dst)) == [Migrate(2, 2)]


def test_demand_tokens_count_in_blocks() -> None:
    # 17 tokens take 2 blocks.
    src = inst(1, 0, [17, 1000], base=100)
    dst = inst(2, 40, [16])
    (m,) = plan(cluster(src, dst))
    assert m.request_id == 100
    assert blocks_for(17, BS) == 2


# ------------------------------------------------------------------ threshold


def test_threshold_selects_sources_and_destinations() -> None:
    # Freeness 2 (below 3) migrates out; 2.5 is also a source; 10 and 50 are destinations.
    a = inst(1, 4, [16, 16], base=100)
    b = inst(2, 5, [16, 16], base=200)
    c = inst(3, 20, [16, 16], base=300)
    d = inst(4, 50, [16], base=400)
    moves = plan(cluster(a, b, c, d), Llumnix())
    assert [(m.request_id // 100, m.dst) for m in moves] == [(1, 4), (2, 3)]
    # Above the threshold nothing migrates out, however unbalanced.
    e = inst(5, 8, [16, 16], base=500)  # 4 > 3
    f = inst(6, 500, [16], base=600)
    assert plan(cluster(e, f), Llumnix()) == []
    assert len(plan(cluster(e, f))) == 1  # without a threshold it would
    # A lower threshold moves less.
    assert plan(cluster(a, d), Llumnix(migrate_out_threshold=1.0)) == []


def test_threshold_keeps_destination_above_it() -> None:
    # src 1/3 free; dst 8/2 = 4 > 3, but taking a 1-block request leaves 7/3 < 3.
    src = inst(1, 1, [16, 16, 16], base=100)
    dst = inst(2, 8, [16, 16])
    assert plan(cluster(src, dst), Llumnix()) == []
    # With a threshold of 2 it may: src 2/2 = 1 <= dst 7/3.
    assert plan(cluster(src, dst), Llumnix(migrate_out_threshold=2.0)) == [Migrate(100, 2)]


# ------------------------------------------------------------------ migrations in flight


def test_instances_with_a_migrating_request_are_skipped() -> None:
    a = inst(1, 0, [16, 16, 16], base=100)
    b = inst(2, 4, [16, 16], base=200)
    c = inst(3, 80, [16], base=300)
    d = inst(4, 200, [16], base=400)
    d.reqs[0].migrating = True  # d is receiving or sending a request
    moves = plan(cluster(a, b, c, d))
    # Without d: a (0) pairs with c (80); b is the middle one.
    assert [(m.request_id // 100, m.dst) for m in moves] == [(1, 3)]


def test_planned_moves_block_their_instances_until_they_start() -> None:
    policy = Llumnix(migrate_out_threshold=None)
    a = inst(1, 0, [16, 16], base=100)
    d = inst(2, 200, [16], base=200)
    state = cluster(a, d)
    assert plan(state, policy) == [Migrate(100, 2)]
    # The mechanism postponed it: same state, no second move.
    assert plan(state, policy) == []
    # It started: the migrating flag now blocks the pair; the record is dropped.
    a.reqs[0].migrating = True
    assert plan(state, policy) == []
    # It finished: the request left a.
    a.reqs.pop(0)
    d.reqs.append(Seq(100, 16))
    a.available_blocks, d.available_blocks = 1, 199
    assert plan(state, policy) == []  # 1 request left on a: nothing to balance


def test_on_finish_and_on_release_forget_planned_moves() -> None:
    policy = Llumnix(migrate_out_threshold=None)
    a = inst(1, 0, [16, 16], base=100)
    d = inst(2, 200, [16], base=200)
    state = cluster(a, d)
    assert plan(state, policy) == [Migrate(100, 2)]
    policy.on_finish(100, 1, 1.0)
    assert plan(state, policy) == [Migrate(100, 2)]
    policy.on_release(2, 2.0)
    assert plan(state, policy) == [Migrate(100, 2)]


def test_deterministic_and_does_not_mutate_views() -> None:
    views = [
        inst(i, 10 * i, [16 * (k + 1) for k in range(6 - i)], base=100 * i) for i in (1, 2, 3, 4, 5)
    ]
    state = cluster(*views)
    before = [(v.available_blocks, [(s.id, s.kv_tokens) for s in v.reqs]) for v in views]
    first = plan(state)
    assert first == plan(state)
    assert before == [(v.available_blocks, [(s.id, s.kv_tokens) for s in v.reqs]) for v in views]


# ------------------------------------------------------------------ properties


@st.composite
def clusters(draw: st.DrawFn) -> ClusterState:
    n = draw(st.integers(0, 8))
    views = []
    rid = 0
    for i in range(n):
        model = draw(st.sampled_from(["a", "b"]))
        reqs = []
        for _ in range(draw(st.integers(0, 5))):
            reqs.append(
                Seq(
                    rid,
                    draw(st.sampled_from([0, 1, 16, 17, 40, 100, 500])),
                    generated=draw(st.integers(0, 3)),
                    migrating=draw(st.booleans()) and draw(st.booleans()),
                    model=model,
                    prompt_tokens=draw(st.integers(1, 50)),
                )
            )
            rid += 1
        views.append(Inst(i, draw(st.integers(-40, 200)), reqs, model=model))
    return cluster(*views)


@settings(max_examples=300, deadline=None)
@given(clusters(), st.sampled_from([None, 3.0, 10.0]))
def test_every_move_is_a_valid_llumnix_move(state: ClusterState, threshold: float | None) -> None:
    moves = Llumnix(migrate_out_threshold=threshold).plan(state, 0.0, RNG)
    where = {s.id: v for v in state.instances.values() for s in v.seqs()}
    seen: set[int] = set()
    for m in moves:
        src = where[m.request_id]
        dst = state.instances[m.dst]
        seq = next(s for s in src.seqs() if s.id == m.request_id)
        assert src.model == dst.model and src.id != dst.id
        assert not ({src.id, dst.id} & seen)  # one move per instance
        seen |= {src.id, dst.id}
        assert not any(s.migrating for s in src.seqs() + dst.seqs())
        assert seq.kv_tokens > 0 and seq.generated > 0
        b_src = blocks_for(seq.demand_tokens, src.block_size)
        b_dst = blocks_for(seq.demand_tokens, dst.block_size)
        src_after = freeness_after(src, b_src, -1)
        dst_after = freeness_after(dst, -b_dst, 1)
        assert freeness(src) < freeness(dst)
        assert src_after <= dst_after
        assert dst_after - src_after < freeness(dst) - freeness(src)
        if threshold is not None:
            assert freeness(src) < threshold <= dst_after
    # Deterministic.
    assert Llumnix(migrate_out_threshold=threshold).plan(state, 0.0, RNG) == moves
