"""fleetserve.experiments: each paper's headline comparison, as data plus a report.

``fleetserve reproduce NAME`` runs one of :data:`EXPERIMENTS`. An experiment is
a grid of ordinary simulations (each writes a normal result directory through
:func:`~fleetserve.experiments.runner.simulate_and_write`), run in parallel by
:func:`~fleetserve.experiments.runner.run_grid`, followed by a report that
reads the run directories back and writes tables, figures and a
paper-vs-measured check.

============  ==========================================================
name          what
============  ==========================================================
``mell``      Mell §VIII, Figs. 11-15 (:mod:`fleetserve.experiments.mell`)
``seallm``    SeaLLM §6, Figs. 6-8 and 10 (:mod:`fleetserve.experiments.multi_llm`)
``muxserve``  MuxServe §5, Fig. 5 and the ADBS ablation
              (:mod:`fleetserve.experiments.multi_llm`)
``kunserve``  KunServe §5, Figs. 10, 11 and 14-16
              (:mod:`fleetserve.experiments.kunserve`)
``fleet``     issue 21 item 6: the composed stacks vs each paper's own and vLLM
              on two fleet workloads (:mod:`fleetserve.experiments.fleet`)
============  ==========================================================
"""

from __future__ import annotations

from fleetserve.errors import UnknownNameError

EXPERIMENTS: dict[str, str] = {
    "mell": "Mell §VIII: GPUs, migrations, batching and KV utilization of bf/wf/llumnix/mell",
    "seallm": "SeaLLM §6: latency, P99, SLO attainment, TTFT/TPOT of multi-LLM stacks "
    "and SeaLLM's ablations over the request rate",
    "muxserve": "MuxServe §5: aggregated throughput and SLO attainment of spatial, temporal "
    "and MuxServe over the popularity skew; ADBS vs round-robin vs FCFS",
    "kunserve": "KunServe §5: P99 TTFT, TBT and SLO violations of memory-throttling "
    "strategies under bursts; live exchange, live restore and planner ablations",
    "fleet": "the composed stacks (seallm-mell, muxserve-mell, fleet) vs each paper's own "
    "and vllm on the bursty fleet and the Azure trace over 8 models: GPU-hours, peak GPUs, "
    "P99 TTFT/TPOT, SLO attainment",
}
"""Experiment name → one-line description."""


def check_experiment(name: str) -> str:
    """``name`` when it is a known experiment.

    Raises:
        UnknownNameError: an unknown name (with suggestions).
    """
    if name not in EXPERIMENTS:
        raise UnknownNameError("experiment", name, EXPERIMENTS)
    return name


__all__ = ["EXPERIMENTS", "check_experiment"]
