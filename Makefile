# specpipe — one-command set-up, demo and tests. `make help` lists the targets.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt constraints.txt | cksum | cut -d' ' -f1)
MODEL  ?= models/demo-target
DRAFTER ?= models/demo-redrafter
DRAFT_LM ?= models/demo-draft-lm
LYANNA ?= models/demo-lyanna
ENGINE ?= engines/demo
SPEC_ENGINE ?= engines/demo-redrafter
DRAFT_ENGINE ?= engines/demo-draft-lm
LYANNA_ENGINE ?= engines/demo-lyanna
PYTEST_ARGS ?=

DEMO_PROMPTS := --prompt "def fibonacci(n):" \
	--prompt "$$(printf 'class Stack:\n    def __init__(self):')" \
	--prompt "$$(printf 'import os\n\n\ndef list_python_files(path):')"

.PHONY: help setup cpu-kernels compiled-policy mpi perf-analyzer-install perf-tools genai-perf perf-analyzer engine demo serve test test-slow lint format model drafter drafter-soft draft-lm lyanna bench-redrafter bench-redrafter-kd bench-redrafter-grid bench-lyanna-throughput bench-batch bench-batch-methods bench-triton-overhead bench-rsd bench-ngram profile policy-trace bench-no-draft bench-churn bench-goals bench-lockstep bench-floor bench-compiled-forward bench-lyanna bench-drafter-tp loadtest loadtest-openai soak bench-table2 export-trtllm clean

help:  ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 25

setup: $(STAMP) mpi cpu-kernels compiled-policy  ## create .venv and install pinned requirements (once), OpenMPI, the C++ CPU kernels, the compiled policy

cpu-kernels: $(STAMP)  ## build the C++ CPU kernels for this CPU (~10 s once, cached in ~/.cache/specpipe)
	$(BIN)/python -m plugins.cpu_kernels

compiled-policy: $(STAMP)  ## compile the load-aware policy with mypyc (~15 s once per source, cached in ~/.cache/specpipe; SPECPIPE_COMPILED_POLICY=0 runs it as Python)
	$(BIN)/python -m runtime.native_policy

# Tensor-parallel engines run under `mpirun`; mpi4py (requirements.txt) loads the MPI library at run time.
mpi:  ## install OpenMPI (mpirun) if missing: apt-get as root, else print the command
	@command -v mpirun >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y openmpi-bin libopenmpi-dev; } \
	      || echo "warning: could not install OpenMPI; tensor-parallel tests will be skipped"; \
	  else \
	    echo "OpenMPI is missing (tensor-parallel engines need mpirun); install it with:"; \
	    echo "  sudo apt-get install -y openmpi-bin libopenmpi-dev"; \
	  fi; }

# NVIDIA's benchmark clients in their own venv (genai-perf pins packages of its own): perf_analyzer is
# the binary inside the tritonclient 2.50.0 wheel (later wheels need a newer glibc), which links
# Debian's libb64-0d and libcudart.so.12 (nvidia-cuda-runtime-cu12) even on a CPU; the wrappers in
# $(PERF_VENV)/tools/ set LD_LIBRARY_PATH and PATH. constraints-perf.txt pins what genai-perf pulls in.
PERF_VENV ?= .venv-perf
PERF_BIN  := $(PERF_VENV)/bin
PERF_ANALYZER_STAMP := $(PERF_VENV)/.perf-analyzer-$(shell cat constraints-perf.txt | cksum | cut -d' ' -f1)
GENAI_PERF_STAMP := $(PERF_VENV)/.genai-perf-$(shell cat constraints-perf.txt | cksum | cut -d' ' -f1)

perf-analyzer-install: $(PERF_ANALYZER_STAMP)  ## perf_analyzer in $(PERF_VENV) (~30 s; libb64-0d via apt-get as root, else the command is printed)
	@ldconfig -p | grep -q 'libb64\.so\.0d' || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libb64-0d >/dev/null; } \
	      || echo "warning: could not install libb64-0d; the perf_analyzer test will be skipped"; \
	  else \
	    echo "perf_analyzer needs Debian's libb64-0d; install it with:"; \
	    echo "  sudo apt-get install -y libb64-0d"; \
	  fi; }

$(PERF_ANALYZER_STAMP): constraints-perf.txt
	test -x $(PERF_BIN)/python || $(PYTHON) -m venv $(PERF_VENV)
	$(PERF_BIN)/pip install --quiet --disable-pip-version-check tritonclient==2.50.0 nvidia-cuda-runtime-cu12==12.9.79 -c constraints-perf.txt
	mkdir -p $(PERF_VENV)/tools
	printf '%s\n' '#!/bin/sh' '# runs $(PERF_VENV)/bin/<this name> with the venv'"'"'s libcudart and bin/ (written by make perf-tools)' \
	  'v="$$(cd "$$(dirname "$$0")/.." && pwd)"' \
	  'for d in "$$v"/lib/python3*/site-packages/nvidia/cuda_runtime/lib; do LD_LIBRARY_PATH="$$d$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}"; done' \
	  'PATH="$$v/bin:$$PATH"; export LD_LIBRARY_PATH PATH' \
	  'exec "$$v/bin/$$(basename "$$0")" "$$@"' > $(PERF_VENV)/tools/perf_analyzer
	chmod +x $(PERF_VENV)/tools/perf_analyzer && cp $(PERF_VENV)/tools/perf_analyzer $(PERF_VENV)/tools/genai-perf
	rm -f $(PERF_VENV)/.perf-analyzer-* && touch $@

$(GENAI_PERF_STAMP): $(PERF_ANALYZER_STAMP)
	$(PERF_BIN)/pip install --quiet --disable-pip-version-check genai-perf==0.0.16 -c constraints-perf.txt
	rm -f $(PERF_VENV)/.genai-perf-* && touch $@

perf-tools: perf-analyzer-install $(GENAI_PERF_STAMP)  ## perf_analyzer + genai-perf 0.0.16 in $(PERF_VENV) (~4 min, 1.1 GB)

genai-perf: perf-tools engine  ## serve $(SPEC_ENGINE), profile it with NVIDIA genai-perf (kserve, tensorrtllm, streaming), stop -> benchmarks/results/genai_perf/
	$(BIN)/python -m triton_repo.nvidia_perf genai-perf --engine $(SPEC_ENGINE)

perf-analyzer: perf-analyzer-install engine  ## serve $(SPEC_ENGINE), drive it with NVIDIA perf_analyzer (--streaming, RATE req/s), stop -> benchmarks/results/perf_analyzer/
	$(BIN)/python -m triton_repo.nvidia_perf perf-analyzer --engine $(SPEC_ENGINE) --rate $(RATE)

$(STAMP): requirements.txt constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt
	rm -f $(VENV)/.installed-* && touch $@

BUILDER := build/engine.py runtime/engine_dir.py $(MODEL)/tokenizer_config.json

$(ENGINE)/config.json: $(STAMP) $(BUILDER) $(MODEL)/config.json $(MODEL)/model.safetensors $(MODEL)/tokenizer.json
	$(BIN)/python -m build.engine --checkpoint $(MODEL) --output $(ENGINE) --force

# Beams of 5 tokens: with greedy beam search ranking only the warp's support, a draft level
# costs ~1.2 ms at batch 1 and L=5 beats L=4 (held-out prompts, load-aware: batch 1 1.89x vs
# 1.78x AR, batch 8 1.21x vs 1.18x, batch 32 the same); load-aware picks the width.
SPEC_BEAMS := --beam-width 4 --beam-length 5
# the RNN drafter's head in 4 bits: its acceptance as in int8, half the bytes of its largest
# product a level (benchmarks/results/floor.md); the draft LM's keeps int8 (tau 3.27 -> 3.14)
SPEC_HEAD := --drafter-head int4

$(SPEC_ENGINE)/config.json: $(STAMP) $(BUILDER) $(MODEL)/model.safetensors $(DRAFTER)/config.json $(DRAFTER)/model.safetensors Makefile
	$(BIN)/python -m build.engine --checkpoint $(MODEL) --drafter $(DRAFTER) --output $(SPEC_ENGINE) --max-batch-size 32 $(SPEC_BEAMS) $(SPEC_HEAD) --force

$(DRAFT_ENGINE)/config.json: $(STAMP) $(BUILDER) $(MODEL)/model.safetensors $(DRAFT_LM)/config.json $(DRAFT_LM)/model.safetensors
	$(BIN)/python -m build.engine --checkpoint $(MODEL) --draft-model $(DRAFT_LM) --output $(DRAFT_ENGINE) --max-batch-size 32 --force

# Lyanna drafts through a 4-bit copy of the target's head and a 4-bit layer: on 64 held-out
# prompts its 4-node chains keep 2.08 tokens a step at T=0 (1.30 -> 1.29 at T=1) where
# drafting a step took ~0.65 ms cold; in lockstep at batch 1 they ran 1.19x -> 1.30x AR
# (benchmarks/HISTORY.md, session 32). The RNN drafter's layers and the draft LM lose tau in
# 4 bits (3.65 -> 3.54, 3.53 -> 3.36), so they keep int8.
LYANNA_QUANT := --drafter-head int4 --drafter-layers int4

$(LYANNA_ENGINE)/config.json: $(STAMP) $(BUILDER) $(MODEL)/model.safetensors $(LYANNA)/config.json $(LYANNA)/model.safetensors Makefile
	$(BIN)/python -m build.engine --checkpoint $(MODEL) --lyanna $(LYANNA) --output $(LYANNA_ENGINE) --max-batch-size 32 $(LYANNA_QUANT) --force

engine: $(ENGINE)/config.json $(SPEC_ENGINE)/config.json $(DRAFT_ENGINE)/config.json $(LYANNA_ENGINE)/config.json compiled-policy  ## build $(ENGINE) (target only) and one engine per drafter: $(SPEC_ENGINE) (ReDrafter RNN), $(DRAFT_ENGINE) (draft LM), $(LYANNA_ENGINE) (Lyanna); compile the policy (what runs them)

demo: engine  ## set up, build the demo engines, generate in-process (ReDrafter vs AR, RSD-S), then serve with Triton and stream
	@echo "== ReDrafter (speculative, lossless) =="
	$(BIN)/python -m runtime.generate --engine $(SPEC_ENGINE) $(DEMO_PROMPTS) --max-tokens 64
	@echo "== auto-regressive baseline: same tokens, one target forward per token =="
	$(BIN)/python -m runtime.generate --engine $(SPEC_ENGINE) --method ar $(DEMO_PROMPTS) --max-tokens 64
	@echo "== Recursive Speculative Decoding (RSD-S) with the draft LM, sampling at temperature 0.7: same distribution as the target =="
	$(BIN)/python -m runtime.generate --engine $(DRAFT_ENGINE) --method rsd-s $(DEMO_PROMPTS) --max-tokens 64 --temperature 0.7 --seed 0
	@echo "== Triton Inference Server: start, stream three completions over gRPC, stop =="
	$(BIN)/python -m triton_repo.demo --engine $(SPEC_ENGINE) --max-tokens 48

serve: private ENGINE = $(SPEC_ENGINE)
serve: engine  ## serve the ReDrafter engine (or ENGINE=...) with Triton (HTTP :8000, gRPC :8001, metrics :8002) + the OpenAI API on :9000
	$(BIN)/python -m triton_repo.openai --engine $(ENGINE)

# pytest exits 5 when no test is collected; that is not a failure of the suite.
test: setup perf-analyzer-install  ## default test suite (no slow tests)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-slow: setup perf-tools  ## slow tests only
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

lint: setup  ## ruff check + ruff format --check + mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup  ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

model: setup  ## re-train the bundled demo target (~30 min on 2 CPU cores)
	$(BIN)/python -m training.train_target --out $(MODEL)

drafter: setup  ## re-train the demo ReDrafter drafter by distillation from $(MODEL)
	$(BIN)/python -m training.train_redrafter --target $(MODEL) --out $(DRAFTER)

DRAFTER_SOFT ?= models/demo-redrafter-soft
drafter-soft: setup  ## re-train the soft-label ReDrafter drafter (for sampling; rsd-s/rsd-c on the RNN) from $(MODEL)
	$(BIN)/python -m training.train_redrafter --target $(MODEL) --out $(DRAFTER_SOFT) --kd soft --train-sequences 1024 --epochs 2

draft-lm: setup  ## re-train the demo draft LM by distillation from $(MODEL)
	$(BIN)/python -m training.train_draft_lm --target $(MODEL) --out $(DRAFT_LM)

lyanna: setup work_dirs/lyanna-dense/model.safetensors  ## re-train the demo Lyanna drafter: dense 1200 steps, then 150 sparse-aware steps from it
	$(BIN)/python -m training.train_lyanna --target $(MODEL) --out $(LYANNA) --init-from work_dirs/lyanna-dense \
		--steps 150 --lr 5e-4 --warmup-steps 10 --eval-every 50 --no-autocast

bench-redrafter: engine  ## W x L x T sweep: tau, acceptance, compression, speedup -> benchmarks/results/
	$(BIN)/python -m benchmarks.redrafter_sweep --engine $(SPEC_ENGINE)

bench-batch: engine  ## throughput + tau vs batch size: AR, fixed (W=4 and W=1) and load-aware ReDrafter -> benchmarks/results/
	$(BIN)/python -m benchmarks.batch_sweep --engine $(SPEC_ENGINE) --fixed-also beam_width=1

bench-batch-methods: engine  ## the same at batch 1 and 8, T=0 and T=1, for sd, rsd-c, rsd-s (draft LM) and lyanna (~4 min on 2 cores) -> benchmarks/results/batch_sweep_<method>[_t1].*
	for m in sd rsd-c rsd-s; do for t in 0 1; do \
	  $(BIN)/python -m benchmarks.batch_sweep --engine $(DRAFT_ENGINE) --method $$m --batch-sizes 1,8 --temperature $$t --rounds 9 \
	    --out benchmarks/results/batch_sweep_$$m$$([ $$t = 0 ] || echo _t1) || exit 1; done; done
	for t in 0 1; do \
	  $(BIN)/python -m benchmarks.batch_sweep --engine $(LYANNA_ENGINE) --method lyanna --batch-sizes 1,8 --temperature $$t --rounds 9 \
	    --out benchmarks/results/batch_sweep_lyanna$$([ $$t = 0 ] || echo _t1) || exit 1; done

bench-triton-overhead: engine  ## batch-1 tokens/s through Triton (gRPC streaming) vs in-process, AR and ReDrafter -> benchmarks/results/triton_overhead.*
	$(BIN)/python -m benchmarks.triton_overhead --engine $(SPEC_ENGINE) --rounds 5

# ReDrafter Table 6 analogue: one drafter per --kd choice, matched budgets (1024 windows x 2 epochs, ~4 min each), made once
REDRAFTER_KD := --train-sequences 1024 --epochs 2
work_dirs/redrafter-kd-%/model.safetensors: | $(STAMP)
	$(BIN)/python -m training.train_redrafter --target $(MODEL) --out work_dirs/redrafter-kd-$* $(REDRAFTER_KD) --kd $*
REDRAFTER_KDS := $(foreach kd,greedy sampled soft ground-truth,work_dirs/redrafter-kd-$(kd)/model.safetensors)

bench-redrafter-kd: setup $(REDRAFTER_KDS)  ## ReDrafter Table 6: drafters trained with --kd greedy|sampled|soft|ground-truth at matched budgets, tau + speedup at T=0/1 -> benchmarks/results/
	$(BIN)/python -m benchmarks.redrafter_kd

bench-redrafter-grid: engine  ## ReDrafter Table 5 / Fig. 6: beam width x batch size, with and without tree attention (packing) -> benchmarks/results/
	$(BIN)/python -m benchmarks.redrafter_grid --engine $(SPEC_ENGINE)

bench-lyanna-throughput: engine  ## Lyanna Figs. 8-11: speedup vs batch size 1-16 of lyanna, sd (draft LM), ngram, redrafter -> benchmarks/results/
	$(BIN)/python -m benchmarks.lyanna_throughput

bench-rsd: engine  ## RSD Exp1/Exp2: tau + speedup vs AR for sd, rsd-c, rsd-s, redrafter on both drafters -> benchmarks/results/
	$(BIN)/python -m benchmarks.rsd_sweep

# Table 1's ablations: matched training runs (400 steps of 4 windows each, fp32, ~6 min alone), made once
LYANNA_ABLATION := --steps 400 --warmup-steps 15 --batch-size 4 --eval-every 100 --no-autocast
work_dirs/lyanna-full/model.safetensors: | $(STAMP)
	$(BIN)/python -m training.train_lyanna --target $(MODEL) --out work_dirs/lyanna-full $(LYANNA_ABLATION)
work_dirs/lyanna-no-token-info/model.safetensors: | $(STAMP)
	$(BIN)/python -m training.train_lyanna --target $(MODEL) --out work_dirs/lyanna-no-token-info $(LYANNA_ABLATION) --no-token-info
work_dirs/lyanna-no-fusion/model.safetensors: | $(STAMP)
	$(BIN)/python -m training.train_lyanna --target $(MODEL) --out work_dirs/lyanna-no-fusion $(LYANNA_ABLATION) --no-first-token-fusion

# The dense-trained base of models/demo-lyanna and Table 2's dense model (1200 steps: ~16 min with native
# bf16, ~80 min on a CPU without it), made once
work_dirs/lyanna-dense/model.safetensors: | $(STAMP)
	$(BIN)/python -m training.train_lyanna --target $(MODEL) --out work_dirs/lyanna-dense --no-sparse-token-info

# Table 2's dense model at the committed model's budget: the same 150 fine-tuning steps, the bias kept dense
work_dirs/lyanna-dense-ft/model.safetensors: work_dirs/lyanna-dense/model.safetensors | $(STAMP)
	$(BIN)/python -m training.train_lyanna --target $(MODEL) --out work_dirs/lyanna-dense-ft --init-from work_dirs/lyanna-dense \
		--steps 150 --lr 5e-4 --warmup-steps 10 --eval-every 50 --no-autocast --no-sparse-token-info

LYANNA_ABLATIONS := work_dirs/lyanna-full/model.safetensors work_dirs/lyanna-no-token-info/model.safetensors work_dirs/lyanna-no-fusion/model.safetensors work_dirs/lyanna-dense-ft/model.safetensors
profile: engine  ## where a step's time goes: ms per phase for AR and every method at batch 1/8/32 -> benchmarks/results/step_profile.{json,md}
	$(BIN)/python -m benchmarks.step_profile

TRACE_ENGINE ?= $(DRAFT_ENGINE)
TRACE_ARGS ?= --method sd --batch 1 --temperature 0
policy-trace: engine  ## why load-aware speculation chose what it chose: each step it saw, each drafting-cost fit's samples and prices (TRACE_ENGINE=dir TRACE_ARGS="--method M --batch B --temperature T") -> benchmarks/results/policy_trace.{json,md}
	$(BIN)/python -m benchmarks.policy_trace --engine $(TRACE_ENGINE) $(TRACE_ARGS)

bench-no-draft: engine  ## what speculation costs while switched off: load-aware no-draft steps vs AR steps, in lockstep, batch 1/8/32, T=0/1 -> benchmarks/results/no_draft.{json,md}
	$(BIN)/python -m benchmarks.no_draft

bench-policy-replay: engine  ## the load-aware policy's own host time: its calls recorded in lockstep (ReDrafter batch 1/8/32, T=0/1; sd batch 1/8) and replayed alone, with a fingerprint of its state -> benchmarks/results/policy_replay.{json,md}
	$(BIN)/python -m benchmarks.policy_replay record redrafter --engine $(SPEC_ENGINE) --batch 1 --rounds 6 --recording work_dirs/policy/redrafter_b1_t0.pkl
	$(BIN)/python -m benchmarks.policy_replay record redrafter --engine $(SPEC_ENGINE) --batch 8 --rounds 6 --recording work_dirs/policy/redrafter_b8_t0.pkl
	$(BIN)/python -m benchmarks.policy_replay record redrafter --engine $(SPEC_ENGINE) --batch 8 --rounds 6 --temperature 1 --recording work_dirs/policy/redrafter_b8_t1.pkl
	$(BIN)/python -m benchmarks.policy_replay record redrafter --engine $(SPEC_ENGINE) --batch 32 --rounds 2 --recording work_dirs/policy/redrafter_b32_t0.pkl
	$(BIN)/python -m benchmarks.policy_replay record sd --engine $(DRAFT_ENGINE) --batch 1 --rounds 4 --recording work_dirs/policy/sd_b1_t0.pkl
	$(BIN)/python -m benchmarks.policy_replay record sd --engine $(DRAFT_ENGINE) --batch 8 --rounds 4 --temperature 1 --recording work_dirs/policy/sd_b8_t1.pkl
	$(BIN)/python -m benchmarks.policy_replay replay work_dirs/policy/redrafter_b1_t0.pkl work_dirs/policy/redrafter_b8_t0.pkl \
	  work_dirs/policy/redrafter_b8_t1.pkl work_dirs/policy/redrafter_b32_t0.pkl work_dirs/policy/sd_b1_t0.pkl work_dirs/policy/sd_b8_t1.pkl

bench-position: engine  ## drafts kept by position in the output (fixed ReDrafter chains and sd chains, T=0 and T=1 (4 seeds), 64 held-out prompts, batch 8) -> benchmarks/results/acceptance_by_position_*.{json,md}
	$(BIN)/python -m benchmarks.acceptance_by_position "redrafter:fixed[beam_width=1]" --engine $(SPEC_ENGINE) --out benchmarks/results/acceptance_by_position_redrafter
	$(BIN)/python -m benchmarks.acceptance_by_position "redrafter:fixed[beam_width=1]" --engine $(SPEC_ENGINE) --temperature 1 --rounds 4 --out benchmarks/results/acceptance_by_position_redrafter_t1
	$(BIN)/python -m benchmarks.acceptance_by_position sd:fixed --engine $(DRAFT_ENGINE) --out benchmarks/results/acceptance_by_position_sd
	$(BIN)/python -m benchmarks.acceptance_by_position sd:fixed --engine $(DRAFT_ENGINE) --temperature 1 --rounds 4 --out benchmarks/results/acceptance_by_position_sd_t1

bench-first-round: engine  ## a fresh engine's first round: the slowest request's steps, plain request-steps and solves by cause, load-aware ReDrafter in 10 fresh engines at batch 8 (T=0) against fixed chains -> benchmarks/results/first_round.{json,md}
	$(BIN)/python -m benchmarks.first_round --engine $(SPEC_ENGINE) --batch 8 --engines 10

bench-churn: engine  ## load-aware vs AR in lockstep while requests of 16-96 tokens come and go (4 x batch a round), batch 8/32, T=0/1 -> benchmarks/results/churn.{json,md}
	$(BIN)/python -m benchmarks.churn

REPEATS ?= 1
bench-goals: engine  ## issue 16's CPU goals in one run: every goal cell (ReDrafter, draft LM, Lyanna; batch 1/8/32, T=0/1) in lockstep against AR and fixed speculation, judged (~7 min a pass on 2 cores; REPEATS=3: judged by the medians of 3 passes) -> benchmarks/results/goals.{json,md}
	$(BIN)/python -m benchmarks.goals --repeats $(REPEATS)

bench-lockstep: engine  ## load-aware ReDrafter against AR in lockstep (engines step in turn), T=1, batch 1/2/8 -> benchmarks/results/lockstep_redrafter_b*_t1.{json,md}
	for b in 1 2 8; do $(BIN)/python -m benchmarks.lockstep --engine $(SPEC_ENGINE) --batch $$b --temperature 1 --rounds 12 \
	  redrafter --out benchmarks/results/lockstep_redrafter_b$${b}_t1 || exit 1; done

bench-floor: engine  ## the batch-1 floor: bytes and ms of the target's forward and of a drafter level, and the tau 2x needs -> benchmarks/results/floor.{json,md}
	$(BIN)/python -m benchmarks.floor --engine $(SPEC_ENGINE) --engine $(DRAFT_ENGINE)

bench-compiled-forward: engine  ## the target's forward: the C++ op vs eager vs torch.compile (inductor), 1/8/40 tokens -> benchmarks/results/compiled_forward.{json,md}
	$(BIN)/python -m benchmarks.compiled_forward --engine $(SPEC_ENGINE)

bench-ngram: engine  ## prompt-lookup (n-gram) decoding vs AR on held-out prompts, batch 1 and 8, T=0 and 1 -> benchmarks/results/
	$(BIN)/python -m benchmarks.ngram_sweep --engine $(SPEC_ENGINE)

bench-lyanna: engine $(LYANNA_ABLATIONS)  ## Lyanna §7 tables: conditional acceptance (+ ablations, trained once), tau/speedup vs AR and ReDrafter, hot-token table, one-pass LM head -> benchmarks/results/
	$(BIN)/python -m benchmarks.lyanna_sweep

URL ?= localhost:8001
RATE ?= 2
loadtest: setup  ## fixed-QPS load test of a running server (URL=host:port RATE=req/s) -> benchmarks/results/loadtest.*
	$(BIN)/python -m benchmarks.loadtest --url $(URL) --rate $(RATE)

loadtest-openai: setup  ## the same load test through the OpenAI API (URL=localhost:9000 RATE=req/s)
	$(BIN)/python -m benchmarks.loadtest --backend openai --url $(URL) --rate $(RATE) --out benchmarks/results/loadtest_openai

soak: engine  ## serve $(SPEC_ENGINE) and soak it 5 min at RATE req/s (mixed methods, cancels, bad inputs): nothing lost, one FINAL each, counters, gauges, RSS -> benchmarks/results/soak.*
	$(BIN)/python -m benchmarks.soak --engine $(SPEC_ENGINE) --rate $(RATE) --duration 300

DOOR ?= grpc
bench-table2: engine  ## serve $(SPEC_ENGINE) with Triton; ms/token + speedup vs AR at light/medium/saturated QPS (DOOR=grpc|http|openai)
	$(BIN)/python -m benchmarks.table2 --engine $(SPEC_ENGINE) --door $(DOOR)

TRTLLM_OUT ?= work_dirs/trtllm-redrafter
export-trtllm: setup  ## TensorRT-LLM ReDrafter checkpoint + build script + tensorrtllm Triton repo -> $(TRTLLM_OUT)
	$(BIN)/python -m build.trtllm_export --checkpoint $(MODEL) --drafter $(DRAFTER) --output $(TRTLLM_OUT)

bench-drafter-tp: engine  ## TP=2 ReDrafter beam search, drafter replicated vs sharded -> benchmarks/results/
	OMP_NUM_THREADS=1 mpirun --allow-run-as-root --bind-to none -n 2 $(BIN)/python -m benchmarks.drafter_tp --engine $(SPEC_ENGINE)

clean:  ## remove built engines and caches (keeps .venv)
	rm -rf engines work_dirs .pytest_cache .mypy_cache .ruff_cache
