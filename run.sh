#!/usr/bin/env bash
# Turnwise's one entry point on a fresh machine: installs what the build needs when it is
# missing (cmake and libclang for llama.cpp, pip for first-use model downloads, a font for the
# demo's plots), then
#   ./run.sh test        -> cargo test --release
#   ./run.sh <command>   -> cargo run --release -- <command>   (e.g. ./run.sh demo)
set -euo pipefail
cd "$(dirname "$0")"

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
# libclang itself (libclang.so.N / libclang-N.so.N), not libclang-cpp, which bindgen cannot use
if ! ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/*/libclang-[0-9]*.so* >/dev/null 2>&1; then
  missing+=(libclang1-14)
fi
if ! ls /usr/lib/llvm-*/lib/clang/*/include/stdbool.h >/dev/null 2>&1; then
  missing+=(libclang-common-14-dev)   # without it bindgen fails on stdbool.h
fi
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
# a TrueType font for the demo report's plots
ls /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf >/dev/null 2>&1 || missing+=(fonts-dejavu-core)

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "run.sh: installing build prerequisites: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${missing[@]}" || { apt-get update -q && apt-get install -y -q "${missing[@]}"; }
  else
    echo "run.sh: missing build prerequisites: ${missing[*]}" >&2
    echo "install them with: sudo apt-get install ${missing[*]}   (Debian/Ubuntu package names)" >&2
    exit 1
  fi
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "run.sh: cargo not found; install Rust from https://rustup.rs" >&2
  exit 1
fi

case "${1:-}" in
  test) shift; exec cargo test --release "$@" ;;
  "") exec cargo run --release -- --help ;;
  *) exec cargo run --release -- "$@" ;;
esac
