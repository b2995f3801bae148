// Host-side helpers of our Hopper attention kernels: the TMA tensor maps over bf16 [tokens, heads,
// dim] views, the sm_90 device check, the TMA alignment checks of an input view and the launch
// order's section size, shared by the
// forward (hopper_attention.cu) and the backward (hopper_attention_bwd.cu).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the encode function comes from the driver at run time

#include <string>

#include "attention/cuda/hopper_attention.h"

namespace longtrain::attn::hopper::host {

// A TMA map over the bf16 [tokens, heads, dim] view: dims (dim, heads, tokens) innermost first, byte
// strides of heads and tokens, box (64 of dim, 1 head, `rows` tokens), 128-byte swizzle, zero fill of
// rows past the end. Throws naming `name` where the driver rejects the view.
CUtensorMap tile_map(const View& v, int rows, const char* name);

// Whether the current device is sm_90 (H100/H200), the only one the sm_90a code runs on.
bool sm90_device();

// Empty when TMA can read the view: a base address and token/head strides that are multiples of 16
// bytes, positive strides; else why not, naming `name`.
std::string check_tma_input(const View& v, const char* name);

// The kv heads per launch-order section (hopper_attention.h, "The launch order"): the environment
// variable `env` when set (a positive integer; anything else throws naming it), else `fallback`;
// clamped to [1, kv_heads].
int section_from_env(const char* env, int64_t fallback, int64_t kv_heads);

}  // namespace longtrain::attn::hopper::host
