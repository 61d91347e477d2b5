"""Prefix caching in the single-model simulator (engine.prefix_caching).

Hash-keyed KV blocks shared across requests of one instance: hits are not
recomputed and counted once in memory (reference counts), unreferenced entries
are evicted LRU. Property tests check the invariants after every event
(``check_integrity``) on random hashed workloads, with and without migrations;
the rest checks hits, the arithmetic of trace blocks onto KV blocks, the cost
of a hit, that the off path (and the on path without hashes) is unchanged, the
workload side (loader, length transforms) and the Mooncake trace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Self

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleetserve.cluster.state import ClusterState, blocks_for
from fleetserve.config import SimConfig, config_from_dict
from fleetserve.costmodel import CostModel
from fleetserve.errors import ConfigError, InputError
from fleetserve.metrics import summarize
from fleetserve.metrics.records import RunResult
from fleetserve.policy import MIGRATION, Migrate
from fleetserve.policy.base import MigrationPolicy
from fleetserve.policy.catalog import check_world
from fleetserve.sim.build import build_workload
from fleetserve.sim.group_instance import GroupInstance
from fleetserve.sim.prefix_cache import PrefixCache, PrefixStats
from fleetserve.sim.seq import Seq
from fleetserve.sim.simulator import Simulator
from fleetserve.spec import get_gpu, get_model
from fleetserve.workload import load_trace, scale_lengths
from fleetserve.workload.request import Request, with_lengths

MODEL = "llama-2-7b"
MOONCAKE = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_conversation_trace.jsonl"
)


# ------------------------------------------------------------------ helpers


def cfg(**over: Any) -> SimConfig:
    data: dict[str, Any] = {
        "model": MODEL,
        "check_integrity": True,
        "engine": {"prefix_caching": True},
        "cluster": {"elastic": False, "gpus": 1},
    }
    for k, v in over.items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            data[k] = v
    return config_from_dict(data)


def run(c: SimConfig, reqs: list[Request]) -> RunResult:
    return Simulator(c, reqs).run()


def outcome(res: RunResult) -> list[tuple[Any, ...]]:
    return [
        (
            r.status,
            r.reason,
            r.first_token_s,
            r.finish_s,
            r.generated,
            r.preemptions,
            r.instance,
            r.migrations,
            r.migration_stall_s,
            r.aborted_migrations,
        )
        for r in res.records
    ]


def conv(i: int, t: float, family: int, shared: int, extra: int, out: int, size: int) -> Request:
    """A request whose first ``shared`` blocks of ``size`` tokens are those of
    ``family`` (a common prefix) followed by ``extra`` tokens of its own."""
    prompt = shared * size + extra
    n = -(-prompt // size)
    ids = tuple(family * 1000 + b if b < shared else 10**6 + i * 1000 + b for b in range(n))
    return Request(i, MODEL, t, prompt, out, prefix_blocks=ids, prefix_block_tokens=size)


def assert_ended_once(res: RunResult, n: int) -> None:
    s = summarize(res)["requests"]
    assert s["finished"] + s["rejected"] + s["unfinished"] == s["total"] == n
    assert s["unfinished"] == 0
    for r in res.records:
        assert (r.status == "finished") == (r.finish_s is not None)
        if r.status == "finished":
            assert r.generated == r.output_tokens
            assert r.first_token_s is not None and r.arrival_s <= r.first_token_s <= r.finish_s
        else:
            assert r.reason and r.cached_tokens == 0


def check_hits(res: RunResult, reqs: list[Request], bs: int) -> None:
    """Every hit is KV-block aligned, within the prompt's full blocks, and
    leaves a token to compute; the summary adds the records up."""
    for r, q in zip(res.records, reqs, strict=True):
        assert r.cached_tokens % bs == 0
        assert r.cached_tokens < q.prompt_tokens
        if q.prefix_block_tokens is not None:
            assert (
                r.cached_tokens <= q.prompt_tokens // q.prefix_block_tokens * q.prefix_block_tokens
            )
    pc = summarize(res)["prefix_cache"]
    assert pc["hit_tokens"] == sum(r.cached_tokens for r in res.records)
    assert pc["requests_hit"] == sum(r.cached_tokens > 0 for r in res.records)
    assert pc["requests"] == sum(r.first_token_s is not None for r in res.records)


@MIGRATION.register("_test_pc_random")
class RandomMoves(MigrationPolicy):
    """Each epoch: up to three random requests move to a random other
    instance, in a random mode (kv, token or the mechanism's choice)."""

    @classmethod
    def from_config(cls, config: SimConfig) -> Self:
        p = cls()
        p.interval_s = config.migration.epoch_s
        return p

    def plan(self, state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        views = state.instances_of(MODEL)
        if len(views) < 2:
            return []
        seqs = [(v.id, s) for v in views for s in v.seqs() if not s.migrating]
        out: list[Any] = []
        for _ in range(int(rng.integers(0, 4))):
            if not seqs:
                break
            src, seq = seqs.pop(int(rng.integers(len(seqs))))
            dst = [v.id for v in views if v.id != src][int(rng.integers(len(views) - 1))]
            out.append(Migrate(seq.id, dst, [None, "kv", "token"][int(rng.integers(3))]))
        return out


# --------------------------------------------------------------- hypothesis

items_st = st.lists(
    st.tuples(
        st.floats(0.0, 0.6, allow_nan=False),  # inter-arrival gap
        st.integers(0, 3),  # family (shared prefix)
        st.integers(0, 12),  # shared blocks
        st.integers(1, 300),  # own tokens after them
        st.integers(1, 250),  # output
    ),
    min_size=1,
    max_size=30,
)


def hashed(items: list[tuple[float, int, int, int, int]], size: int) -> list[Request]:
    t = 0.0
    reqs = []
    for i, (gap, fam, shared, extra, out) in enumerate(items):
        t += gap
        reqs.append(conv(i, t, fam, min(shared, 1400 // size), extra, out, size))
    return reqs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=items_st,
    stack=st.sampled_from(["vllm", "bf", "wf"]),
    fixed=st.booleans(),
    chunked=st.booleans(),
    max_seqs=st.sampled_from([2, 256]),
    bs=st.sampled_from([16, 24]),
    size=st.sampled_from([40, 64, 512]),
)
def test_invariants_with_prefix_caching(
    items: list[tuple[float, int, int, int, int]],
    stack: str,
    fixed: bool,
    chunked: bool,
    max_seqs: int,
    bs: int,
    size: int,
) -> None:
    """Random hashed workloads on small instances (preemptions, evictions):
    after every event the references match the entries, no entry is both
    evictable and referenced, memory (private blocks + referenced entries once)
    is never over-committed; every request ends exactly once."""
    reqs = hashed(items, size)
    cluster: dict[str, Any] = {"mem_util": 0.33, "block_size": bs}
    cluster.update({"elastic": False, "gpus": 2} if fixed else {"elastic": True})
    c = cfg(
        policy={"stack": stack},
        cluster=cluster,
        engine={
            "max_num_seqs": max_seqs,
            "chunked_prefill": chunked,
            "max_batched_tokens": 512,
        },
    )
    res = run(c, reqs)
    assert_ended_once(res, len(reqs))
    check_hits(res, reqs, bs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=items_st,
    mechanism=st.sampled_from(["kv", "token"]),
    chunked=st.booleans(),
    size=st.sampled_from([40, 64]),
    seed=st.integers(0, 2**16),
)
def test_invariants_with_migrations(
    items: list[tuple[float, int, int, int, int]],
    mechanism: str,
    chunked: bool,
    size: int,
    seed: int,
) -> None:
    """Random moves of requests holding cache references (kept on the source
    until the final copy is done; private on the destination): every invariant
    after every event, every request finishes."""
    reqs = hashed(items, size)
    c = cfg(
        cluster={"mem_util": 0.33, "gpus": 3},
        policy={"stack": "bf", "migration": "_test_pc_random"},
        migration={"mechanism": mechanism, "epoch_s": 0.2, "max_stages": 3},
        engine={"chunked_prefill": chunked, "max_batched_tokens": 512},
        seed=seed,
    )
    res = run(c, reqs)
    assert_ended_once(res, len(reqs))
    assert all(r.status == "finished" for r in res.records)
    check_hits(res, reqs, 16)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=items_st,
    chunked=st.booleans(),
    migrate=st.booleans(),
    seed=st.integers(0, 2**16),
    bs=st.sampled_from([16, 24]),
    size=st.sampled_from([40, 64, 512]),
)
@example(  # a segment past a preemption must stop when a cached prompt could be admitted
    items=[
        (0.0, 0, 0, 1, 1),
        (0.6, 0, 4, 242, 120),
        (0.125, 0, 0, 1, 4),
        (0.34375, 0, 2, 1, 147),
        (0.375, 0, 0, 1, 69),
        (0.5, 2, 4, 3, 86),
        (0.34375, 1, 3, 174, 69),
        (0.46875, 1, 4, 241, 33),
    ],
    chunked=False,
    migrate=True,
    seed=39999,
    bs=16,
    size=64,
)
def test_macro_steps_exact_with_prefix_caching(
    items: list[tuple[float, int, int, int, int]],
    chunked: bool,
    migrate: bool,
    seed: int,
    bs: int,
    size: int,
) -> None:
    """Evictions happen in LRU order before any lookup could tell, so
    macro-stepped and iteration-by-iteration runs stay identical (random
    moves of requests holding references included). Before session 29 a
    test also held the groups' caches to the single-model instance's, draw
    for draw: every outcome, hit, counter, sample and move."""
    reqs = hashed(items, size)
    over: dict[str, Any] = {
        "cluster": {"mem_util": 0.33, "gpus": 3 if migrate else 2, "block_size": bs},
        "engine": {"chunked_prefill": chunked, "max_batched_tokens": 512},
        "check_integrity": False,
        "seed": seed,
    }
    if migrate:
        over["policy"] = {"stack": "bf", "migration": "_test_pc_random"}
        over["migration"] = {"epoch_s": 0.2, "max_stages": 3}
    fast = run(cfg(**over), reqs)
    slow = run(cfg(macro_steps=False, **over), reqs)
    assert outcome(fast) == outcome(slow)
    assert [r.cached_tokens for r in fast.records] == [r.cached_tokens for r in slow.records]
    assert fast.timeseries == slow.timeseries

    # Moves that end at the same instant may be recorded in either order: two
    # instances whose iterations end at exactly the same time (identical
    # requests from t = 0) detach their movers in the order of their
    # iteration-end events, and a segment's end event is pushed at its start,
    # an iteration's at its own (found by hypothesis, session 24). Everything
    # else, outcomes and times included, is identical.
    def key(m: Any) -> tuple[float, int]:
        return (m.time_s, m.request_id)

    assert sorted(fast.migrations, key=key) == sorted(slow.migrations, key=key)
    assert summarize(fast)["prefix_cache"] == summarize(slow)["prefix_cache"]


# ----------------------------------------------------------------- behaviour


def test_identical_prefixes_hit_and_lower_ttft() -> None:
    """Requests sharing a 3,072-token prefix: all but the first hit it, do not
    recompute it, and reach their first token sooner than without caching."""
    reqs = [conv(i, 2.0 * i, 7, 6, 200, 30, 512) for i in range(6)]
    on = run(cfg(), reqs)
    off = run(cfg(engine={"prefix_caching": False}), reqs)
    assert [r.cached_tokens for r in on.records] == [0] + [3072] * 5
    assert all(r.cached_tokens == 0 for r in off.records)
    for a, b in zip(on.records[1:], off.records[1:], strict=True):
        assert a.ttft_s is not None and b.ttft_s is not None and a.ttft_s < b.ttft_s
    assert on.records[0].ttft_s == off.records[0].ttft_s
    pc = summarize(on)["prefix_cache"]
    assert pc["requests_hit"] == 5 and pc["requests"] == 6
    assert pc["hit_rate"] == pytest.approx(5 * 3072 / (6 * 3272))
    assert "prefix_cache" not in summarize(off)


def test_a_hit_costs_a_chunk_over_cached_tokens() -> None:
    """The second prefill is the cost model's chunk of the uncached tokens on
    top of the cached ones, exactly."""
    cost = CostModel().bind(get_model(MODEL), get_gpu("a100-40gb"))
    reqs = [conv(0, 0.0, 1, 2, 100, 5, 512), conv(1, 5.0, 1, 2, 300, 5, 512)]
    res = run(cfg(), reqs)
    r0, r1 = res.records
    assert r0.first_token_s == pytest.approx(cost.prefill_time([1124]), rel=1e-12)
    assert r1.cached_tokens == 1024
    assert r1.ttft_s == pytest.approx(cost.mixed_time([(300, 1024)], 0, 0), rel=1e-12)


def test_trace_blocks_onto_kv_blocks() -> None:
    """40-token trace blocks on 16-token KV blocks: 5 full blocks (200 tokens)
    own floor(200 / 16) = 12 KV blocks (192 tokens); the KV block straddling
    tokens 192-207 is recomputed."""
    reqs = [conv(0, 0.0, 1, 5, 10, 5, 40), conv(1, 5.0, 1, 5, 10, 5, 40)]
    res = run(cfg(), reqs)
    assert res.records[1].cached_tokens == 192
    reqs = [conv(0, 0.0, 1, 3, 30, 5, 40), conv(1, 5.0, 1, 5, 30, 5, 40)]
    assert run(cfg(), reqs).records[1].cached_tokens == 112  # floor(120 / 16) * 16


def test_a_whole_prompt_hit_still_computes_its_last_block() -> None:
    """A prompt of exactly two cached blocks hits one: the last token's logits
    must be computed, and a trace block is hit as a whole."""
    reqs = [
        conv(0, 0.0, 1, 2, 1, 5, 512),
        Request(1, MODEL, 5.0, 1024, 5, prefix_blocks=(1000, 1001), prefix_block_tokens=512),
    ]
    res = run(cfg(), reqs)
    assert res.records[1].cached_tokens == 512


def test_shared_blocks_count_once() -> None:
    """Two requests decoding side by side on one 2,048-token prefix hold it once."""
    reqs = [conv(0, 0.0, 1, 4, 100, 400, 512), conv(1, 0.5, 1, 4, 300, 400, 512)]
    seen: list[tuple[int, int]] = []

    def observe(inst: GroupInstance, now: float) -> None:
        if len(inst.running) == 2:
            kv = sum(blocks_for(s.kv_tokens, inst.block_size) for s in inst.running.values())
            seen.append((inst.used_blocks, kv))

    Simulator(cfg(), reqs, on_iteration_end=observe).run()
    assert seen
    for used, kv in seen:
        assert used == kv - 2048 // 16


def test_eviction_is_lru_and_tail_first() -> None:
    """Unreferenced entries are evicted oldest first, a request's last block
    before its first; a fit evicts whole entries until the rest fits."""
    stats = PrefixStats()
    cache = PrefixCache(16, stats)

    def seq(i: int, ids: tuple[int, ...]) -> Seq:
        r = Request(i, MODEL, 0.0, 64 * len(ids) + 1, 1, prefix_blocks=ids, prefix_block_tokens=64)
        from fleetserve.metrics.records import RequestRecord

        return Seq(r, RequestRecord(i, MODEL, 0.0, r.prompt_tokens, 1))

    a, b = seq(0, (1, 2, 3)), seq(1, (7, 8))
    for s in (a, b):
        s.refs = []
        cache.publish(s, s.prompt_tokens)
        assert s.shared == 4 * len(s.refs)
    assert cache.release(a.refs) == 12 and cache.release(b.refs) == 8
    assert [k[2] for k in cache.lru] == [3, 2, 1, 8, 7]
    cache.fit(13)  # 20 evictable: evict 3 (4 blocks) and 2 (4 blocks)
    assert [k[2] for k in cache.lru] == [1, 8, 7] and cache.evictable == 12
    assert stats.evicted_blocks == 8
    # block 1 is still cached, but without block 2 the chain stops there
    c = seq(2, (1, 2, 3))
    hits, tokens = cache.lookup(c, c.prompt_tokens)
    assert [e.key[2] for e in hits] == [1] and tokens == 64
    assert cache.acquire(hits) == 4 and cache.evictable == 8


def test_no_hashes_is_the_same_run_as_caching_off() -> None:
    """Without prefix-block ids caching on changes nothing: every record, the
    time series, the pool; only the summary gains its prefix_cache section."""
    rng = np.random.default_rng(5)
    n = 250
    t = np.cumsum(rng.exponential(1 / 8.0, n))
    p = rng.integers(1, 1200, n)
    o = rng.integers(1, 300, n)
    reqs = [Request(i, MODEL, float(t[i]), int(p[i]), int(o[i])) for i in range(n)]
    for stack, chunked, gpus in (("vllm", False, 2), ("bf", True, 2), ("llumnix", False, 3)):
        over: dict[str, Any] = {
            "policy": {"stack": stack},
            "cluster": {"mem_util": 0.33, "gpus": gpus},
            "check_integrity": False,
        }
        on = run(cfg(engine={"chunked_prefill": chunked}, **over), reqs)
        off = run(cfg(engine={"chunked_prefill": chunked, "prefix_caching": False}, **over), reqs)
        assert outcome(on) == outcome(off)
        assert on.timeseries == off.timeseries
        assert on.migrations == off.migrations
        assert sum(r.preemptions for r in off.records) > 0
        s_on, s_off = summarize(on), summarize(off)
        assert s_on["prefix_cache"]["hit_tokens"] == 0
        for k in ("requests", "latency_s", "throughput_rps", "gpus", "kv_utilization"):
            assert s_on[k] == s_off[k]


def test_other_worlds_refuse_prefix_caching() -> None:
    multi = {
        "engine": {"prefix_caching": True},
        "services": [{"name": "a", "model": MODEL}],
        "cluster": {"gpus": 2, "elastic": False},
        "policy": {"stack": "muxserve"},
    }
    kun = {
        "engine": {"prefix_caching": True},
        "policy": {"stack": "kunserve"},
        "cluster": {"elastic": False, "gpus": 2},
    }
    for data in (multi, kun):
        with pytest.raises(ConfigError, match="prefix_caching"):
            check_world(config_from_dict({"model": MODEL, **data}))
    check_world(cfg())


def test_serve_reads_the_same_key() -> None:
    """One key for both clocks: ``fleetserve serve`` takes it for its engines
    (``tests/test_runtime_sharing.py`` checks it reaches every worker)."""
    from fleetserve.cli.serve import load_serve_config

    assert load_serve_config(None, ["engine.prefix_caching=true"]).engine.prefix_caching
    assert not load_serve_config(None, []).engine.prefix_caching


# ------------------------------------------------------------------ workload


def test_request_validates_its_prefix_blocks() -> None:
    Request(0, MODEL, 0.0, 1025, 1, prefix_blocks=(1, 2, 3), prefix_block_tokens=512)
    with pytest.raises(ConfigError, match="more than"):
        Request(0, MODEL, 0.0, 1024, 1, prefix_blocks=(1, 2, 3), prefix_block_tokens=512)
    for blocks, size in (((1,), None), (None, 512), ((), 512), ((1,), 0)):
        with pytest.raises(ConfigError, match="go together"):
            Request(0, MODEL, 0.0, 10, 1, prefix_blocks=blocks, prefix_block_tokens=size)


def test_length_changes_keep_prefix_blocks_honest() -> None:
    r = Request(0, MODEL, 0.0, 1300, 10, prefix_blocks=(1, 2, 3), prefix_block_tokens=512)
    # scaled: every token stands for f tokens, the blocks too
    (s,), _ = scale_lengths([r], 10.0)
    assert (s.prompt_tokens, s.prefix_blocks, s.prefix_block_tokens) == (13000, (1, 2, 3), 5120)
    (s,), _ = scale_lengths([r], 0.5)
    assert (s.prompt_tokens, s.prefix_blocks, s.prefix_block_tokens) == (650, (1, 2, 3), 256)
    # capped: the head of the prompt stays, blocks past it go
    (s,), n = scale_lengths([r], 1.0 + 1e-9, cap_tokens=700)
    assert n == 1 and s.length_capped and s.prompt_tokens < 700
    assert s.prefix_blocks == (1, 2)[: -(-s.prompt_tokens // 512)]
    assert with_lengths(r, 400, 10).prefix_blocks == (1,)
    # a block that rounds to nothing drops the ids
    tiny = with_lengths(r, 1, 1, scale=1e-4)
    assert tiny.prefix_blocks is None and tiny.prefix_block_tokens is None
    plain = Request(1, MODEL, 0.0, 100, 10)
    assert with_lengths(plain, 50, 5).prefix_blocks is None


def test_mooncake_loader_keeps_hash_ids(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 9]},
        {"timestamp": 6000, "input_length": 100, "output_length": 5},
        {"timestamp": 9000, "input_length": 100, "output_length": 5, "hash_ids": []},
    ]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_trace(f, "mooncake").requests
    assert [r.prefix_blocks for r in got] == [(0, 1, 2), (0, 9), None, None]
    assert [r.prefix_block_tokens for r in got] == [512, 512, None, None]
    for bad, msg in (([0, 1, 2], "more than"), ([0, "x"], "integer"), ("ab", "integer")):
        rows[1]["hash_ids"] = bad
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(InputError, match=msg) as e:
            load_trace(f, "mooncake")
        assert "t.jsonl:2" in str(e.value) and "hash_ids" in str(e.value)


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"{MOONCAKE} not present")
def test_mooncake_window_hits() -> None:
    """The first 150 requests of the Mooncake conversation trace on two
    A800s: conversation turns hit their earlier turns' prefixes."""
    data = {
        "model": "qwen-2.5-14b",
        "workload": {"trace": str(MOONCAKE), "format": "mooncake", "max_requests": 150},
        "cluster": {"gpu": "a800-80gb", "elastic": False, "gpus": 2},
        "engine": {"prefix_caching": True},
        "check_integrity": True,
    }
    c = config_from_dict(data)
    reqs = build_workload(c).requests
    assert all(r.prefix_block_tokens == 512 for r in reqs if r.prefix_blocks is not None)
    res = run(c, reqs)
    pc = summarize(res)["prefix_cache"]
    # block 0 (a shared system prompt) almost always; whole earlier turns rarely
    # this early in the trace (the ideal, one infinite cache, is 4.6 %)
    assert pc["requests_hit"] > 100 and pc["hit_rate"] > 0.02
    check_hits(res, reqs, 16)
