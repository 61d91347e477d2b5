r"""Analytic roofline cost model: how long one serving iteration takes.

An *iteration* is one forward pass of a continuous-batching engine over a batch
that may mix prefill chunks and decode tokens. Its time on a tensor-parallel
group of ``tp`` identical GPUs is, in the legacy form (one roofline ``max`` over
the whole pass: emulated GPUs and the runtime's calibrations use it; catalog GPUs
use the per-operation form described further down)

.. code-block:: text

    t = overhead_s + t_comm + max(t_compute, t_memory)

    t_compute = (2 P_lin T + 2 V h N_logit) / (tp F compute_eff)      dense matmuls
              + 4 L_a H d_h S                / (tp F attn_eff)         attention
    t_memory  = (W_stream + kv_tok (R + T))  / (tp B mem_eff)
    t_comm    = [tp > 1] * (2 L_r allreduce_latency_s
                            + 2 L_r T h b 2 (tp-1)/tp / (I allreduce_eff))

with, from :class:`~fleetserve.spec.types.ModelSpec` / :class:`GpuSpec`:

* ``F`` = ``gpu.bf16_flops``, ``B`` = ``gpu.hbm_bw``, ``I`` = ``gpu.intra_node_bw``;
* ``L_r`` = layers executed (``num_layers`` minus cross-attention layers, which
  text-only requests skip), ``L_a`` = ``L_r`` (self-attention layers);
* ``P_lin`` = ``L_r * params_per_layer`` (every weight of a layer is used once
  per token in a multiply-add: 2 FLOP per parameter per token);
* ``V h`` = lm_head parameters (vocab x hidden), applied to ``N_logit`` rows only:
  the last token of each prefill chunk and every decode token (engines gather the
  last hidden state before the lm_head);
* ``H d_h`` = ``num_heads * head_dim`` (query width; GQA shares K/V but not the
  score/value FLOPs);
* ``W_stream`` = weight bytes read per iteration = ``L_r * weight_bytes_per_layer
  + V h b`` (the lm_head, or the tied embedding used as lm_head, + final norm);
  the input-embedding table of an untied model is only gathered, not streamed;
* ``kv_tok`` = ``kv_bytes_per_token``; ``b`` = ``dtype_bytes``; ``h`` = hidden size.

and, from the batch:

* ``T`` = new tokens processed (prompt tokens of the prefill chunks + one per
  decode sequence); each also writes its K/V (``kv_tok T`` bytes);
* ``S`` = query-key pairs of attention: a chunk of ``n`` new tokens on top of ``c``
  cached ones contributes ``n c + n (n + 1) / 2`` (causal), a decode sequence with
  context ``x`` (including the token being appended) contributes ``x``; each pair
  costs ``4 H d_h`` FLOP per layer (``2 d`` for ``q.k`` and ``2 d`` for ``p.v``).
  A whole prompt of length ``l`` thus costs ``2 L H d_h l (l + 1)`` attention FLOP;
* ``R`` = cached KV tokens read: ``c`` per prefill chunk, ``x`` per decode sequence
  (a whole-prompt prefill reads no cache: ``R = 0``).

Everything is divided evenly across the ``tp`` GPUs (Megatron sharding: heads,
MLP columns/rows, vocab). The ring all-reduce after attention and after the MLP
(two per layer) moves ``2 (tp - 1) / tp`` times the ``T h b``-byte activation
through each GPU's link, plus a fixed latency per collective.

For a decode iteration with ``batch`` sequences reading ``x`` KV tokens in total,
both roofline branches are linear in ``x``::

    t(x) = K(batch) + max(A_c(batch) + B_c x, A_m(batch) + B_m x)

which :meth:`InstanceCost.decode_time` evaluates elementwise and
:meth:`InstanceCost.ideal_times` sums in closed form (splitting the context range
where the two lines cross).

Decode attention (extension). With ``decode_attn_eff`` set (see
:mod:`fleetserve.costmodel.params`), the query-key pairs of decode sequences
(one new token over ``x`` cached ones) cost ``4 H d_h / (tp F decode_attn_eff)``
per layer instead of the ``attn_eff`` price prompt chunks pay; ``S`` above
then splits into prompt pairs and decode pairs. Left None (the default) the
two are one term and every time is exactly what it was before the extension
(the same floating-point operations in the same order).

The per-operation form (``matmul_knee`` set: every catalog GPU's default).
A forward pass runs its kernels one after another, each on its own roofline;
measured GEMMs are slower than the ``max`` of their two terms where neither
dominates (``docs/calibration.md``: 25-40 % between 17 and 256 tokens). So::

    t = overhead_s + t_comm + t_lat + t_linear + t_elem + t_attn_prompt + t_attn_decode

    t_lat     = (4 L_r + 1) kernel_latency_s + L_r elementwise_latency_s
    t_linear  = knee(2 P_lin T / (tp F ce s), W_body / (tp B me))
              + knee(2 V h N_logit / (tp F ce s), W_head / (tp B me))
    knee(c, m) = (c^q + m^q)^(1/q)        q = matmul_knee (1: c + m; large: max)
    t_elem    = T L_r h b (rep + shard / tp) / (B me)
    t_attn_prompt = L_a attn_latency_s + max( (R_new + kappa S_tri + w T_p) 4 H d_h / (tp F ae s),
                                              (C_p + T_p) kv_tok / (tp B kme) )
    t_attn_decode = L_a attn_latency_s + max( X 4 H d_h / (tp F dae s),
                                              (X + D) kv_tok / (tp B kme) )

``W_body`` and ``W_head`` split ``W_stream`` into the layers and the lm_head
(+ final norm); ``T_p`` prompt tokens over ``C_p`` cached ones make
``R_new = sum n c`` rectangle pairs and ``S_tri = sum n (n + 1) / 2`` triangle
pairs; ``D`` decode sequences read ``X`` KV tokens; ``s`` is the compute
share (1 unless MuxServe-style spatial sharing); ``ae``/``dae`` = ``attn_eff``
/ the decode attention efficiency, ``kme`` = ``kv_mem_eff``, ``kappa`` =
``attn_causal_factor``, ``w`` = ``attn_query_waste``; an attention term is
only paid when its kernel runs. A decode iteration is still
``max(a_c + b_c x, a_m + b_m x)`` in its context ``x`` (the linear part is a
constant of the batch size): :meth:`InstanceCost.decode_lines`, used by
:meth:`InstanceCost.decode_time` and the closed form of
:meth:`InstanceCost.ideal_times` in both forms. With ``matmul_knee`` None
every time is exactly what it was before the form existed.

The efficiency parameters and their defaults are in
:mod:`fleetserve.costmodel.params`; calibrated values per (model, GPU, tp) come
from :mod:`fleetserve.costmodel.calibration`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from fleetserve.costmodel.params import DEFAULT_PARAMS, EfficiencyParams, gpu_defaults
from fleetserve.costmodel.transfer import Link, transfer_time
from fleetserve.errors import ConfigError
from fleetserve.spec.types import GpuSpec, ModelSpec

if TYPE_CHECKING:
    from fleetserve.costmodel.calibration import Calibration

__all__ = ["CostModel", "Ends", "InstanceCost", "RawCoefficients", "raw_coefficients"]


Ends = list[float] | npt.NDArray[np.float64]
"""End times of a decode segment's iterations, ascending (:meth:`InstanceCost.decode_ends`)."""

_SHORT_SEGMENT = 24
"""Decode segments of at most this many iterations are summed in Python floats
(:meth:`InstanceCost.decode_ends`): below it, cheaper than the array form."""


@dataclass(frozen=True, slots=True)
class RawCoefficients:
    """Per-unit seconds at 100 % efficiency for one (model, GPU, tp); see module docstring.

    Calibration fits efficiencies against these, the cost model divides them by
    the efficiencies. All values are per GPU of the tensor-parallel group.

    Attributes:
        tok_flop_s: dense-matmul seconds per new token (``2 P_lin / (tp F)``).
        logit_flop_s: lm_head seconds per logit row (``2 V h / (tp F)``).
        pair_flop_s: attention seconds per query-key pair (``4 L H d_h / (tp F)``).
        weight_mem_s: seconds to stream the weights once (``W_stream / (tp B)``).
        kv_mem_s: seconds to read or write one token's KV (``kv_tok / (tp B)``).
        comm_tok_s: all-reduce seconds per new token at full link bandwidth
            (0 when tp == 1).
        n_collectives: all-reduces per iteration (``2 L_r`` when tp > 1, else 0).
        head_mem_s: the part of ``weight_mem_s`` that is the lm_head and the
            final norm (``(V h + h) b / (tp B)``).
        act_mem_s: seconds one GPU takes to move one token's hidden state
            (``h b`` bytes) once per executed layer (``L_r h b / B``, not
            divided by ``tp``): the unit of the element-wise traffic.
        n_matmul_kernels: linear-layer kernels per iteration (``4 L_r + 1``:
            QKV, output, MLP up/gate and down per layer, and the lm_head).
        layers: executed layers ``L_r``.
    """

    tok_flop_s: float
    logit_flop_s: float
    pair_flop_s: float
    weight_mem_s: float
    kv_mem_s: float
    comm_tok_s: float
    n_collectives: int
    head_mem_s: float
    act_mem_s: float
    n_matmul_kernels: int
    layers: int


def _executed_layers(model: ModelSpec) -> int:
    """Layers a text-only token passes through (self-attention layers)."""
    return model.kv_bytes_per_token // model.kv_bytes_per_token_per_layer


def raw_coefficients(model: ModelSpec, gpu: GpuSpec, tp: int = 1) -> RawCoefficients:
    """Compute the 100 %-efficiency per-unit costs of ``model`` on ``tp`` x ``gpu``.

    Raises:
        ConfigError: if ``tp`` < 1.
    """
    if tp < 1:
        raise ConfigError(f"tensor-parallel degree must be >= 1, got {tp}")
    layers = _executed_layers(model)
    flops = gpu.bf16_flops * tp
    bw = gpu.hbm_bw * tp
    lm_head = model.vocab_size * model.hidden_size
    p_lin = layers * model.params_per_layer
    head_bytes = (lm_head + model.hidden_size) * model.dtype_bytes
    w_stream = layers * model.weight_bytes_per_layer + head_bytes
    q_width = model.num_heads * model.head_dim
    if tp > 1:
        ring = 2.0 * (tp - 1) / tp
        comm_tok = 2 * layers * model.hidden_size * model.dtype_bytes * ring / gpu.intra_node_bw
        n_coll = 2 * layers
    else:
        comm_tok = 0.0
        n_coll = 0
    return RawCoefficients(
        tok_flop_s=2.0 * p_lin / flops,
        logit_flop_s=2.0 * lm_head / flops,
        pair_flop_s=4.0 * layers * q_width / flops,
        weight_mem_s=w_stream / bw,
        kv_mem_s=model.kv_bytes_per_token / bw,
        comm_tok_s=comm_tok,
        n_collectives=n_coll,
        head_mem_s=head_bytes / bw,
        act_mem_s=layers * model.hidden_size * model.dtype_bytes / gpu.hbm_bw,
        n_matmul_kernels=4 * layers + 1,
        layers=layers,
    )


def _on_compute_side(x: float, a_c: float, b_c: float, a_m: float, b_m: float) -> bool:
    """Whether ``max`` picks the compute line at context ``x`` (same float ops as decode)."""
    return x * b_c + a_c >= x * b_m + a_m


_MAX_EXACT = 2.0**52


def _first_compute_x(a_c: float, b_c: float, a_m: float, b_m: float) -> float:
    """Smallest integer x with compute >= memory, lines with ``b_c > b_m``.

    Starts from the real crossing and nudges it so that the float comparison used
    by :meth:`InstanceCost.decode_time` agrees on both sides of the cut.
    """
    cut = float(math.ceil((a_m - a_c) / (b_c - b_m)))
    if abs(cut) < _MAX_EXACT:
        for _ in range(4):
            if _on_compute_side(cut - 1.0, a_c, b_c, a_m, b_m):
                cut -= 1.0
            elif not _on_compute_side(cut, a_c, b_c, a_m, b_m):
                cut += 1.0
            else:
                break
    return cut


def _last_compute_x(a_c: float, b_c: float, a_m: float, b_m: float) -> float:
    """Largest integer x with compute >= memory, lines with ``b_c < b_m``."""
    cut = float(math.floor((a_m - a_c) / (b_c - b_m)))
    if abs(cut) < _MAX_EXACT:
        for _ in range(4):
            if _on_compute_side(cut + 1.0, a_c, b_c, a_m, b_m):
                cut += 1.0
            elif not _on_compute_side(cut, a_c, b_c, a_m, b_m):
                cut -= 1.0
            else:
                break
    return cut


class InstanceCost:
    """Iteration times of one model instance (model, GPU type, tp), coefficients hoisted.

    Build it with :meth:`CostModel.bind`. All methods are pure.

    Attributes:
        model: the model.
        gpu: the GPU type.
        tp: tensor-parallel degree.
        params: the efficiency parameters in use.
        raw: the 100 %-efficiency coefficients.
    """

    __slots__ = (
        "_c_logit",
        "_c_pair",
        "_c_pair_dec",
        "_c_tok",
        "_c_tok1",
        "_comm_tok",
        "_fixed",
        "_kappa",
        "_lat_a",
        "_lines",
        "_m_body",
        "_m_elem",
        "_m_head",
        "_m_kv",
        "_m_kva",
        "_m_w",
        "_one_prompt",
        "_op",
        "_q",
        "_scaled",
        "_waste",
        "gpu",
        "model",
        "params",
        "raw",
        "tp",
    )

    def __init__(self, model: ModelSpec, gpu: GpuSpec, tp: int, params: EfficiencyParams) -> None:
        raw = raw_coefficients(model, gpu, tp)
        self.model = model
        self.gpu = gpu
        self.tp = tp
        self.params = params
        self.raw = raw
        p = params
        self._c_tok = raw.tok_flop_s / p.compute_eff
        self._c_logit = raw.logit_flop_s / p.compute_eff
        self._c_tok1 = self._c_tok + self._c_logit  # per decode token (one logit row each)
        self._c_pair = raw.pair_flop_s / p.attn_eff
        # decode pairs: the same coefficient (the very same float) unless the
        # decode-attention extension is set
        self._c_pair_dec = (
            self._c_pair if p.decode_attn_eff is None else raw.pair_flop_s / p.decode_attn_eff
        )
        self._m_w = raw.weight_mem_s / p.mem_eff
        self._m_kv = raw.kv_mem_s / p.mem_eff
        self._comm_tok = raw.comm_tok_s / p.allreduce_eff
        self._fixed = p.overhead_s + raw.n_collectives * p.allreduce_latency_s
        self._scaled = p.decode_batch_scale is not None
        # the per-operation form (matmul_knee set): see the module docstring
        self._op = p.matmul_knee is not None
        self._q = p.matmul_knee if p.matmul_knee is not None else 0.0
        self._m_head = raw.head_mem_s / p.mem_eff
        self._m_body = self._m_w - self._m_head
        self._m_kva = raw.kv_mem_s / p.kv_memory_eff
        self._m_elem = raw.act_mem_s * (p.elementwise_rep + p.elementwise_shard / tp) / p.mem_eff
        if self._op:
            self._fixed += (
                raw.n_matmul_kernels * p.kernel_latency_s + raw.layers * p.elementwise_latency_s
            )
        self._lat_a = raw.layers * p.attn_latency_s  # one attention kernel per layer
        self._kappa = p.attn_causal_factor
        self._waste = p.attn_query_waste
        self._lines: dict[int, tuple[float, float, float, float]] = {}
        self._one_prompt: dict[int, float] = {}  # prefill_time of one prompt, by length

    def __repr__(self) -> str:
        return (
            f"InstanceCost(model={self.model.name!r}, gpu={self.gpu.name!r}, tp={self.tp}, "
            f"params={self.params!r})"
        )

    # --- the general iteration --------------------------------------------
    def _iteration(
        self,
        new_tokens: float,
        logits: float,
        pairs: float,
        kv_read: float,
        share: float = 1.0,
        decode_pairs: float = 0.0,
    ) -> float:
        """Time of an iteration given its aggregate work (see module docstring).

        ``share`` is the fraction of the GPUs' compute units the iteration runs
        on (MuxServe's spatial-temporal multiplexing, see
        :meth:`prefill_time`): the compute term is divided by it, the memory,
        communication and fixed terms are not. ``decode_pairs`` are attention
        pairs priced at the decode-attention coefficient (only with the
        extension set; otherwise decode pairs are part of ``pairs``).
        """
        if not 0.0 < share <= 1.0:
            raise ValueError(f"compute share must be in (0, 1], got {share}")
        compute = new_tokens * self._c_tok + logits * self._c_logit + pairs * self._c_pair
        if decode_pairs:
            compute += decode_pairs * self._c_pair_dec
        memory = self._m_w + (kv_read + new_tokens) * self._m_kv
        return self._fixed + new_tokens * self._comm_tok + max(compute / share, memory)

    def _knee(self, c: float, m: float) -> float:
        """A linear layer's time from its compute and memory terms: ``(c^q + m^q)^(1/q)``."""
        q = self._q
        return float((c**q + m**q) ** (1.0 / q))

    def _linear(self, tokens: float, logits: float, share: float = 1.0) -> float:
        """Per-operation form: the linear layers' time (body and lm_head, each
        on its own knee) plus the element-wise traffic of ``tokens`` tokens."""
        return (
            self._knee(tokens * self._c_tok / share, self._m_body)
            + self._knee(logits * self._c_logit / share, self._m_head)
            + tokens * self._m_elem
        )

    def _op_iteration(
        self,
        tokens: float,
        logits: float,
        rect: float,
        tri: float,
        prompt_kv: float,
        decode_batch: float,
        decode_ctx: float,
        share: float,
    ) -> float:
        """Per-operation form of an iteration: ``tokens`` new tokens in all,
        ``decode_batch`` of them decode tokens reading ``decode_ctx`` KV
        tokens; the prompt chunks' query-key pairs are ``rect`` (new tokens
        over cached ones) plus ``tri`` (the causal triangles of the new
        tokens) over ``prompt_kv`` cached tokens. Prompt and decode attention
        are separate kernels, each its own roofline (module docstring)."""
        if not 0.0 < share <= 1.0:
            raise ValueError(f"compute share must be in (0, 1], got {share}")
        t = self._fixed + tokens * self._comm_tok + self._linear(tokens, logits, share)
        prompt_tokens = tokens - decode_batch
        if prompt_tokens > 0.0:
            pairs = rect + self._kappa * tri + self._waste * prompt_tokens
            t += self._lat_a + max(
                pairs * self._c_pair / share, (prompt_kv + prompt_tokens) * self._m_kva
            )
        if decode_batch > 0.0:
            t += self._lat_a + max(
                decode_ctx * self._c_pair_dec / share, (decode_ctx + decode_batch) * self._m_kva
            )
        return t

    def decode_lines(self, batch: int) -> tuple[float, float, float, float]:
        """``(a_c, b_c, a_m, b_m)``: a decode iteration of ``batch`` sequences
        reading ``x`` KV tokens takes ``max(a_c + b_c x, a_m + b_m x)`` (before
        the decode batch scale). Both forms of the model have this shape; the
        lines are computed once per batch size."""
        lines = self._lines.get(batch)
        if lines is None:
            k = self._fixed + batch * self._comm_tok
            if self._op:
                a = k + self._linear(float(batch), float(batch)) + self._lat_a
                lines = (a, self._c_pair_dec, a + batch * self._m_kva, self._m_kva)
            else:  # folded exactly as before the per-operation form existed
                lines = (
                    batch * self._c_tok1 + k,
                    self._c_pair_dec,
                    self._m_w + batch * self._m_kv + k,
                    self._m_kv,
                )
            self._lines[batch] = lines
        return lines

    def prefill_time(
        self, prompt_lens: Sequence[int] | npt.NDArray[np.integer], share: float = 1.0
    ) -> float:
        """One prefill iteration over whole prompts (nothing cached before).

        Compute sharing (MuxServe). Jobs of different models may run at once
        on one GPU group, each on a ``share`` of its compute units (MuxServe
        partitions SMs with MPS). The model: only the compute-bound term
        stretches, ``t = fixed + comm + max(t_compute / share, t_memory)``. A
        compute-bound prefill thus takes ``1 / share`` times longer, while a
        memory-bound decode (weights and KV streamed from HBM) barely slows
        down until its compute term, stretched, overtakes the memory term.
        This is one job's time on its share; jobs running at once also share
        the HBM bandwidth, which the sharing group accounts for with each
        job's traffic (:meth:`prefill_memory_s`, :meth:`decode_memory_s`;
        :mod:`fleetserve.sim.contention`).

        Args:
            prompt_lens: prompt length of each sequence in the batch (each >= 1).
            share: fraction of compute units, in (0, 1].

        Returns:
            Seconds; 0.0 for an empty batch.
        """
        n = len(prompt_lens)
        if n == 1 and share == 1.0:  # most prefills: memoised by length
            length = int(prompt_lens[0])
            got = self._one_prompt.get(length)
            if got is None:
                got = self._one_prompt[length] = self._prefill(prompt_lens, 1, 1.0)
            return got
        if n == 0:
            return 0.0
        return self._prefill(prompt_lens, n, share)

    def _prefill(
        self, prompt_lens: Sequence[int] | npt.NDArray[np.integer], n: int, share: float
    ) -> float:
        """:meth:`prefill_time` of ``n`` >= 1 prompts, computed."""
        total = 0
        pairs2 = 0  # 2 * pairs = sum l (l + 1), kept integral
        for length in prompt_lens:
            li = int(length)
            total += li
            pairs2 += li * (li + 1)
        if self._op:
            t = float(total)
            return self._op_iteration(t, float(n), 0.0, pairs2 * 0.5, 0.0, 0.0, 0.0, share)
        return self._iteration(float(total), float(n), pairs2 * 0.5, 0.0, share)

    def decode_time(
        self, batch: int, ctx_total: npt.NDArray[np.number[Any]]
    ) -> npt.NDArray[np.float64]:
        """One decode iteration of ``batch`` sequences, elementwise over ``ctx_total``.

        Args:
            batch: sequences in the batch (each appends one token).
            ctx_total: total KV tokens read by the batch (sum over sequences of their
                context, including the token being appended); any shape.

        Returns:
            Seconds, same shape as ``ctx_total``. Each element depends on its own
            input only (elementwise IEEE ops), so ``decode_time(b, x)[i]`` equals
            ``decode_time(b, x[i:i+1])[0]`` bit for bit.
        """
        # constant terms folded into both lines: 5 ufunc calls in all
        a_c, b_c, a_m, b_m = self.decode_lines(batch)
        x = ctx_total
        out: npt.NDArray[np.float64] = np.maximum(x * b_c + a_c, x * b_m + a_m)
        if self._scaled:
            out = out * self.params.decode_scale(batch)
        return out

    def decode_ends(self, batch: int, ctx0: int, k: int, start: float) -> Ends:
        """End times of ``k`` decode iterations of ``batch`` sequences run back
        to back from ``start``: iteration ``i`` (1..k) reads ``ctx0 + batch * i``
        KV tokens. The running sum of :meth:`decode_time` over those contexts,
        left to right (as ``np.cumsum``), so each end is bit for bit that of
        the same iterations run one at a time. A short segment (most are: a
        decode segment ends at the next arrival or finish) is summed in
        Python floats, whose operations are the same IEEE ones as the array
        form's, without the arrays' fixed cost, and returned as a list (its
        readers look times up with :func:`bisect.bisect_right`, cheaper than
        an array's ``searchsorted`` on a few elements); a long one stays an
        array (hundreds of Python floats cost more to make and free)."""
        if k > _SHORT_SEGMENT:
            ctx = ctx0 + batch * np.arange(1, k + 1, dtype=np.float64)
            return np.cumsum(np.concatenate(([start], self.decode_time(batch, ctx))))[1:]
        a_c, b_c, a_m, b_m = self.decode_lines(batch)
        out: list[float] = []
        add = out.append
        t = start
        x = float(ctx0)  # ctx0 + batch * i: integral, so exact as a float
        step = float(batch)
        scale = self.params.decode_scale(batch) if self._scaled else None
        for _ in range(k):
            x += step
            c = x * b_c + a_c
            m = x * b_m + a_m
            if scale is None:
                t += c if c >= m else m
            else:
                t += (c if c >= m else m) * scale
            add(t)
        return out

    def decode_time_scalar(self, batch: int, ctx_total: float, share: float = 1.0) -> float:
        """Scalar form of :meth:`decode_time` (same value, same rounding); with
        ``share`` < 1 the compute term runs on that fraction of the compute
        units (see :meth:`prefill_time`)."""
        x = float(ctx_total)
        scale = self.params.decode_scale(batch) if self._scaled else 1.0  # x * 1.0 == x
        if share != 1.0:
            if not 0.0 < share <= 1.0:
                raise ValueError(f"compute share must be in (0, 1], got {share}")
            if self._op:
                b = float(batch)
                return scale * self._op_iteration(b, b, 0.0, 0.0, 0.0, b, x, share)
            k = self._fixed + batch * self._comm_tok
            compute = (batch * self._c_tok1 + x * self._c_pair_dec) / share
            return scale * (k + max(compute, self._m_w + batch * self._m_kv + x * self._m_kv))
        a_c, b_c, a_m, b_m = self.decode_lines(batch)
        return scale * max(x * b_c + a_c, x * b_m + a_m)

    # --- memory traffic (contention between concurrent jobs) ----------------
    def prefill_memory_s(self, prompt_lens: Sequence[int] | npt.NDArray[np.integer]) -> float:
        """Seconds of HBM traffic of :meth:`prefill_time`'s iteration at the
        GPUs' full memory bandwidth (the memory term of the roofline): the
        weights once and the prompts' new KV. Concurrent jobs on one GPU group
        share this bandwidth (:func:`fleetserve.sim.contention.bandwidth_shares`)."""
        if len(prompt_lens) == 0:
            return 0.0
        total = sum(int(x) for x in prompt_lens)
        if self._op:
            return self._m_w + total * (self._m_kva + self._m_elem)
        return self._m_w + total * self._m_kv

    def decode_memory_s(self, batch: int, ctx_total: float) -> float:
        """Seconds of HBM traffic of :meth:`decode_time_scalar`'s iteration at
        full memory bandwidth: weights, the KV read and the new tokens' KV (the
        decode batch scale, when calibrated, applies to it as to the time)."""
        scale = self.params.decode_scale(batch) if self._scaled else 1.0
        if self._op:
            kv = (batch + float(ctx_total)) * self._m_kva
            return scale * (self._m_w + kv + batch * self._m_elem)
        return scale * (self._m_w + batch * self._m_kv + float(ctx_total) * self._m_kv)

    def kv_read_s(self, batch: int, tokens: float) -> float:
        """Seconds of HBM traffic of reading ``tokens`` KV tokens (all layers)
        within a decode iteration of ``batch`` sequences: the KV-read part of
        :meth:`decode_memory_s` (``decode_memory_s(b, x) - decode_memory_s(b,
        0)``, the decode batch scale included). KunServe's remote attention
        moves such reads from one GPU to another (:mod:`fleetserve.costmodel.pipeline`);
        negative ``tokens`` are reads a GPU no longer does."""
        scale = self.params.decode_scale(batch) if self._scaled else 1.0
        return scale * float(tokens) * (self._m_kva if self._op else self._m_kv)

    def decode_memory(
        self, batch: int, ctx_total: npt.NDArray[np.number[Any]]
    ) -> npt.NDArray[np.float64]:
        """:meth:`decode_memory_s` elementwise over ``ctx_total`` (same values)."""
        scale = self.params.decode_scale(batch) if self._scaled else 1.0
        x = np.asarray(ctx_total, dtype=np.float64)
        if self._op:
            out: npt.NDArray[np.float64] = scale * (
                self._m_w + (batch + x) * self._m_kva + batch * self._m_elem
            )
            return out
        out = scale * (self._m_w + batch * self._m_kv + x * self._m_kv)
        return out

    def mixed_memory_s(
        self, chunks: Sequence[tuple[int, int]], decode_batch: int, decode_ctx_total: int
    ) -> float:
        """Seconds of HBM traffic of :meth:`mixed_time`'s iteration at full
        bandwidth: the weights, the KV the chunks and the decodes read, the new
        tokens' KV (and, per-operation form, their element-wise traffic)."""
        tokens = decode_batch + sum(int(n) for n, _ in chunks)
        if tokens == 0:
            return 0.0
        kv = decode_ctx_total + sum(int(c) for _, c in chunks) + tokens
        if self._op:
            return self._m_w + kv * self._m_kva + tokens * self._m_elem
        return self._m_w + kv * self._m_kv

    def mixed_time(
        self,
        chunks: Sequence[tuple[int, int]],
        decode_batch: int,
        decode_ctx_total: int,
        share: float = 1.0,
    ) -> float:
        """One chunked-prefill iteration: prefill chunks plus a decode batch.

        Args:
            chunks: ``(new_tokens, tokens_already_cached)`` per prefill chunk.
            decode_batch: decode sequences in the same iteration.
            decode_ctx_total: KV tokens the decode sequences read in total
                (including the tokens being appended).
            share: fraction of compute units (see :meth:`prefill_time`).

        Returns:
            Seconds; 0.0 when there is nothing to do.
        """
        split = self.params.decode_attn_eff is not None
        tokens = decode_batch
        pairs2 = 0 if split else 2 * decode_ctx_total
        kv_read = decode_ctx_total
        for new, cached in chunks:
            n, c = int(new), int(cached)
            tokens += n
            pairs2 += 2 * n * c + n * (n + 1)
            kv_read += c
        logits = len(chunks) + decode_batch
        if tokens == 0:
            return 0.0
        if self._op:
            rect = sum(int(new) * int(cached) for new, cached in chunks)
            tri2 = sum(int(new) * (int(new) + 1) for new, _ in chunks)
            return self._op_iteration(
                float(tokens),
                float(logits),
                float(rect),
                tri2 * 0.5,
                float(kv_read - decode_ctx_total),
                float(decode_batch),
                float(decode_ctx_total),
                share,
            )
        dec = float(decode_ctx_total) if split else 0.0
        return self._iteration(
            float(tokens), float(logits), pairs2 * 0.5, float(kv_read), share, decode_pairs=dec
        )

    # --- whole requests -----------------------------------------------------
    def ideal_times(
        self, prompts: npt.NDArray[np.number[Any]], outputs: npt.NDArray[np.number[Any]]
    ) -> npt.NDArray[np.float64]:
        """Execution time of each request alone on an idle instance, in closed form.

        ``prefill_time([p]) + sum_{j=1}^{o-1} decode_time(1, p + j)``: the prefill
        produces the first output token, then ``o - 1`` batch-1 decode steps follow
        with contexts ``p + 1 .. p + o - 1``.

        Args:
            prompts: prompt lengths (>= 1).
            outputs: output lengths (>= 1; 0 is treated like 1).

        Returns:
            Seconds per request, float64, same shape as ``prompts``.
        """
        p = np.asarray(prompts, dtype=np.float64)
        o = np.asarray(outputs, dtype=np.float64)
        # prefill of one prompt (same formula as prefill_time([p]))
        pairs = p * (p + 1.0) * 0.5
        if self._op:
            q = self._q
            body = ((p * self._c_tok) ** q + self._m_body**q) ** (1.0 / q)
            weighted = self._kappa * pairs + self._waste * p
            attn = self._lat_a + np.maximum(weighted * self._c_pair, p * self._m_kva)
            head = self._knee(self._c_logit, self._m_head)
            prefill = self._fixed + p * self._comm_tok + (body + head + p * self._m_elem) + attn
        else:
            compute = p * self._c_tok + self._c_logit + pairs * self._c_pair
            memory = self._m_w + p * self._m_kv
            prefill = self._fixed + p * self._comm_tok + np.maximum(compute, memory)

        # decode steps x = lo..hi, t(x) = max(a_c + b_c x, a_m + b_m x): the
        # batch-1 lines of decode_time
        a_c, b_c, a_m, b_m = self.decode_lines(1)
        n = np.maximum(o - 1.0, 0.0)
        lo = p + 1.0
        hi = p + n  # empty range when n == 0
        # number of x in [lo, hi] on the compute side (a_c + b_c x >= a_m + b_m x)
        d_a = a_c - a_m
        d_b = b_c - b_m
        if d_b > 0.0:
            cut = _first_compute_x(a_c, b_c, a_m, b_m)  # compute side: x >= cut
            n_comp_hi = hi - np.maximum(lo, cut) + 1.0
            n_comp = np.clip(n_comp_hi, 0.0, n)
            c_lo = np.maximum(lo, cut)
            c_hi = hi
            m_lo = lo
            m_hi = np.minimum(hi, cut - 1.0)
        elif d_b < 0.0:
            cut = _last_compute_x(a_c, b_c, a_m, b_m)  # compute side: x <= cut
            n_comp = np.clip(np.minimum(hi, cut) - lo + 1.0, 0.0, n)
            c_lo = lo
            c_hi = np.minimum(hi, cut)
            m_lo = np.maximum(lo, cut + 1.0)
            m_hi = hi
        else:
            all_compute = d_a >= 0.0
            n_comp = n if all_compute else np.zeros_like(n)
            c_lo, c_hi = lo, hi
            m_lo, m_hi = lo, hi
        n_mem = n - n_comp
        sum_x_comp = np.where(n_comp > 0.0, (c_lo + c_hi) * n_comp * 0.5, 0.0)
        sum_x_mem = np.where(n_mem > 0.0, (m_lo + m_hi) * n_mem * 0.5, 0.0)
        decode = n_comp * a_c + b_c * sum_x_comp + n_mem * a_m + b_m * sum_x_mem
        if self._scaled:
            decode = decode * self.params.decode_scale(1)
        result: npt.NDArray[np.float64] = prefill + decode
        return result

    # --- helpers --------------------------------------------------------------
    def kv_bytes(self, tokens: int) -> int:
        """Bytes of KV cache held for ``tokens`` tokens (all tp shards together)."""
        return self.model.kv_bytes_per_token * int(tokens)

    def kv_transfer_time(self, tokens: int, link: Link) -> float:
        """Seconds to move ``tokens`` tokens of KV to another instance over ``link``.

        Each of the ``tp`` GPUs sends its own shard over its own link in parallel,
        so ``latency + kv_bytes / tp / bandwidth``.
        """
        return transfer_time(self.kv_bytes(tokens) / self.tp, link)

    def re_prefill_time(self, tokens: int) -> float:
        """Seconds to rebuild ``tokens`` tokens of KV by recomputation (one prefill)."""
        return self.prefill_time([tokens]) if tokens > 0 else 0.0

    def re_prefill_tokens(self, budget_s: float) -> int:
        """The most tokens a re-prefill rebuilds within ``budget_s`` seconds:
        the largest ``n`` with ``re_prefill_time(n) <= budget_s`` (binary search;
        the time grows with ``n``). Mell's computation boundary (§V)."""
        return tokens_within(self.re_prefill_time, budget_s)


def gpu_params(gpu: GpuSpec) -> EfficiencyParams:
    """The default parameters of ``gpu``: for an emulated GPU (a runtime
    worker, ``gpu.arena`` set) :data:`DEFAULT_PARAMS`; for a catalog GPU the
    values fitted to measured kernels (:func:`~fleetserve.costmodel.params.gpu_defaults`)."""
    if gpu.arena is not None:
        return DEFAULT_PARAMS
    return gpu_defaults(gpu.name)


def tokens_within(time_of: Callable[[int], float], budget_s: float) -> int:
    """The largest ``n`` with ``time_of(n) <= budget_s``, for a ``time_of``
    that grows with ``n`` (doubling, then binary search; at most ``2**40``)."""
    lo, hi = 0, 1
    while hi < 1 << 40 and time_of(hi) <= budget_s:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # time_of(lo) <= budget_s < time_of(hi)
        mid = (lo + hi) // 2
        if time_of(mid) <= budget_s:
            lo = mid
        else:
            hi = mid
    return lo


class CostModel:
    """Factory of :class:`InstanceCost`: default or calibrated efficiency parameters.

    Args:
        params: parameters for deployments the calibration does not cover
            (default :data:`~fleetserve.costmodel.params.DEFAULT_PARAMS`).
        calibration: fitted parameters per (model name, GPU name, tp).
    """

    __slots__ = ("calibration", "params")

    def __init__(
        self, params: EfficiencyParams | None = None, calibration: Calibration | None = None
    ) -> None:
        self.params = params
        self.calibration = calibration

    def params_for(self, model: ModelSpec, gpu: GpuSpec, tp: int = 1) -> EfficiencyParams:
        """The calibrated parameters for (model, gpu, tp) if any, else ``params``
        when given, else the GPU's catalog defaults (:func:`gpu_params`)."""
        if self.calibration is not None:
            fitted = self.calibration.get(model.name, gpu.name, tp)
            if fitted is not None:
                return fitted
        if self.params is not None:
            return self.params
        return gpu_params(gpu)

    def bind(self, model: ModelSpec, gpu: GpuSpec, tp: int = 1) -> InstanceCost:
        """Precompute the coefficients of ``model`` on ``tp`` GPUs of type ``gpu``.

        Raises:
            ConfigError: if ``tp`` < 1.
        """
        return InstanceCost(model, gpu, tp, self.params_for(model, gpu, tp))
