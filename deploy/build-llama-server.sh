#!/bin/sh
# Builds llama.cpp's llama-server (MIT), the local language model's process
# (rtc_server/local_llm/process.py), and installs it as VENV/bin/llama-server.
#
# The sources are the llama.cpp tree inside the llama-cpp-python sdist on PyPI, pinned by its
# SHA-256 in requirements-llama-source.txt; CMake and Ninja come from PyPI into the venv; a C++
# compiler from Debian when there is none. Only the server is built: no tests, no examples,
# no web UI (it would be downloaded), no HTTPS. The build is for this machine's processor and
# is kept in ~/.cache/avatar-rtc, keyed by the sources' hash and the flags, so a second
# `make install` (a fresh clone, CI) copies it in seconds; about 5 minutes on two cores the
# first time.
set -eu
VENV=$(cd "${1:?usage: build-llama-server.sh VENV}" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
REQUIREMENTS="$HERE/requirements-llama-source.txt"
FLAGS="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"

# The processor's vector instructions, named one by one on x86: -march=native would also take
# AMX wherever the processor lists it, and ggml's AMX code crashes (SIGSEGV at the first
# matrix product) on virtual machines that list AMX without enabling it.
if [ "$(uname -m)" = x86_64 ]; then
  cpu=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { for f in "$@"; do case "$cpu" in *" $f "*) ;; *) return 1 ;; esac; done; }
  FLAGS="$FLAGS -DGGML_NATIVE=OFF"
  has avx && FLAGS="$FLAGS -DGGML_AVX=ON"
  has avx2 fma f16c bmi2 && FLAGS="$FLAGS -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  has avx_vnni && FLAGS="$FLAGS -DGGML_AVX_VNNI=ON"
  if has avx512f avx512cd avx512vl avx512dq avx512bw; then
    FLAGS="$FLAGS -DGGML_AVX512=ON"
    has avx512vbmi && FLAGS="$FLAGS -DGGML_AVX512_VBMI=ON"
    has avx512_vnni && FLAGS="$FLAGS -DGGML_AVX512_VNNI=ON"
    has avx512_bf16 && FLAGS="$FLAGS -DGGML_AVX512_BF16=ON"
  fi
else
  FLAGS="$FLAGS -DGGML_NATIVE=ON"
fi

key=$( (cat "$REQUIREMENTS"; echo "$FLAGS") | sha256sum | cut -c1-16)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/avatar-rtc/llama-server-$key"

if [ ! -x "$cache/llama-server" ]; then
  command -v c++ >/dev/null 2>&1 || {
    echo "installing a C++ compiler from Debian..."
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
  }
  "$VENV/bin/python" -m pip install --quiet "cmake>=3.25" "ninja>=1.11"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "building llama-server from the llama.cpp sources of $(grep -m1 '^llama' "$REQUIREMENTS" | cut -d' ' -f1) (about 5 minutes on 2 cores)..."
  "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: --require-hashes \
    -r "$REQUIREMENTS" -d "$work"
  tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  # shellcheck disable=SC2086
  "$VENV/bin/cmake" -S "$work"/llama_cpp_python-*/vendor/llama.cpp -B "$work/build" -G Ninja \
    -DCMAKE_MAKE_PROGRAM="$VENV/bin/ninja" $FLAGS >"$work/configure.log" 2>&1 \
    || { cat "$work/configure.log"; exit 1; }
  "$VENV/bin/cmake" --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
    || { tail -50 "$work/build.log"; exit 1; }
  mkdir -p "$cache.tmp"
  cp "$work/build/bin/llama-server" "$cache.tmp/"
  rm -rf "$cache"
  mv "$cache.tmp" "$cache"
fi
install -m 0755 "$cache/llama-server" "$VENV/bin/llama-server"
