# Sourced on the GPU machine, in the repository root: that machine has the CUDA toolkit, and cuDNN,
# NCCL (and maybe cuBLAS) as Python wheels, but none of our Debian packages and no apt. This unpacks
# the sysroot that scripts/device/make-devroot.sh packed here (.device/devroot.tar.xz, carried), and
# sets:
#   LT_CMAKE_ARGS    arguments for `cmake -S . -B BUILD` (CUDA on, the sysroot, the wheels)
#   LD_LIBRARY_PATH  the sysroot's and the wheels' libraries, for running what was built
# Usage: source scripts/device/env.sh && cmake -S . -B build-dev -G Ninja $LT_CMAKE_ARGS && ...
lt_root=$PWD
lt_dev=$lt_root/.device
[ -d "$lt_dev/devroot" ] || tar -xJf "$lt_dev/devroot.tar.xz" -C "$lt_dev"
lt_sys=$lt_dev/devroot
export PATH=/usr/local/cuda/bin:$PATH
lt_cudnn=$(python3 -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0])')
lt_nccl=$(python3 -c 'import nvidia.nccl; print(nvidia.nccl.__path__[0])')
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$lt_sys/usr/lib/x86_64-linux-gnu" "$lt_sys/usr/bin/pkgconf" \
  > "$lt_dev/pkgconf"
chmod +x "$lt_dev/pkgconf"
export PKG_CONFIG_SYSROOT_DIR=$lt_sys
export PKG_CONFIG_LIBDIR=$lt_sys/usr/lib/x86_64-linux-gnu/pkgconfig:$lt_sys/usr/share/pkgconfig
LT_CMAKE_ARGS="-DLONGTRAIN_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$lt_sys/usr \
 -DPKG_CONFIG_EXECUTABLE=$lt_dev/pkgconf -DCMAKE_CUDA_ARCHITECTURES=90 -DCUDNN_ROOT=$lt_cudnn -DNCCL_ROOT=$lt_nccl"
lt_extra_lib=""
# cuBLASLt: the toolkit's, else the wheel's.
if ! ls /usr/local/cuda/lib64/libcublasLt.so* /usr/local/cuda/targets/x86_64-linux/lib/libcublasLt.so* >/dev/null 2>&1; then
  lt_cublas=$(python3 -c 'import nvidia.cublas; print(nvidia.cublas.__path__[0])')
  LT_CMAKE_ARGS="$LT_CMAKE_ARGS -DCUDA_cublasLt_LIBRARY=$(ls "$lt_cublas"/lib/libcublasLt.so.* | head -n1) \
 -DCMAKE_CXX_FLAGS=-I$lt_cublas/include -DCMAKE_CUDA_FLAGS=-I$lt_cublas/include"
  lt_extra_lib=:$lt_cublas/lib
fi
export LT_CMAKE_ARGS
export LD_LIBRARY_PATH=$lt_cudnn/lib:$lt_nccl/lib:$lt_sys/usr/lib/x86_64-linux-gnu:$lt_sys/usr/lib$lt_extra_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Multi-GPU runs: longtrain never turns NVLink multicast on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
