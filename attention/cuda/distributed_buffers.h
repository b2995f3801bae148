// CUDA side of the distributed attention's elementwise buffer operations (attention/distributed/
// buffers.h: packing Q/K/V out of the fused QKV buffer into send buffers, zeroing and adding the f32
// accumulators, writing the final O). buffers.cpp calls these for CUDA tensors; the arguments were
// checked there (same shape, 1..4 dims, unit-stride last dim). Dtypes bf16 and f32, any pairing;
// arithmetic in f32, one rounding to the destination's dtype. Everything is queued on cuda_stream()
// and returns at once.
#pragma once

#include "runtime/tensor.h"

namespace longtrain::attn::dist::cuda {

void fill_tensor(Tensor t, double value);  // t := value
void copy_tensor(Tensor dst, Tensor src);  // dst := src
void add_tensor(Tensor dst, Tensor src);   // dst += src

}  // namespace longtrain::attn::dist::cuda
