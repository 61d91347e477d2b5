"""The vLLM / OpenAI sampling fields (``min_tokens``, ``stop_token_ids``,
``repetition_penalty``, ``logit_bias``): validation, the logits processing on
one row against a hand-computed reference, and their effect on real runs of
the built-in tiny model in an engine (greedy batch fast path included), a
pipeline group and a buddy group."""

from __future__ import annotations

import asyncio
import math
import pickle
from collections.abc import Iterator, Sequence

import pytest

torch = pytest.importorskip("torch")

from fleetserve.errors import ConfigError  # noqa: E402
from fleetserve.runtime.buddy import (  # noqa: E402
    GroupRunner,
    StageResult,
    StageRole,
    StageWork,
    stage_forward,
)
from fleetserve.runtime.engine.engine import Engine, EngineRequest  # noqa: E402
from fleetserve.runtime.engine.model import dense_forward  # noqa: E402
from fleetserve.runtime.engine.pipeline import PipelineGroup  # noqa: E402
from fleetserve.runtime.engine.sampling import (  # noqa: E402
    SamplingParams,
    needs_logits_processing,
    process_logits,
)
from fleetserve.runtime.engine.weights import load_weight_source, model_weights  # noqa: E402

A = "tiny-llama-a"
MiB = 1 << 20
EOS = 257  # the byte tokenizer's EOS
Z = ord("z")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny matmuls gain nothing from more."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def eng() -> Engine:
    return Engine([A], 48 * MiB)


def run(eng: Engine, prompt: str, p: SamplingParams) -> tuple[EngineRequest, list[str]]:
    pieces: list[str] = []
    rid = eng.add_request(A, prompt, p, on_token=lambda r, t, s: pieces.append(s))
    while eng.has_work():
        eng.step()
    return eng.pop_finished(rid), pieces


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids"),
        ({"stop_token_ids": ("a",)}, "stop_token_ids"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.2}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"logit_bias": ((5, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((5, -101),)}, "logit_bias"),
        ({"logit_bias": ((5, math.nan),)}, "logit_bias"),
        ({"logit_bias": ((-5, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias"),
        ({"logit_bias": ((5,),)}, "logit_bias"),
        ({"logit_bias": 3}, "logit_bias"),
    ],
)
def test_bad_fields_are_config_errors_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


def test_params_stay_hashable_and_picklable() -> None:
    p = SamplingParams(
        max_tokens=8,
        min_tokens=2,
        stop=["x"],  # type: ignore[arg-type]
        stop_token_ids=[5, 6],  # type: ignore[arg-type]
        repetition_penalty=1.2,
        logit_bias={7: 3, 9: -100.0},  # type: ignore[arg-type]
    )
    assert p.stop == ("x",) and p.stop_token_ids == (5, 6)
    assert p.logit_bias == ((7, 3.0), (9, -100.0))
    assert isinstance(hash(p), int)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and hash(q) == hash(p)
    assert SamplingParams(min_tokens=16, max_tokens=16).min_tokens == 16  # the bound is inclusive


def test_check_vocab_names_the_field(eng: Engine) -> None:
    SamplingParams(stop_token_ids=(259,), logit_bias=((0, 1.0),)).check_vocab(260)
    with pytest.raises(ConfigError, match=r"stop_token_ids.*260"):
        SamplingParams(stop_token_ids=(260,)).check_vocab(260)
    with pytest.raises(ConfigError, match=r"logit_bias.*300"):
        SamplingParams(logit_bias=((1, 1.0), (300, 1.0))).check_vocab(260)
    with pytest.raises(ConfigError, match="logit_bias"):  # the engine checks at admission
        eng.add_request(A, "hi", SamplingParams(logit_bias=((260, 1.0),)))
    assert not eng.has_work()


# ------------------------------------------------------------ logits, one row
def reference_process(
    row: list[float], p: SamplingParams, tokens: Sequence[int], generated: int
) -> list[float]:
    """By hand: bias, ban under min_tokens, then the repetition penalty (HF/vLLM)."""
    x = list(row)
    for t, b in p.logit_bias:
        x[t] += b
    if generated < p.min_tokens:
        for t in {*p.stop_token_ids, *(() if p.ignore_eos else (EOS,))}:
            x[t] = -math.inf
    for t in set(tokens):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    return x


def test_process_logits_matches_a_hand_computed_row() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, -3.0, 0.0, 4.0])
    p = SamplingParams(repetition_penalty=2.0)
    # ids 0, 1 and 4 were seen (prompt or output, repeated or not); 0 and 5 / 2 / 3 not
    got = process_logits(row, p, [0, 1, 1, 4], 1, ())
    assert got.tolist() == [1.0, -2.0, 0.5, -3.0, 0.0, 4.0]
    assert row.tolist() == [2.0, -1.0, 0.5, -3.0, 0.0, 4.0]  # the input is not modified
    p = SamplingParams(
        max_tokens=4,
        min_tokens=2,
        stop_token_ids=(3,),
        repetition_penalty=2.0,
        logit_bias=((1, 5.0), (2, -1.5)),
    )
    got = process_logits(row, p, [0, 1], 1, (5,))
    # bias: [2, 4, -1, -3, 0, 4]; ban 3 and EOS 5; penalty on 0 and 1 (after the bias)
    assert got.tolist() == [1.0, 2.0, -1.0, -math.inf, 0.0, -math.inf]
    assert process_logits(row, p, [0, 1], 2, (5,)).tolist() == [1.0, 2.0, -1.0, -3.0, 0.0, 4.0]
    ignore = SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True)
    assert process_logits(row, ignore, [0], 0, (5,)).tolist() == row.tolist()  # EOS allowed


def test_default_fields_are_a_no_op_fast_path() -> None:
    row = torch.randn(260)
    p = SamplingParams(temperature=0.7, top_k=5, stop=("x",), stop_token_ids=(3,))
    assert not needs_logits_processing(p, 0)
    assert process_logits(row, p, [1, 2, 3], 0, (EOS,)) is row
    m = SamplingParams(max_tokens=5, min_tokens=2)
    assert needs_logits_processing(m, 1) and not needs_logits_processing(m, 2)


def test_random_rows_match_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    for i in range(50):
        row = torch.randn(260, generator=g) * 5
        toks = torch.randint(0, 260, (30,), generator=g).tolist()
        p = SamplingParams(
            max_tokens=10,
            min_tokens=i % 4,
            stop_token_ids=(toks[0], 7),
            repetition_penalty=0.5 + i / 20,
            logit_bias=tuple((t, float(t % 41 - 20)) for t in sorted(set(toks[:5]))),
        )
        got = process_logits(row, p, toks, i % 3, (EOS,))
        want = reference_process(row.tolist(), p, toks, i % 3)
        assert got.tolist() == pytest.approx(want, rel=1e-6)


# ------------------------------------------------------------------ an engine
def test_logit_bias_plus_100_forces_a_token(eng: Engine) -> None:
    for temperature in (0.0, 0.8):
        p = SamplingParams(max_tokens=6, temperature=temperature, logit_bias=((Z, 100.0),))
        req, pieces = run(eng, "Hello world", p)
        assert req.output_ids == [Z] * 6 and req.text == "zzzzzz" == "".join(pieces)
        assert req.finish_reason == "length"
    # -100 bans: the greedy first token never comes
    first = eng.generate(A, ["Hello world"], SamplingParams(max_tokens=1))[0][0]
    banned = eng.generate(
        A, ["Hello world"], SamplingParams(max_tokens=8, logit_bias=((first, -100.0),))
    )[0]
    assert first not in banned


def test_min_tokens_holds_off_an_eos_greedy_would_pick(eng: Engine) -> None:
    push_eos = ((EOS, 100.0),)
    req, _ = run(eng, "Hello world", SamplingParams(max_tokens=8, logit_bias=push_eos))
    assert req.output_ids == [EOS] and req.finish_reason == "stop" and req.text == ""
    p = SamplingParams(max_tokens=8, min_tokens=3, logit_bias=push_eos)
    req, pieces = run(eng, "Hello world", p)
    assert req.finish_reason == "stop"
    assert len(req.output_ids) == 4 and req.output_ids[-1] == EOS
    assert EOS not in req.output_ids[:3]
    # the first three are what greedy gives with EOS removed
    ban = SamplingParams(max_tokens=3, logit_bias=((EOS, -100.0),))
    assert req.output_ids[:3] == eng.generate(A, ["Hello world"], ban)[0]
    assert req.text == "".join(pieces)
    # ignore_eos: min_tokens bans nothing, EOS is generated and does not stop
    p = SamplingParams(max_tokens=3, min_tokens=3, ignore_eos=True, logit_bias=push_eos)
    req, _ = run(eng, "Hello world", p)
    assert req.output_ids == [EOS] * 3 and req.finish_reason == "length"


def full_greedy(eng: Engine, prompt: str) -> list[int]:
    return eng.generate(A, [prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]


def test_stop_token_ids_end_with_stop_and_leave_the_token_text_out(eng: Engine) -> None:
    prompt = "abc"
    full = full_greedy(eng, prompt)
    # the first ASCII token, new at its place, after an ASCII start
    k = next(i for i in range(1, len(full)) if full[i] not in full[:i] and max(full[: i + 1]) < 128)
    tok = full[k]
    p = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(tok,))
    req, pieces = run(eng, prompt, p)
    assert req.finish_reason == "stop"
    assert req.output_ids == full[: k + 1]
    assert req.text == eng.tokenizer(A).decode(full[:k]) == "".join(pieces)
    assert chr(tok) not in req.text
    # min_tokens bans the stop token too: it cannot end the request early
    p = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(tok,), min_tokens=k + 2)
    req, _ = run(eng, prompt, p)
    assert tok not in req.output_ids[: k + 2]


def test_stop_strings_are_not_checked_before_min_tokens(eng: Engine) -> None:
    p = SamplingParams(max_tokens=6, logit_bias=((Z, 100.0),), stop=("zz",))
    req, _ = run(eng, "Hello", p)
    assert req.finish_reason == "stop" and req.text == "" and len(req.output_ids) == 2
    p = SamplingParams(max_tokens=6, min_tokens=3, logit_bias=((Z, 100.0),), stop=("zz",))
    req, pieces = run(eng, "Hello", p)
    # "zz" completed by tokens 2 is let through; the one the 3rd token completes stops
    assert req.finish_reason == "stop" and len(req.output_ids) == 3
    assert req.text == "z" == "".join(pieces)


def engine_reference(prompt: str, p: SamplingParams, n: int) -> list[int]:
    """Greedy continuation from the dense forward, the row processed by hand."""
    src = load_weight_source(A)
    w = model_weights(src)
    ids = Engine([(A, [])], 4 * MiB).tokenizer(A).encode(prompt)
    out: list[int] = []
    for _ in range(n):
        row = dense_forward(src.cfg, w, ids + out)[-1].tolist()
        x = reference_process(row, p, ids + out, len(out))
        out.append(max(range(len(x)), key=x.__getitem__))
    return out


def test_repetition_penalty_changes_greedy_and_matches_the_reference(eng: Engine) -> None:
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    pen = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    base, _ = run(eng, "Hello world", plain)
    got, _ = run(eng, "Hello world", pen)
    assert got.output_ids != base.output_ids
    assert got.output_ids == engine_reference("Hello world", pen, 12)
    # plain greedy repeats tokens; penalized, it repeats fewer
    assert len(set(got.output_ids)) > len(set(base.output_ids))


def test_processed_and_plain_greedy_requests_share_a_step(eng: Engine) -> None:
    """The batch argmax fast path must not serve a request whose logits are processed."""
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    mixed = [
        plain,
        SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((Z, 100.0),)),
        SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_tokens=6, min_tokens=6, logit_bias=((EOS, 100.0),)),
    ]
    alone = [eng.generate(A, ["Hello world"], p)[0] for p in mixed]
    rids = [eng.add_request(A, "Hello world", p) for p in mixed]
    steps = 0
    while eng.has_work():
        out = eng.step()
        steps += 1
        if steps == 1:
            assert sorted(out.prefilled) == sorted(rids)  # one batch, one forward
    assert [eng.pop_finished(r).output_ids for r in rids] == alone
    assert alone[1] == [Z] * 6 and EOS not in alone[3]


# --------------------------------------------------- pipeline and buddy groups
PIPE_PARAMS = [
    SamplingParams(max_tokens=8, min_tokens=4, logit_bias=((EOS, 100.0), (Z, 5.0))),
    SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.4),
    SamplingParams(max_tokens=8, temperature=0.9, seed=3, logit_bias=((Z, 2.0),)),
    SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(Z,), logit_bias=((Z, 100.0),)),
]


def test_pipeline_group_applies_the_fields_like_the_engine() -> None:
    stages = [
        (Engine([(A, range(0, 2))], 24 * MiB, engine_id=0), range(0, 2)),
        (Engine([(A, range(2, 4))], 24 * MiB, engine_id=1), range(2, 4)),
    ]
    group = PipelineGroup(stages, A)
    for p in PIPE_PARAMS:
        want = Engine([A], 48 * MiB).generate(A, ["Hello world"], p)[0]
        rid = group.add_request("Hello world", p)
        while group.has_work():
            group.step()
        assert group.pop_finished(rid).output_ids == want
    with pytest.raises(ConfigError, match="stop_token_ids"):
        group.add_request("x", SamplingParams(stop_token_ids=(999,)))


def test_buddy_group_applies_the_fields_like_the_engine() -> None:
    s0 = Engine([(A, range(0, 2))], 24 * MiB, engine_id=0)
    s1 = Engine([(A, range(2, 4))], 24 * MiB, engine_id=1)
    stages = ((0, (0, 2)), (1, (2, 4)))
    role0, role1 = StageRole(0, A, 0, stages), StageRole(0, A, 1, stages)
    held1: set[int] = set()
    emitted: dict[int, list[str]] = {}
    done: dict[int, str] = {}
    runner = GroupRunner(
        s0,
        role0,
        max_running=8,
        max_batch_tokens=1024,
        stage_free=[s0.pool.num_free, s1.pool.num_free],
        stage_total=[s0.pool.num_free, s1.pool.num_free],
        held=set(),
        emit=lambda rid, i, tok, piece: emitted.setdefault(rid, []).append(piece),
        finish=lambda rid, reason: done.__setitem__(rid, reason),
    )

    async def call(j: int, work: StageWork) -> StageResult:
        assert j == 1
        return stage_forward(s1, role1, work, held1)

    ids = s0.tokenizer(A).encode("Hello world")
    reqs = {100 + i: p for i, p in enumerate(PIPE_PARAMS)}
    for rid, p in reqs.items():
        runner.add(rid, list(ids), p, 0.0)
    out: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    while runner.has_work():
        live = dict(runner.requests)  # a request leaves the runner when it ends
        asyncio.run(runner.step(call))
        for rid, req in live.items():
            out[rid], texts[rid] = list(req.tokens), req.text
    for rid, p in reqs.items():
        e = Engine([A], 48 * MiB)
        r = e.add_request(A, "Hello world", p, request_id=rid)
        while e.has_work():
            e.step()
        want = e.pop_finished(r)
        assert out[rid][len(ids) :] == want.output_ids, p
        assert done[rid] == want.finish_reason
        assert texts[rid] == want.text == "".join(emitted[rid])
