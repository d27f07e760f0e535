#!/bin/bash
# The device checks of a GPU session in one command (~6-7 min on an H200, every stage under its
# own timeout; results packed into $OUT/results.tgz after each stage, so a cut-off run still
# returns what it finished):
#   1. the demo engines built on the machine (fp32 targets, as `make engine` builds them);
#   2. the CUDA tests of the graphs' linears, the draft LM's cache and graphs, AR greedy;
#   3. load-aware sweeps of every engine, and of ReDrafter's again with cuBLAS linears only
#      (TRITON_SAVES=1: the graphs as before plugins/gpu_linear.py), on the same machine,
#      so before / after compare within one call; fixed sweeps of the draft-LM and Lyanna
#      engines (the best fixed size is what load-aware is held to; on an H200 in session 24
#      fixed Lyanna ran 0.71x AR at batch 1, so load-aware rightly drafted nothing);
#   4. `benchmarks.step_profile`, `benchmarks.torch_profile` (kernels by device time),
#      `benchmarks.policy_trace` of sd and Lyanna at batch 1, T=0 (each drafting-cost fit's
#      samples and prices), `benchmarks.gpu_linear_bench` (few-row products: cuBLAS vs
#      the split-K kernel) and `benchmarks.compiled_forward` (the target's forward: eager vs
#      torch.compile, not yet measured on a GPU);
#   5. the rest of the decoding paths' CUDA tests (greedy == AR per method, verification,
#      batch-invariant kernels).
# Session 22 ran it in ~4.5 min of a call (the sweeps ~15-25 s each); session 24 in 5.7 min
# (before the fixed sweeps and the policy traces).
# Usage, from the repository root on the GPU machine (its python3 holds a CUDA torch):
#   OUT=<dir> SPECPIPE_STDLIB_ROOT=<copy of the held-out stdlib files> bash benchmarks/gpu_check.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
: "${OUT:?set OUT to a folder for the results}" "${SPECPIPE_STDLIB_ROOT:?set SPECPIPE_STDLIB_ROOT (README: Running on a GPU)}"
R=$(mktemp -d); pack() { (cd "$R" && tar czf "$OUT/results.tgz" .); }
nvidia-smi -L; date
python3 -m build.engine --checkpoint models/demo-target --drafter models/demo-redrafter --output engines/demo-redrafter --max-batch-size 32 --beam-width 4 --beam-length 5 --drafter-head int4 --force 2>&1 | tail -1
python3 -m build.engine --checkpoint models/demo-target --draft-model models/demo-draft-lm --output engines/demo-draft-lm --max-batch-size 32 --force 2>&1 | tail -1
python3 -m build.engine --checkpoint models/demo-target --lyanna models/demo-lyanna --output engines/demo-lyanna --max-batch-size 32 --force 2>&1 | tail -1
date
T() { SPECPIPE_TEST_DEVICE=cuda timeout "$1" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -m "not slow" "${@:2}" \
  2>&1 | grep -v "^    \|^$" | tail -25; date; }
T 120 tests/plugins/test_gpu_linear.py tests/runtime/test_cuda_graph_linears.py tests/runtime/test_draft_lm_cache.py \
  tests/runtime/test_ar_greedy.py
sweep() { # $1 label, $2 engine, $3 methods, $4 TRITON_SAVES (empty: as committed), $5 speculation (default load-aware)
  timeout 80 python3 -c "import sys, runtime.cuda_graphs as c; c.TRITON_SAVES = float(sys.argv[1]) if sys.argv[1] else c.TRITON_SAVES; from benchmarks.device_sweep import main; main(sys.argv[2:])" "$4" \
    --engine "engines/$2" --device cuda --dtype engine --methods "$3" --batch-sizes 1,8,32 --temperatures 0,1 \
    --max-tokens 64 --rounds 3 --speculation "${5:-load-aware}" --out "$R/device_sweep_$1_$2" 2>&1 | grep '^|' | tail -8
  python3 -c "import json, sys; [print(k, v.get('graph_linears'), v.get('graph_replay_ms')) for k, v in json.load(open(sys.argv[1]))['meta']['engines'].items()]" "$R/device_sweep_$1_$2.json" 2>&1 | tail -2
  date; pack
}
sweep new demo-redrafter redrafter ""
sweep cublas demo-redrafter redrafter 1.0
sweep new demo-draft-lm sd,rsd-c,rsd-s ""
sweep new demo-lyanna lyanna ""
sweep fixed demo-draft-lm sd,rsd-c,rsd-s "" fixed
sweep fixed demo-lyanna lyanna "" fixed
timeout 60 python3 -m benchmarks.step_profile --device cuda --methods ar redrafter sd --batches 1 8 --temperatures 0 1 \
  --out "$R/step_profile" 2>&1 | tail -1
grep "^| " "$R/step_profile.md" | cut -c1-150
timeout 60 python3 -m benchmarks.torch_profile --device cuda --runs ar:1 ar:8 redrafter:1 redrafter:8 --out "$R/torch_profile.txt" \
  2>&1 | grep "^==\|^ \+[0-9]\+ \(graph\|eager\)"
date; pack
for m in draft-lm:sd lyanna:lyanna; do  # what load-aware priced its drafting at, per fit (benchmarks/policy_trace.py)
  timeout 40 python3 -m benchmarks.policy_trace --engine "engines/demo-${m%%:*}" --method "${m##*:}" --device cuda \
    --out "$R/policy_trace_${m##*:}" 2>&1 | grep "^| [a-z]" | cut -c1-160
done
timeout 60 python3 -m benchmarks.gpu_linear_bench --out "$R/gpu_linear" 2>&1 | grep "^| " | cut -c1-120
timeout 90 python3 -m benchmarks.compiled_forward --device cuda --tokens 1,8,40 --repeats 20 --out "$R/compiled_forward" \
  2>&1 | grep "^| " | cut -c1-120  # (the engine replays CUDA graphs of the eager forward: its ms is the "eager" row's floor)
date; pack
T 120 tests/plugins/test_batch_invariant.py tests/runtime/test_verify.py tests/runtime/test_redrafter_greedy.py \
  tests/runtime/test_rsd_greedy.py tests/runtime/test_lyanna_greedy.py
pack
