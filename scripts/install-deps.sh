#!/usr/bin/env bash
# Installs, with apt-get, the Debian packages longtrain builds and tests with, skipping those already
# present. Runs as root or through sudo. The CUDA stack (nvcc, cuBLASLt, cuDNN, NCCL) is not a Debian
# package: CMake finds it when it is there (see cmake/LongtrainCuda.cmake) and builds CPU-only otherwise.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config git
  libyaml-cpp-dev libspdlog-dev libfmt-dev libsentencepiece-dev libopenblas-dev
  nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libgloo-dev zlib1g-dev libpcre2-dev libicu-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
