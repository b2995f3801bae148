// Backend entry points of local_attention.h. local_attention.cpp checks the device and calls
// attn::cpu::<op> or attn::cuda::<op>, each defined with exactly these signatures.
#pragma once

#include "attention/local_attention.h"

namespace longtrain::attn::cpu {
#include "attention/attention_signatures.inc"
}  // namespace longtrain::attn::cpu

#ifdef LONGTRAIN_HAS_CUDA
namespace longtrain::attn::cuda {
#include "attention/attention_signatures.inc"
}  // namespace longtrain::attn::cuda
#endif
