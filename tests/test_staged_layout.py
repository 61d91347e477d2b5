"""The staged KV layout (sim/staged_layout.py): the KunServe world's memory
counted through one KV layout interface."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.errors import ConfigError
from fleetserve.sim.kvlayout import PoolFull
from fleetserve.sim.staged_layout import StagedLayout, StageMemory
from fleetserve.spec import get_model

MODEL = "llama-2-7b"
SPEC = get_model(MODEL)
L = SPEC.num_layers
KV_TOKENS = 6000  # per instance as a replica


def _memory(n: int) -> StageMemory:
    return StageMemory(n, SPEC.weight_bytes + KV_TOKENS * SPEC.kv_bytes_per_token, SPEC)


def _room(mem: StageMemory, layers: dict[int, int], tokens: int) -> int:
    """The room by its definition (module docstring), from the books alone."""
    return min((mem.cap_tl(m) - mem.corr[m] - mem.pend_in[m]) // n for m, n in layers.items()) - (
        tokens
    )


def _pipeline(mem: StageMemory, k: int) -> StagedLayout:
    """The first ``k`` instances as one pipeline (an even split of the layers)."""
    bounds = [L * i // k for i in range(k + 1)]
    for m in range(k):
        mem.keep_layers(m, bounds[m], bounds[m + 1])
    layers = {m: bounds[m + 1] - bounds[m] for m in range(k)}
    return StagedLayout(mem, layers, MODEL, SPEC)


def test_a_replica_holds_its_kv_tokens_and_a_pipeline_gains_the_dropped_layers() -> None:
    mem = _memory(2)
    replica = StagedLayout(mem, {0: L}, MODEL, SPEC)
    assert replica.capacity_tokens() == KV_TOKENS
    assert replica.room_tokens() == KV_TOKENS
    mem2 = _memory(2)
    pipe = _pipeline(mem2, 2)
    # each member dropped half the layers: their bytes join the KV pool
    freed = (L // 2) * SPEC.weight_bytes_per_layer
    assert pipe.capacity_tokens() == (KV_TOKENS * L + freed // mem2.kvpl) // (L // 2)
    assert pipe.capacity_tokens() > 2 * KV_TOKENS
    assert pipe.capacity_bytes == sum(mem2.cap_b[m] - mem2.weights[m] for m in range(2))


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 4),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["hold", "unhold", "join", "leave", "correct", "commit"]),
            st.integers(0, 3),
            st.integers(1, 9000),
        ),
        max_size=40,
    ),
)
def test_the_room_is_the_books_minimum_and_growth_never_over_commits(
    k: int, ops: list[tuple[str, int, int]]
) -> None:
    """Whatever happens to the counts and the corrections: the room is
    ``min_m (cap - corr - pend) // layers_m - T``; a growth fits exactly when
    it is at most the room (else :class:`PoolFull`, nothing changed); and
    while every growth is checked, no member is ever over-committed."""
    mem = _memory(4)
    lay = _pipeline(mem, k)
    svc = MODEL
    for op, who, amount in ops:
        m = who % k
        before = lay.tokens()
        room = lay.room_tokens()
        assert room == _room(mem, lay.layers, before)
        assert lay.free_token_blocks(svc) == max(0, room)
        assert lay.can_add_blocks(svc, amount) == (amount <= room)
        if op == "hold":
            if amount <= room:
                lay.hold(svc, amount)
                assert lay.tokens() == before + amount
            else:
                with pytest.raises(PoolFull):
                    lay.hold(svc, amount)
                assert lay.tokens() == before
        elif op == "unhold":
            take = min(amount, lay.held(svc))
            lay.unhold(svc, take)
            assert lay.tokens() == before - take
        elif op == "join":
            if amount <= room:
                lay.bulk_change(svc, 1, amount, amount)
            else:
                with pytest.raises(PoolFull):
                    lay.bulk_change(svc, 1, amount, amount)
        elif op == "leave":
            n, t, _ = lay.bulk(svc)
            if n:
                take = min(t, amount)
                lay.bulk_change(svc, -1, -take, -take)
        elif op == "correct":
            # a piece moves from member m to the next one (corrections sum to 0)
            dst = (m + 1) % k
            tl = min(amount, max(0, mem.cap_tl(dst) - lay.used_tl(dst)))
            if k > 1 and lay.used_tl(m) >= tl:
                mem.correct(m, -tl)
                mem.correct(dst, tl)
        else:
            free = mem.cap_tl(m) - lay.used_tl(m) - mem.pend_in[m]
            mem.commit_in(m, min(amount, max(0, free)))
        lay.check_integrity()


def test_resident_kv_is_counted_without_a_check_and_the_check_catches_over_commit() -> None:
    mem = _memory(1)
    lay = StagedLayout(mem, {0: L}, MODEL, SPEC)
    lay.hold(MODEL, KV_TOKENS)
    assert lay.room_tokens() == 0
    with pytest.raises(PoolFull):
        lay.hold(MODEL, 1)
    lay.hold(MODEL, 1, check=False)  # KV that moved here: counted, not allocated
    assert lay.tokens() == KV_TOKENS + 1
    with pytest.raises(AssertionError, match="over-committed"):
        lay.check_integrity()
    lay.unhold(MODEL, 1)
    lay.check_integrity()
    lay.unhold(MODEL, KV_TOKENS)
    lay.bulk_change(MODEL, 1, 10, 10, check=False)  # a request moved in, running
    assert lay.bulk(MODEL) == (1, 10, 10)
    lay.check_integrity()


def test_layers_and_reloads_change_the_room() -> None:
    mem = _memory(2)
    lay = _pipeline(mem, 2)
    cap = lay.capacity_tokens()
    need = (L - L // 2) * SPEC.weight_bytes_per_layer
    mem.reload_start(0, need)
    assert lay.capacity_tokens() < cap
    mem.reload_done(0, need)
    assert mem.held[0] == (0, L)
    mem.check_instance(0, 0)
    with pytest.raises(RuntimeError, match="cannot serve stage"):
        mem.keep_layers(1, 0, L)  # instance 1 dropped the first half
    with pytest.raises(ConfigError, match="every stage needs a layer"):
        StagedLayout(mem, {0: 0}, MODEL, SPEC)
