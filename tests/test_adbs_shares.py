"""ADBS never starts a job on a sliver of the compute units (a job on a share
near 0 would stretch its compute term without bound)."""

from __future__ import annotations

import numpy as np
import pytest

from fleetserve.errors import ConfigError
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.policy.sharing import Adbs
from fleetserve.sim.group import SharingGroup
from fleetserve.sim.multi import MultiConfig, MultiSimulator
from fleetserve.spec import get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service


def test_every_adbs_job_gets_at_least_min_share(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"s{i}" for i in range(6)]  # many services: equal parts would get tiny
    svc = {n: Service(n, get_model("llama-2-7b"), 2.0, 300, 100) for n in names}
    rng = np.random.default_rng(0)
    rows = sorted((float(t), n) for n in names for t in np.cumsum(rng.exponential(0.5, size=30)))
    reqs = [
        Request(i, n, t, int(rng.integers(16, 600)), int(rng.integers(1, 200)))
        for i, (t, n) in enumerate(rows)
    ]
    shares: list[float] = []
    orig = SharingGroup._register

    def spy(self, job, seqs, now, share):  # type: ignore[no-untyped-def]
        shares.append(share)
        return orig(self, job, seqs, now, share)

    monkeypatch.setattr(SharingGroup, "_register", spy)
    plan = PlacementPlan((GroupPlacement((0, 1), 2, tuple(names)),), 2)
    cfg = MultiConfig(gpu="a100-80gb", n_gpus=2, scheduler="adbs", check_integrity=True)
    res = MultiSimulator(cfg, svc, plan, reqs).run()
    assert all(r.status == "finished" for r in res.records)
    assert shares and min(shares) >= 0.1 - 1e-9
    assert max(r.finish_s - r.arrival_s for r in res.records if r.finish_s) < 600


def test_min_share_is_checked() -> None:
    with pytest.raises(ConfigError, match="min_share"):
        Adbs(prefill_share=0.5, min_share=0.6)
