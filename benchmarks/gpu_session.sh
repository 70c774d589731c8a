#!/bin/bash
# A GPU session in as few device calls as possible (docs/development.md, "On a lent GPU").
#
# Here, before the first call (the GPU machine reaches no package registry):
#   bash benchmarks/gpu_session.sh wheels        # .whl/: the packages its image lacks, as this venv has them
# There, in one call (each step bounded by its seconds; logs and ledger results under $OUT):
#   bash benchmarks/gpu_session.sh setup suite train:64000 train:16000
#
# Steps: setup (the wheels into the image's Python, this checkout editable, CUDA 12's cuBLAS names
# for CTranslate2's wheel on CUDA 13), suite (the whole suite across the cores, every GPU test
# included), gpu (the GPU-marked tests alone), train:TOKENS (Transformer-base bf16, compiled, at
# TOKENS a batch, into the ledger; its three compiles take about three minutes), decode (GPU
# decoding against nn.Transformer and CTranslate2; needs runs/demo, carried), converge:STEPS (Transformer-
# base eager and compiled for STEPS updates at TOKENS a batch: their valid losses), profile:TOKENS (where
# the compiled Transformer-base bf16 step's time goes at TOKENS a batch: device time by kind of kernel,
# launches, the op census; into the ledger), cpu (where the machine's CPU has AMX: the small model's
# bf16 training on it against the fp32 reference, two threads as the ledger's CPU runs, and without
# the trainer's heap trim, to weigh the kernel time its re-faulted pages cost where a step is short; then
# profile_train's op table of that step, the weight gradients' products and attention's kernels alone,
# and the bf16 side again under tcmalloc where the wheels step carried it; into the ledger; "Fast
# hardware" has had no AMX machine since 2026-11-28).
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
START=$SECONDS
# The image has torch, numpy, sentencepiece, sacrebleu, typer, tqdm, pyyaml, matplotlib, pytest,
# pytest-xdist, hypothesis and httpx; not these (fastapi needs opentelemetry-api).
MISSING="ctranslate2 datasets dill multiprocess fastapi starlette pydantic pydantic_core annotated-types
typing-inspection annotated-doc uvicorn opentelemetry-api typing_extensions pytest-timeout ninja"

elapsed() { echo "[$((SECONDS - START)) s] $*"; }

for step in "$@"; do
  case $step in
    wheels)
      specs=$(for name in $MISSING; do
        .venv/bin/python -m pip show "$name" 2>/dev/null | awk -v n="$name" '/^Version:/ {print n "==" $2}'
      done)
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl $specs
      # tcmalloc, for the cpu step's run under it (the image has none and no package manager's reach)
      tcmalloc=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 .*x86-64/ {print $NF; exit}')
      if [ -n "$tcmalloc" ]; then cp -L "$tcmalloc" .whl/; else echo "no libtcmalloc_minimal.so.4 here to carry"; fi
      du -sh .whl ;;
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl >"$OUT/setup.log" 2>&1
      python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/setup.log" 2>&1
      # torch's CUDA libraries sit in nvidia/cublas/lib or nvidia/cu13/lib (it varies by image): find them
      cublas=$(find / -xdev -path /proc -prune -o -name 'libcublas.so.13*' -print 2>/dev/null | head -1)
      mkdir -p /tmp/cuda12 && for lib in libcublas libcublasLt; do
        ln -sf "$(dirname "$cublas")/$lib.so.13" "/tmp/cuda12/$lib.so.12"; done
      echo "cuBLAS 13 for CTranslate2: ${cublas:-not found}" >>"$OUT/setup.log"
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        python3 -c "import torch, ctranslate2; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'ctranslate2', ctranslate2.__version__, ctranslate2.get_cuda_device_count(), 'GPU')"
      } 2>&1 | tee "$OUT/machine.txt"
      elapsed "setup" ;;
    suite)  # a thread per worker, not 16 each: on 2026-11-26 (an H200) the suite ran past 330 s, its docs test last
      OMP_NUM_THREADS=1 LD_LIBRARY_PATH=/tmp/cuda12:${LD_LIBRARY_PATH:-} timeout "${SUITE_SECONDS:-420}" \
        python3 -m pytest -v -n 12 --dist loadscope -p no:cacheprovider -rfE --durations=10 >"$OUT/suite.log" 2>&1
      elapsed "suite: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | tail -20 ;;
    gpu)
      LD_LIBRARY_PATH=/tmp/cuda12:${LD_LIBRARY_PATH:-} timeout "${GPU_SECONDS:-240}" \
        python3 -m pytest -q -m gpu -p no:cacheprovider -rfE >"$OUT/gpu.log" 2>&1
      elapsed "gpu tests: exit $?"; tail -5 "$OUT/gpu.log" ;;
    train:*)
      tokens=${step#train:}
      PYTHONUNBUFFERED=1 timeout "${TRAIN_SECONDS:-300}" python3 benchmarks/ledger.py run benchmark_train.py \
        --model base --max-tokens "$tokens" --compile --sides "ours bf16" --warmup 60 --steps 40 --threads 8 \
        >"$OUT/train_$tokens.log" 2>&1
      elapsed "train $tokens: exit $?"; grep "^|" "$OUT/train_$tokens.log" ;;
    profile:*)
      tokens=${step#profile:}
      PYTHONUNBUFFERED=1 timeout "${PROFILE_SECONDS:-300}" python3 benchmarks/ledger.py run profile_train.py \
        --model base --max-tokens "$tokens" --precision bf16 --compile --warmup 40 --steps 20 --profile-steps 3 \
        --threads 8 >"$OUT/profile_$tokens.log" 2>&1
      elapsed "profile $tokens: exit $?"; grep -A14 "tokens/batch, " "$OUT/profile_$tokens.log" ;;
    converge:*)  # the compiled step trains as the eager one: valid loss after the same updates (same batches)
      steps=${step#converge:}
      base="model.d_model=512 model.heads=8 model.ffn_dim=2048 model.encoder_layers=6 model.decoder_layers=6 model.norm=post"
      for compiled in false true; do
        sets=$(for kv in $base train.max_tokens=${TOKENS:-64000} train.max_steps=$steps train.valid_every=$steps \
                 train.save_every=$steps train.compile=$compiled; do printf -- "--set %s " "$kv"; done)
        rm -rf "/tmp/converge-$compiled"  # this script's own scratch run
        timeout "${CONVERGE_SECONDS:-240}" seq2seq train "${CONFIG:-configs/bible_en_es.yaml}" $sets \
          --run-dir "/tmp/converge-$compiled" --quiet >"$OUT/converge_$compiled.log" 2>&1
        elapsed "converge compile=$compiled: exit $?"
      done
      python3 -c "
import json
loss = {c: [json.loads(l) for l in open(f'/tmp/converge-{c}/metrics.jsonl') if '\"valid\"' in l][-1]['loss']
        for c in ('false', 'true')}
print(f'valid loss after $steps updates: eager {loss[\"false\"]:.4f}, compiled {loss[\"true\"]:.4f} '
      f'({loss[\"true\"] / loss[\"false\"] - 1:+.2%})')" | tee "$OUT/converge.txt" ;;
    decode)
      LD_LIBRARY_PATH=/tmp/cuda12:${LD_LIBRARY_PATH:-} timeout "${DECODE_SECONDS:-240}" \
        python3 benchmarks/ledger.py run benchmark_decode.py --device cuda >"$OUT/decode.log" 2>&1
      elapsed "decode: exit $?"; grep "^|" "$OUT/decode.log" ;;
    cpu)  # the GPU hidden, so that the benchmark and the ledger see the CPU
      if grep -q amx_bf16 /proc/cpuinfo; then
        CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1 timeout "${CPU_SECONDS:-420}" python3 benchmarks/ledger.py run \
          benchmark_train.py --sides "reference fp32" "ours bf16" "ours bf16 untrimmed" --steps 60 --warmup 10 \
          --threads 2 >"$OUT/cpu.log" 2>&1
        elapsed "cpu (AMX): exit $?"; grep -E "^\||kernels" "$OUT/cpu.log"
        CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1 timeout "${CPU_PROFILE_SECONDS:-180}" python3 benchmarks/ledger.py run \
          profile_train.py --precision bf16 --max-tokens 4000 --threads 2 --rows 25 >"$OUT/cpu_profile.log" 2>&1
        elapsed "cpu profile (AMX): exit $?"; grep -A3 "tokens/batch, " "$OUT/cpu_profile.log"
        # seconds each: the weight gradients' product against oneDNN's backward-weights primitive, and
        # attention on the tiles (their packing since 7686e91) against PyTorch's kernels
        for bench in "benchmark_weight_gradients.py" "benchmark_attention.py --tokens 4000 --heads 4 --lengths 24 40 64"; do
          CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 timeout "${CPU_KERNEL_SECONDS:-90}" \
            python3 benchmarks/ledger.py run $bench >>"$OUT/cpu_kernels.log" 2>&1
          elapsed "cpu ${bench%% *} (AMX): exit $?"
        done
        grep -E "^\|" "$OUT/cpu_kernels.log"
        # the same bf16 side under tcmalloc where the wheels step carried it and it loads here
        tcmalloc=$PWD/.whl/libtcmalloc_minimal.so.4
        in_use="from seq2seq.training.host_memory import allocator_in_use; print(allocator_in_use())"
        if [ -f "$tcmalloc" ] && [ "$(LD_PRELOAD=$tcmalloc python3 -c "$in_use" 2>/dev/null)" = tcmalloc ]; then
          CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1 LD_PRELOAD=$tcmalloc timeout "${CPU_TCMALLOC_SECONDS:-150}" \
            python3 benchmarks/ledger.py run benchmark_train.py --sides "ours bf16" --steps 60 --warmup 10 \
            --threads 2 >"$OUT/cpu_tcmalloc.log" 2>&1
          elapsed "cpu under tcmalloc (AMX): exit $?"; grep -E "^\|" "$OUT/cpu_tcmalloc.log"
        else
          elapsed "cpu under tcmalloc: no loadable .whl/libtcmalloc_minimal.so.4: not run"
        fi
      else
        elapsed "cpu:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) has no AMX: nothing run"
      fi ;;
    *) echo "unknown step: $step (expected wheels, setup, suite, gpu, train:TOKENS, profile:TOKENS, converge:STEPS, decode or cpu)" >&2; exit 2 ;;
  esac
done
tar czf "$OUT/results.tgz" benchmarks/results/*/*gpu* benchmarks/results/*/*amx* 2>/dev/null
