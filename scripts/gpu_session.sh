#!/usr/bin/env bash
# The NVIDIA GPU checks of issue 16 (cuDNN block kernel, GPU train step), prepared to run on
# the lent H200 through the device tool in two calls of a few minutes each. That machine has
# JAX with CUDA, flax, optax and orbax but not pydantic, tensorboardX or ringattention: they
# travel as wheels, with the demo's video and dataset packages. Here, first (pip works here,
# not there; about a minute):
#
#   bash scripts/gpu_session.sh wheels
#
# downloads them into .whl and .whl-demo (both added to .git/info/exclude) and makes the
# demo's videos (runs/demo/videos, about 14 MB, so that PyAV need not travel). Then, before
# the first device call, here on the CPU (no wheels needed, about 2 minutes; check_demo about 3):
#
#   PYTHON=.venv/bin/python bash scripts/gpu_session.sh check
#   PYTHON=.venv/bin/python bash scripts/gpu_session.sh check_demo
#
# runs the attention and train parts' commands at small sizes (check_demo: the demo, tiny),
# each Python process refusing any package the project imports that neither the GPU
# machine's image nor the wheels supply (scripts/gpu_image_check.py), so that a missing import
# fails here, not there. Then run, with carry [".whl"] and timeout_s 540:
#
#   bash scripts/gpu_session.sh attention   # parity tests, bench_attention (about 4 minutes)
#   bash scripts/gpu_session.sh train       # bench_train 8K/32K, lwm train tiny (about 5)
#   bash scripts/gpu_session.sh train_more  # remat dots_saveable, 256K (about 7)
#   bash scripts/gpu_session.sh longest     # 512K, one step (up to 10)
#   bash scripts/gpu_session.sh packed      # packed rows at 8K/32K: the in-order schedule against
#                                           # the general one, command buffers (about 8)
#   bash scripts/gpu_session.sh profile     # where one fwd+bwd call's time goes (about 2)
#   bash scripts/gpu_session.sh second      # the known-order cuDNN schedule (8deb308) and the
#                                           # general path's memory (aae31ed): parity, attention,
#                                           # train steps 8K/32K, then 128K and cuDNN's packed
#                                           # layout as the budget allows (about 9.5)
#
# and the README's demo on the GPU, with carry [".whl", ".whl-demo", "runs/demo/videos"]:
#
#   bash scripts/gpu_session.sh demo        # the demo on one GPU, timed
#
# Every step writes its log in /tmp/gpu_session_logs and packs all the logs into $OUT/logs.tgz:
# at most 8 files come back from $OUT (the device README), one archive always does. The summary line and the last lines of each step are printed (the call's output tail).
# On the device, no step runs past GPU_SESSION_BUDGET seconds from the start (default 575,
# inside the call's timeout_s 590): a step's limit is cut to what is left, and a step with
# under 20 s left is skipped, so the summary lines come back. Give it the call's timeout_s
# less 15 when a call has less (e.g. the rest of a session's device time).
set -uo pipefail
PARTS="wheels check check_demo first second attention train train_more longest packed profile demo"
part=${1:?usage: gpu_session.sh ${PARTS// /|}}
case " $PARTS " in
*" $part "*) ;;
*)  # before any install or device time
    echo "gpu_session.sh: unknown part '$part' (one of: $PARTS)" >&2
    exit 2
    ;;
esac
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out"
# outside $out (what comes back: logs.tgz and device.txt): the steps' logs and small outputs,
# packed into $out/logs.tgz; and what stays on the machine (a run's checkpoints)
logs=/tmp/gpu_session_logs work=/tmp/gpu_session_work
rm -rf "$logs" "$work"
mkdir -p "$logs" "$work"

# What the GPU machine's image lacks (the device library's KINDS.md), carried as wheels for
# its Python 3.12: for every part, and for the demo (promise has no wheel: its source archive)
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    tensorboardX==2.6.5 ringattention==0.1.2"
DEMO_WHEELS="tensorflow-datasets==4.9.10 array_record==0.8.6 grain==0.2.18 decord==0.6.0
    dm-tree==0.1.10 immutabledict==4.3.1 simple_parsing==0.1.9 tensorflow-metadata==1.21.0
    termcolor==3.3.0 toml==0.10.2 portpicker==1.6.0 docstring_parser==0.18.0
    googleapis-common-protos==1.76.0"
DEMO_SOURCES="promise==2.3"
names() {  # the distributions of pinned requirements, comma-separated
    local n
    for n in "$@"; do printf '%s,' "${n%%==*}"; done
}

budget=${GPU_SESSION_BUDGET:-575}
pack() {  # everything in $logs as $out/logs.tgz, replaced whole (a cut-off call keeps the last)
    tar -czf "$out/logs.tgz.part" -C "$logs" . && mv -f "$out/logs.tgz.part" "$out/logs.tgz"
}

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $logs/NAME.log
    local name=$1 limit=$2 left
    shift 2
    left=$((budget - SECONDS))  # SECONDS: since this script started
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, $left s left of GPU_SESSION_BUDGET $budget" |
            tee -a "$logs/summary.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    timeout "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$? errors ooms note=""
    # the scripts report a measurement that failed as a JSON line and go on: count them
    # ("error", "failed: ...", a parity "mismatch"; "oom" apart)
    errors=$(grep -cE '"status": "(error|failed|mismatch)' "$logs/$name.log")
    ooms=$(grep -c '"status": "oom"' "$logs/$name.log")
    [ "$errors" -gt 0 ] && note=" ($errors measurements failed)"
    [ "$ooms" -gt 0 ] && note="$note ($ooms out of memory)"
    echo "== $name: rc=$rc in $((SECONDS - t0)) s$note" | tee -a "$logs/summary.txt"
    tail -n 4 "$logs/$name.log" | cut -c1-400
    pack
}

if [ "$part" = wheels ]; then
    py=${PYTHON:-python3}
    for d in .whl .whl-demo; do
        grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
    done
    target=(--python-version 3.12 --implementation cp)
    for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
        target+=(--platform "${tag}_x86_64")
    done
    # shellcheck disable=SC2086
    "$py" -m pip download -q --no-deps --only-binary=:all: "${target[@]}" -d .whl $WHEELS &&
        "$py" -m pip download -q --no-deps --only-binary=:all: "${target[@]}" -d .whl-demo \
            $DEMO_WHEELS &&
        "$py" -m pip download -q --no-deps --no-binary=:all: -d .whl-demo $DEMO_SOURCES || exit 1
    du -sh .whl .whl-demo
    if [ ! -f runs/demo/videos/held_out/manifest.jsonl ]; then
        "$py" scripts/demo.py --videos-only || exit 1
    fi
    du -sh runs/demo/videos
    exit 0
fi
if [ "$part" = check ] || [ "$part" = check_demo ]; then
    py=${PYTHON:-python3}
    block=$(mktemp -d)
    cp scripts/gpu_image_check.py "$block/sitecustomize.py"
    # shellcheck disable=SC2086
    carried=$(names $WHEELS)
    export PYTHONPATH="$block:$PWD" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu LWM_CHECK_ROOT=$PWD
    export LWM_TRACEBACK=1  # as on the device
    export LWM_CARRIED=$carried
    budget=100000  # no device time here
fi
if [ "$part" = check ]; then
    step check_info 120 "$py" -m lwm info configs/tiny.yaml model.attention_kernel=auto
    step check_parity 300 "$py" -m pytest -q -p no:cacheprovider tests/test_cudnn_attention.py
    # one device and bf16, as on the GPU; the cuDNN impls with cuDNN's stand-in (cudnn itself
    # runs only there)
    step check_bench_attention 300 "$py" scripts/bench_attention.py --platform cpu --seqs 512 \
        --cpu-devices 1 --dtype bfloat16 --impls ours,ours-cudnn,ours-cudnn-doc --check \
        --check-seq 512 --check-block 64 --repeats 1
    step check_bench_train 300 "$py" scripts/bench_train.py --platform cpu --sizes tiny \
        --seqs 256 --attention blockwise --kernels xla,cudnn --one-document --repeats 1 \
        --mesh 1,1,1,1
    step check_bench_train_packed 300 "$py" scripts/bench_train.py --platform cpu --sizes tiny \
        --seqs 256 --attention blockwise --kernels cudnn --rows auto,device,any --repeats 1 \
        --mesh 1,1,1,1 --set model.dtype=bfloat16  # bf16: cuDNN's, so every order is its own
    step check_profile 120 "$py" scripts/profile_attention.py --platform cpu --seqs 512 \
        --heads 4 --head-dim 32 --repeats 1 --trace-calls 1
    step check_packed 120 "$py" scripts/probe_cudnn_packed.py --platform cpu
    step check_tiny 300 "$py" -m lwm train --config configs/tiny.yaml train.steps=2 \
        train.output_dir="$work/check_tiny" train.batch_size=1 model.attention_kernel=auto
    rm -rf "$block"
    exit 0
fi
if [ "$part" = check_demo ]; then  # the demo, tiny, as `demo` runs it there (its videos made
    # first, as `wheels` makes them, without the check: PyAV writes them)
    # shellcheck disable=SC2086
    export LWM_CARRIED=$carried$(names $DEMO_WHEELS $DEMO_SOURCES)
    tiny=(--out "$work/check_demo" --videos 8 --held-out 2 --vqgan-steps 2 --lm-steps 2
        --shapes-first-steps 1 --mesh 1,1,1,1)
    step check_demo_videos 120 env PYTHONPATH="$PWD" "$py" scripts/demo.py "${tiny[@]}" \
        --videos-only
    # --platform gpu: the demo's GPU branch (no --cpu-devices), on the one CPU device JAX sees
    step check_demo 400 "$py" scripts/demo.py "${tiny[@]}" --platform gpu
    rm -rf "$block" "$work"
    exit 0
fi
# which GPU: the device tool lends an H100 (80 GB) unless nvidia-h200 is named; saved with
# the logs, since the records name no chip
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader |
    tee "$out/device.txt" "$logs/device.txt"
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
if [ "$part" = longest ] && [ "${gpu_mib:-0}" -lt 120000 ]; then
    # 133.6 GiB planned on the CPU (GPU plans were 0.72-0.83x) + 12.75 of state: an H200 only
    echo "gpu_session.sh longest: 512K needs an H200; this GPU has ${gpu_mib:-?} MiB: not run"
    exit 3
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
if [ "$part" = demo ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl-demo/* || exit 1
fi
# LWM_TRACEBACK: a measurement that fails keeps its traceback in its step's log (the scripts
# record it as one line and go on), and an input error shows where it came from
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda LWM_TRACEBACK=1
# compiled programs kept on the machine while it stays warm: a second call that runs a step
# again (after a cut-off one) skips its compiles; its records' compile_s are then cache reads
export JAX_COMPILATION_CACHE_DIR=/tmp/lwm_jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=5

python3 -c "import jax; print('jax', jax.__version__, jax.devices(), jax.devices()[0].device_kind)" |
    tee -a "$out/device.txt" "$logs/device.txt"
case $part in
first)  # one call of at most 9 minutes: the issue's three measurements, tightest first
    step info 30 python3 -m lwm info configs/tiny.yaml model.attention_kernel=auto
    step parity 150 env LWM_REQUIRE_GPU=1 python3 -m pytest -q -p no:cacheprovider \
        tests/test_cudnn_attention.py -k gpu
    step bench_attention 200 python3 scripts/bench_attention.py --platform gpu \
        --seqs 8192,32768 --repeats 3
    step bench_train 150 python3 scripts/bench_train.py --platform gpu --sizes 7b-4l \
        --seqs 8192,32768 --attention blockwise --kernels cudnn --one-document --repeats 3
    ;;
second)  # one call (timeout_s 590), most important first, what the budget leaves last:
    # parity of the schedules never run on a GPU (7 tests), the known-order schedule (8deb308)
    # at 8K and 32K, the train step at 8K and 32K, then 128K (the general path's memory,
    # aae31ed) and packed rows if time is left (`packed` has them too)
    step parity 150 env LWM_REQUIRE_GPU=1 python3 -m pytest -q -p no:cacheprovider \
        tests/test_cudnn_attention.py -k gpu
    step bench_attention 110 python3 scripts/bench_attention.py --platform gpu \
        --seqs 8192,32768 --impls ours-cudnn,ours-cudnn-doc,cudnn --repeats 5
    step bench_train 150 python3 scripts/bench_train.py --platform gpu --sizes 7b-4l \
        --seqs 8192,32768 --attention blockwise --kernels cudnn --one-document --repeats 3
    # 128K: about 45-53 GiB planned + 12.75 of state, over JAX's default 75% of an H100's 80 GB
    step bench_train_128k 150 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 \
        scripts/bench_train.py --platform gpu --sizes 7b-4l --seqs 131072 --attention blockwise \
        --kernels cudnn --one-document --repeats 2
    step packed 60 python3 scripts/probe_cudnn_packed.py --platform gpu --out "$logs/packed"
    ;;
attention)
    step info 60 python3 -m lwm info configs/tiny.yaml model.attention_kernel=auto
    step parity 200 env LWM_REQUIRE_GPU=1 python3 -m pytest -q -p no:cacheprovider \
        tests/test_cudnn_attention.py -k gpu
    step bench_attention 300 python3 scripts/bench_attention.py --platform gpu \
        --seqs 8192,32768 --check --check-seq 4096 --check-block 512 --repeats 5
    step bench_attention_128k 120 python3 scripts/bench_attention.py --platform gpu \
        --seqs 131072 --modes fwd_bwd --impls ours-cudnn,ours-cudnn-doc,cudnn --repeats 3
    ;;
train)
    step bench_train 330 python3 scripts/bench_train.py --platform gpu --sizes 7b-4l \
        --seqs 8192,32768 --attention blockwise --kernels xla,cudnn --one-document --repeats 5
    step tiny 60 python3 -m lwm train --config configs/tiny.yaml train.steps=30 \
        train.output_dir="$work/tiny" model.dtype=bfloat16 model.attention_kernel=auto
    # its checkpoints stay there (about 110 MB); its log lines come back
    cp "$work/tiny/metrics.jsonl" "$logs/tiny-metrics.jsonl" 2>/dev/null
    pack
    ;;
train_more)  # one call of about 7 minutes (timeout_s 590)
    step bench_train_remat 150 python3 scripts/bench_train.py --platform gpu --sizes 7b-4l \
        --seqs 8192 --attention blockwise --kernels cudnn --one-document --remat dots_saveable \
        --repeats 5
    # MLP and loss 8K tokens at a time: 69.3 GiB planned at 256K on the CPU (34f2977), 122.5 without
    step bench_train_256k 300 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 \
        scripts/bench_train.py --platform gpu --sizes 7b-4l --seqs 262144 --attention blockwise --kernels cudnn --one-document --repeats 2 \
        --set model.mlp_chunk_size=8192 --set model.logits_chunk_size=8192
    ;;
longest)  # one call of up to 10 minutes: 512K (133.6 GiB planned on the CPU with the chunks)
    step bench_train_512k 590 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 \
        scripts/bench_train.py --platform gpu --sizes 7b-4l --seqs 524288 \
        --attention blockwise --kernels cudnn --one-document --repeats 1 \
        --set model.mlp_chunk_size=8192 --set model.logits_chunk_size=8192
    ;;
packed)  # one call of about 8 minutes (timeout_s 590): packed rows in the train step, the
    # schedule `lwm train` chooses for them (in order: one check per attention call) against the
    # general one (a conditional per piece and layer), the latter with XLA's command buffers
    # (CUDA graphs) taking the conditionals, one document per row beside them, and attention
    # alone (the packed probe: general, in order, cuDNN's own packed layout)
    # 8K: in order (auto: one process), the same chosen on the device (many processes),
    # general
    step bench_train_packed 120 python3 scripts/bench_train.py --platform gpu \
        --sizes 7b-4l --seqs 8192 --attention blockwise --kernels cudnn --repeats 3 \
        --rows auto,device,any
    # 32K: in order within a band of one piece (auto), the same chosen on the device (as
    # many processes run it), general
    step bench_train_packed_32k 180 python3 scripts/bench_train.py --platform gpu \
        --sizes 7b-4l --seqs 32768 --attention blockwise --kernels cudnn --repeats 2 \
        --rows auto,device,any
    step bench_train_packed_graphs 100 python3 scripts/bench_train.py --platform gpu \
        --sizes 7b-4l --seqs 8192 --attention blockwise --kernels cudnn --repeats 3 --rows any \
        --compiler-options '{"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE", "xla_gpu_graph_min_graph_size": 1}'
    step bench_train_one_document 80 python3 scripts/bench_train.py --platform gpu \
        --sizes 7b-4l --seqs 8192 --attention blockwise --kernels cudnn --repeats 3 --one-document
    step packed_8k_3docs 45 python3 scripts/probe_cudnn_packed.py --platform gpu --docs 3 \
        --out "$logs/packed"
    step packed_32k_16docs 45 python3 scripts/probe_cudnn_packed.py --platform gpu \
        --seq 32768 --docs 16 --no-check
    ;;
profile)  # and with XLA's command buffers (CUDA graphs) taking conditionals and loops too
    step parity 150 env LWM_REQUIRE_GPU=1 python3 -m pytest -q -p no:cacheprovider \
        tests/test_cudnn_attention.py -k gpu
    step profile 150 python3 scripts/profile_attention.py --platform gpu --seqs 8192,32768
    # ("+CONDITIONAL,+WHILE" alone is refused by jax 0.11.2's compiler options: not run)
    step profile_graphs_all 120 python3 scripts/profile_attention.py --platform gpu \
        --seqs 8192,32768 --impls raw,ours-cudnn,ours-noswitch --compiler-options \
        '{"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE", "xla_gpu_graph_min_graph_size": 1}'
    grep -h '^{' "$logs"/profile*.log | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r["impl"], r["seq"], r.get("compiler_options", {}).get("xla_gpu_enable_command_buffer", "-")[:12],
          r.get("status"), r.get("time_ms"), r.get("kernel_ms_per_call"), r.get("span_ms_per_call"),
          r.get("hlo", {}).get("conditional"), r.get("error", "")[:200])'
    ;;
demo)
    step demo 520 python3 scripts/demo.py --platform gpu
    # what it wrote under runs/demo would not come back: its losses and answers
    mkdir -p "$logs/demo"
    for run in shapes lm; do
        [ -f "runs/demo/$run/metrics.jsonl" ] && cp "runs/demo/$run/metrics.jsonl" "$logs/demo/$run-metrics.jsonl"
    done
    cp -r runs/demo/lm/eval "$logs/demo/" 2>/dev/null
    ;;
esac
pack
echo "logs: $out/logs.tgz ($(tar -tzf "$out/logs.tgz" | grep -vc '/$') files, $(du -k "$out/logs.tgz" | cut -f1) KiB)"
