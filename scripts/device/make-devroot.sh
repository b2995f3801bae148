#!/usr/bin/env bash
# Run here (not on the GPU machine). Copies the installed Debian packages the project configures against into a relocatable sysroot
# (.device/devroot/usr/...) for the GPU machine, which has no apt, and packs it as
# .device/devroot.tar.xz (ignored by git; name .device in the device tool's carry). The packages
# are the ones scripts/install-deps.sh installs, plus their runtime libraries (all of them: a GPU machine
# whose own libsentencepiece_train.so.0 was picked up beside our libsentencepiece crashed every TrainTest).
set -euo pipefail
cd "$(dirname "$0")/../.." && mkdir -p .device && cd .device
rm -rf devroot devroot.tar.xz
pk="libfmt-dev libfmt9 libspdlog-dev libspdlog1.10 libyaml-cpp-dev libyaml-cpp0.7 nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libgloo-dev libgloo0 libhiredis-dev libhiredis0.14 libibverbs-dev libibverbs1 libsentencepiece-dev libsentencepiece0 libopenblas-dev libopenblas0 libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0 zlib1g-dev zlib1g pkgconf pkgconf-bin libpkgconf3 libnl-3-200 libnl-route-3-200 libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libicu-dev libicu72"
for p in $pk; do
  dpkg -L "$p" | while read -r f; do
    [ -d "$f" ] && [ ! -L "$f" ] && continue
    case "$f" in /usr/share/doc/*|/usr/share/man/*|/usr/share/lintian/*|*openblas*.a|*/libblas.a|*/liblapack.a|*/libicu*.a|*/liblapack.so*) continue;; esac
    mkdir -p "devroot$(dirname "$f")"
    if [ -L "$f" ] && [[ "$(readlink "$f")" != /* ]]; then cp -P "$f" "devroot$f"; else cp -L "$f" "devroot$f"; fi
  done
done
# Debian's alternatives (made by postinst scripts, absent from dpkg -L): point them at openblas-pthread.
a=devroot/usr/lib/x86_64-linux-gnu
ln -sf openblas-pthread/libopenblas.so.0 $a/libopenblas.so.0
ln -sf openblas-pthread/libopenblas.so.0 $a/libopenblas.so
ln -sf openblas-pthread/libblas.so.3 $a/libblas.so.3
ln -sf openblas-pthread/libblas.so.3 $a/libblas.so
mkdir -p devroot/usr/include/x86_64-linux-gnu
cp -L /usr/include/x86_64-linux-gnu/openblas-pthread/{cblas.h,openblas_config.h} devroot/usr/include/x86_64-linux-gnu/
cp -L /usr/include/x86_64-linux-gnu/cblas.h devroot/usr/include/x86_64-linux-gnu/cblas.h
# Gloo's per-configuration targets file names /usr/lib absolutely; make it relative to the package.
sed -i 's|"/usr/lib/libgloo|"${_IMPORT_PREFIX}/lib/libgloo|g' devroot/usr/share/cmake/Gloo/GlooTargets-relwithdebinfo.cmake
du -sh devroot
tar -cJf devroot.tar.xz devroot
ls -la devroot.tar.xz
