// Token embedding on CUDA. Forward gathers rows; backward adds d_out rows into d_table
// deterministically: positions are grouped by token id on the host (in token order), and one block
// per distinct id sums its rows in fp32 in that fixed order, then adds once into d_table.
#include <vector>

#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

template <class T>
__global__ void embedding_forward_kernel(T* out, int64_t out_rs, const int32_t* tokens, int64_t tok_stride,
                                         const T* table, int64_t table_rs, int64_t C) {
  const int64_t t = blockIdx.x;
  const int64_t id = tokens[t * tok_stride];  // validated before the launch
  const T* src = table + id * table_rs;
  T* dst = out + t * out_rs;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dst[c] = src[c];
}

// One block per distinct token id u: d_table[ids[u], :] += Σ_{p in positions[offsets[u]:offsets[u+1]]} d_out[p, :]
template <class G, class T>
__global__ void embedding_backward_kernel(G* d_table, int64_t dt_rs, const T* d_out, int64_t do_rs,
                                          const int32_t* plan, int64_t n_unique, int64_t C) {
  const int32_t* ids = plan;
  const int32_t* offsets = plan + n_unique;
  const int32_t* positions = plan + 2 * n_unique + 1;
  const int64_t u = blockIdx.x;
  const int32_t begin = offsets[u], end = offsets[u + 1];
  G* row = d_table + static_cast<int64_t>(ids[u]) * dt_rs;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0.0f;
    for (int32_t i = begin; i < end; ++i) acc += to_float(d_out[static_cast<int64_t>(positions[i]) * do_rs + c]);
    row[c] = from_float<G>(to_float(row[c]) + acc);
  }
}

int block_size_for(int64_t C) { return C >= 256 ? 256 : (C >= 128 ? 128 : 64); }

}  // namespace

// out [T, C] = table[tokens] ; tokens [T] i32, table [V, C]
void embedding_forward(Tensor out, Tensor tokens, Tensor table, bool ids_checked) {
  const char* op = "embedding_forward";
  check_tensor(out, 2, op, "out");
  check_tensor(table, 2, op, "table");
  LT_CHECK(tokens.device == Device::cuda && tokens.ndim == 1, "{}: tokens must be a 1-d CUDA tensor, got {}", op,
           tokens.describe());
  check_dtype(tokens, DType::i32, op, "tokens");
  check_float(table, op, "table");
  LT_CHECK(out.dtype == table.dtype, "{}: out {} and table {} must have the same dtype", op, out.describe(),
           table.describe());
  const int64_t T = tokens.size(0), C = table.size(1), V = table.size(0);
  LT_CHECK(out.size(0) == T && out.size(1) == C, "{}: out {} must be [{}, {}] (tokens × table columns)", op,
           out.describe(), T, C);
  if (T == 0) return;

  // The device check ends in a host read (a sync per call); a batch checked when it was made skips it.
  int bad = kNoBadIndex;
  if (!ids_checked) {
    int* flag = reset_bad_index_flag();
    find_bad_index(static_cast<const int32_t*>(tokens.data), tokens.stride[0], T, V, INT32_MIN, flag);
    bad = read_bad_index_flag();
  }
  if (bad != kNoBadIndex) {
    int32_t id = read_device_int(static_cast<const int32_t*>(tokens.data) + bad * tokens.stride[0]);
    LT_FAIL("{}: token id {} at position {} is outside the vocabulary [0, {}); check the tokenizer and "
            "model.vocab_size",
            op, id, bad, V);
  }

  dispatch_float(table.dtype, op, [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    embedding_forward_kernel<T_><<<static_cast<unsigned>(T), block_size_for(C), 0, cuda_stream()>>>(
        static_cast<T_*>(out.data), out.stride[0], static_cast<const int32_t*>(tokens.data), tokens.stride[0],
        static_cast<const T_*>(table.data), table.stride[0], C);
  });
  LT_CUDA_LAUNCH_CHECK("embedding_forward_kernel");
}

// d_table [V, C] += scatter(d_out [T, C]) by tokens [T]
void embedding_backward(Tensor d_table, Tensor tokens, Tensor d_out) {
  const char* op = "embedding_backward";
  check_tensor(d_table, 2, op, "d_table");
  check_tensor(d_out, 2, op, "d_out");
  LT_CHECK(tokens.device == Device::cuda && tokens.ndim == 1, "{}: tokens must be a 1-d CUDA tensor, got {}", op,
           tokens.describe());
  check_dtype(tokens, DType::i32, op, "tokens");
  check_float(d_table, op, "d_table");
  check_float(d_out, op, "d_out");
  const int64_t T = tokens.size(0), C = d_table.size(1), V = d_table.size(0);
  LT_CHECK(d_out.size(0) == T && d_out.size(1) == C, "{}: d_out {} must be [{}, {}]", op, d_out.describe(), T, C);
  if (T == 0) return;

  // Group positions by token id on the host (a counting sort keeps token order within an id).
  std::vector<int32_t> ids_host(static_cast<size_t>(T));
  LT_CUDA_CHECK(cudaMemcpy2DAsync(ids_host.data(), sizeof(int32_t), tokens.data, tokens.stride[0] * sizeof(int32_t),
                                  sizeof(int32_t), static_cast<size_t>(T), cudaMemcpyDeviceToHost, cuda_stream()));
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  std::vector<int32_t> count(static_cast<size_t>(V) + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    int32_t id = ids_host[t];
    LT_CHECK(id >= 0 && id < V, "{}: token id {} at position {} is outside the vocabulary [0, {})", op, id, t, V);
    ++count[id];
  }
  // plan = [ids (U) | offsets (U + 1) | positions (T)]
  std::vector<int32_t> unique_ids, offsets{0};
  std::vector<int32_t> start(static_cast<size_t>(V), -1);
  for (int64_t v = 0; v < V; ++v) {
    if (count[v] == 0) continue;
    start[v] = offsets.back();
    unique_ids.push_back(static_cast<int32_t>(v));
    offsets.push_back(offsets.back() + count[v]);
  }
  const int64_t U = static_cast<int64_t>(unique_ids.size());
  std::vector<int32_t> plan(static_cast<size_t>(2 * U + 1 + T));
  std::copy(unique_ids.begin(), unique_ids.end(), plan.begin());
  std::copy(offsets.begin(), offsets.end(), plan.begin() + U);
  int32_t* positions = plan.data() + 2 * U + 1;
  for (int64_t t = 0; t < T; ++t) positions[start[ids_host[t]]++] = static_cast<int32_t>(t);

  void* plan_dev = scratch(Scratch::index_plan, plan.size() * sizeof(int32_t));
  // Pageable source: the call returns once the data is staged, so `plan` may be freed afterwards.
  LT_CUDA_CHECK(cudaMemcpyAsync(plan_dev, plan.data(), plan.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                cuda_stream()));
  dispatch_float(d_table.dtype, op, [&](auto gtag) {
    using G = typename decltype(gtag)::type;
    dispatch_float(d_out.dtype, op, [&](auto ttag) {
      using T_ = typename decltype(ttag)::type;
      embedding_backward_kernel<G, T_><<<static_cast<unsigned>(U), block_size_for(C), 0, cuda_stream()>>>(
          static_cast<G*>(d_table.data), d_table.stride[0], static_cast<const T_*>(d_out.data), d_out.stride[0],
          static_cast<const int32_t*>(plan_dev), U, C);
    });
  });
  LT_CUDA_LAUNCH_CHECK("embedding_backward_kernel");
}

}  // namespace longtrain::ops::cuda
