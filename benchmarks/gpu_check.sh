#!/usr/bin/env bash
# The GPU checks, as one prepared run on a lent GPU machine that can reach no package registry.
#
#   bash benchmarks/gpu_check.sh bundle   # here: the packages that machine lacks, into .device/ (~35 MB)
#   bash benchmarks/gpu_check.sh run      # there, with .device carried: install them, then every step
#   STEPS='tests-gpu-path|decode-graphs|kv-rdt' bash benchmarks/gpu_check.sh run   # only those steps
#
# `run` steps, in order of value, each under its own time limit, logs in $OUT/logs.tgz (renewed after
# each step, so a run cut short still returns what it did): the GPU path's tests and goals (CUDA-graph
# decode, in-place paged attention, KV over Ray Direct Transport: docs/gpu.md), the test suite on CUDA
# (engine against transformers, workers sharing the GPU, the disaggregated cluster with its workers on
# the GPU), the two Ray-bound figures on a host with more than two cores (KV hand-off,
# router overhead), and the engine's per-phase roofline and offline throughput on the GPU.
set -u
cd "$(dirname "$0")/.."
BUNDLE=.device

bundle() {
    # Ray's wheel (79 MB) is over what one call may carry: keep its core (no RLlib/Tune/Train/Data/
    # Serve/LLM libraries, Java jars or dashboard web client) and compress it (~28 MB).
    local ray_version python="3.12" platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
    ray_version=$(.venv/bin/python -c "import ray; print(ray.__version__)")
    mkdir -p "$BUNDLE" /tmp/pdserve-ray && rm -rf /tmp/pdserve-ray/*
    grep -qx "/$BUNDLE/" .git/info/exclude || echo "/$BUNDLE/" >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
        "${platforms[@]}" -d /tmp/pdserve-ray "ray==$ray_version"
    (cd /tmp/pdserve-ray && unzip -q ray-*.whl && rm ray-*.whl \
        && rm -rf ray/jars ray/rllib ray/tune ray/train ray/data ray/serve ray/llm ray/dashboard/client/build \
        && tar cf - . | xz -T2 -6 > "$OLDPWD/$BUNDLE/ray-core.tar.xz")
    # What the GPU image lacks (it has torch, transformers, httpx, prometheus-client, xxhash, uvloop).
    local pins
    pins=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE \
        '^(fastapi|starlette|pydantic|pydantic_core|annotated-types|annotated-doc|typing-inspection|typing_extensions|uvicorn|httptools|openai|jiter|sniffio|anyio|httpx2|httpcore2|truststore|h11|opentelemetry-api|jsonschema|jsonschema-specifications|referencing|rpds-py)==')
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
        "${platforms[@]}" -d "$BUNDLE" $pins
    # The trained checkpoint the tests use as an oracle (1 MB), where ../shared has it.
    if [ -d ../shared/models/stories260K ]; then
        mkdir -p "$BUNDLE/shared/models" && cp -r ../shared/models/stories260K "$BUNDLE/shared/models/"
    fi
    du -sh "$BUNDLE"
}

step() {  # step NAME SECONDS COMMAND...: run it under a limit (cut to what is left of the run), log it
    local name=$1 limit=$2 start rc
    shift 2
    if [ -n "${STEPS:-}" ] && ! [[ $name =~ ^(${STEPS})$ ]]; then echo "=== $name: not in STEPS"; return; fi
    start=$(date +%s)
    (( limit > DEADLINE - start )) && limit=$(( DEADLINE - start ))
    if (( limit < 20 )); then echo "=== $name: skipped, the run's time is up"; return; fi
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    echo "--- $name: rc=$rc in $(( $(date +%s) - start ))s"
    tail -n "${TAIL:-30}" "$LOGS/$name.log"
    cp benchmarks/results/*.json "$LOGS/" 2>/dev/null
    tar czf "$OUT/logs.tgz" -C "$LOGS" .
}

run() {  # RUN_SECONDS (default 540): the whole run's budget; steps past it are cut short or skipped
    DEADLINE=$(( $(date +%s) + ${RUN_SECONDS:-540} ))
    OUT=${OUT:-/tmp/pdserve-gpu-out}
    LOGS=/tmp/pdserve-gpu-logs
    mkdir -p "$OUT" "$LOGS" /tmp/site
    python3 -c "import tarfile; tarfile.open('$BUNDLE/ray-core.tar.xz').extractall('/tmp/site', filter='tar')" || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$BUNDLE"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PDSERVE_SHARED=$PWD/$BUNDLE/shared
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    python3 -c "import sys, torch, transformers, ray, fastapi; print(sys.version.split()[0], 'torch', torch.__version__,
        'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'ray', ray.__version__)" || exit 1
    nproc
    # Issue 15's GPU path: its CUDA tests (graphs against eager, the in-place decode kernels, RDT),
    # then its goals: decode step time with graphs, and KV GPU to GPU over RDT (CUDA IPC).
    local gpu_path=(tests/test_cuda_graph_runner.py tests/test_gpu_decode_attention.py tests/test_device_kv.py
        tests/test_kv_transport_choice.py)
    TAIL=8 step tests-gpu-path 150 python3 -m pytest -q -p no:cacheprovider "${gpu_path[@]}"
    TAIL=8 step decode-graphs 120 python3 -m benchmarks.decode_graphs --batch 1 32 --steps 30
    TAIL=6 step kv-rdt 90 python3 -m benchmarks.kv_rdt_transfer --transport cuda_ipc --tokens 1024 4096 --trials 10
    # Workers in the simulated multi-node clusters ask Ray for no GPU (their nodes advertise none):
    # let them see it anyway, so the disaggregated tests run prefill and decode on the GPU.
    # tests/test_gpu_workers.py clears this for its own cluster (it checks the real GPU shares).
    local first=(tests/test_gpu_workers.py tests/test_model_vs_transformers.py tests/test_prompt_logprobs.py
        tests/test_kv_handoff.py tests/test_prefix_cache.py tests/test_engine_stories260k.py
        tests/test_e2e_disaggregated.py)
    TAIL=8 step tests-cuda 150 env RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 \
        python3 -m pytest -q -p no:cacheprovider "${first[@]}"
    step kv-transfer 100 python3 -m benchmarks.kv_transfer --variants xxh3 --trials 12
    step router-overhead 120 env RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 python3 -m benchmarks.router_overhead --requests 50 --rounds 2
    TAIL=6 step step-profile-cuda 60 python3 -m benchmarks.step_profile --device cuda --preset 1b --batch 1 32 --top 8
    step roofline-cuda 100 python3 -m benchmarks.engine_roofline --device cuda --dtype bfloat16 --max-foreign-cores 4
    step offline-cuda 90 python3 -m benchmarks.offline_throughput --device cuda --dtype bfloat16 \
        --hf-batch-sizes 32 --rounds 2
    TAIL=12 step tests-rest 300 env RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 \
        python3 -m pytest -q -p no:cacheprovider tests "${first[@]/#/--ignore=}" "${gpu_path[@]/#/--ignore=}"
}

case "${1:-}" in
    bundle) bundle ;;
    run) run ;;
    *) echo "usage: $0 bundle|run" >&2; exit 2 ;;
esac
