"""One request state for the three simulated worlds (issue 21 item 2, step 1)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from fleetserve.metrics.records import RequestRecord
from fleetserve.sim import group, group_instance, kun, kun_parts, migration, multi, seq
from fleetserve.sim.seq import PREFILLING, RUNNING, WAITING, Seq
from fleetserve.workload.request import Request


def _seq(prompt: int, output: int) -> Seq:
    r = Request(id=0, arrival_s=0.0, prompt_tokens=prompt, output_tokens=output, model="m")
    return Seq(r, RequestRecord(r.id, r.model, r.arrival_s, r.prompt_tokens, r.output_tokens))


@dataclass
class _Holder:
    """A batch that steps together: ``decode_steps`` iterations done, one more
    in flight when ``in_flight`` (its token's KV is allocated)."""

    decode_steps: int
    in_flight: bool

    def kv_steps(self) -> int:
        return self.decode_steps + self.in_flight


def test_every_world_uses_the_one_class() -> None:
    for mod in (group, group_instance, kun, migration, multi):
        assert mod.Seq is seq.Seq, mod.__name__
    assert not hasattr(kun_parts, "KSeq") and not hasattr(group, "GSeq")


@given(
    prompt=st.integers(1, 4000),
    gen=st.integers(1, 500),
    steps=st.integers(0, 10_000),
    in_flight=st.booleans(),
)
def test_bound_and_explicit_counts_agree(
    prompt: int, gen: int, steps: int, in_flight: bool
) -> None:
    """A request bound to a batch reads its counts from the batch's step counter;
    unbinding it at a boundary (what a preemption, a detach or an unrun does)
    keeps them; ``demand_tokens`` is ``max(kv, prompt + generated)`` both ways."""
    s = _seq(prompt, gen + 1000)
    h = _Holder(steps, in_flight)
    kv = prompt + gen - 1  # a running request caches all but its newest token
    s.batch, s.state, s.bound, s.base = h, RUNNING, True, kv - steps
    assert s.generated == gen
    assert s.kv_tokens == kv + in_flight
    assert s.demand_tokens == max(s.kv_tokens, prompt + s.generated)
    assert s.decoding and not s.migrating
    if not in_flight:  # unbind at the boundary, as the worlds do
        s.bound, s.gen_saved, s.kv_saved = False, s.generated, s.kv_tokens
        assert (s.generated, s.kv_tokens) == (gen, kv)
        assert s.demand_tokens == max(kv, prompt + gen)


def test_a_re_prefilling_request_holds_kv_but_does_not_decode() -> None:
    s = _seq(100, 50)
    s.state, s.gen_saved = WAITING, 7  # preempted after 7 tokens
    assert s.kv_tokens == 0 and not s.decoding
    s.state, s.kv_saved = PREFILLING, s.prefill_tokens
    assert s.kv_tokens == 107 and s.generated == 7 and not s.decoding
