// Token embedding on CUDA. Forward gathers rows; backward adds d_out rows into d_table
// deterministically and without a host read: a stable radix sort on the device groups positions by
// token id (in token order within an id), and one block per run of an id sums its rows in fp32 in that
// fixed order, then adds once into d_table.
#include <cub/device/device_radix_sort.cuh>

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

// keys[t] = tokens[t], positions[t] = t: the radix sort's input (tokens may be strided).
__global__ void sort_input_kernel(int32_t* keys, int32_t* positions, const int32_t* tokens, int64_t tok_stride,
                                  int64_t T) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t >= T) return;
  keys[t] = tokens[t * tok_stride];
  positions[t] = static_cast<int32_t>(t);
}

// Block b starts a run when ids[b] differs from ids[b - 1]; it then adds
// Σ_{i in the run} d_out[positions[i], :] into d_table[ids[b], :]. Other blocks return at once.
// ids were checked against the vocabulary when the batch was made or by embedding_forward (the same
// tokens); an id outside [0, V) is skipped rather than written out of bounds.
template <class G, class T>
__global__ void embedding_backward_kernel(G* d_table, int64_t dt_rs, int64_t V, const T* d_out, int64_t do_rs,
                                          const int32_t* ids, const int32_t* positions, int64_t n, int64_t C) {
  const int64_t b = blockIdx.x;
  const int32_t id = ids[b];
  if ((b > 0 && ids[b - 1] == id) || id < 0 || id >= V) return;
  int64_t end = b + 1;
  while (end < n && ids[end] == id) ++end;
  G* row = d_table + static_cast<int64_t>(id) * dt_rs;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0.0f;
    for (int64_t i = b; i < end; ++i) acc += to_float(d_out[static_cast<int64_t>(positions[i]) * do_rs + c]);
    row[c] = from_float<G>(to_float(row[c]) + acc);
  }
}

// Bits that hold every id below V (the radix sort looks at no others).
int id_bits(int64_t V) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) < V) ++bits;
  return bits;
}

// Scratch: [keys in | positions in | keys sorted | positions sorted | the sort's temporary storage],
// the same size for the same T every step (no allocation once the first step has run).
size_t sort_array_bytes(int64_t T) { return (static_cast<size_t>(T) * sizeof(int32_t) + 255) / 256 * 256; }
size_t sort_temp_bytes(int64_t T, int64_t V) {
  size_t bytes = 0;
  LT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), static_cast<int>(T), 0, id_bits(V)));
  return bytes;
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

  LT_CHECK(T <= INT32_MAX, "{}: {} tokens in one call; at most {}", op, T, INT32_MAX);
  const int n = static_cast<int>(T);
  size_t temp_bytes = sort_temp_bytes(T, V);
  const size_t array_bytes = sort_array_bytes(T);
  char* base = static_cast<char*>(scratch(Scratch::index_plan, 4 * array_bytes + temp_bytes));
  int32_t* keys_in = reinterpret_cast<int32_t*>(base);
  int32_t* pos_in = reinterpret_cast<int32_t*>(base + array_bytes);
  int32_t* keys = reinterpret_cast<int32_t*>(base + 2 * array_bytes);
  int32_t* positions = reinterpret_cast<int32_t*>(base + 3 * array_bytes);
  sort_input_kernel<<<blocks_for(T, 256), 256, 0, cuda_stream()>>>(
      keys_in, pos_in, static_cast<const int32_t*>(tokens.data), tokens.stride[0], T);
  LT_CUDA_LAUNCH_CHECK("sort_input_kernel");
  // LSD radix sort: stable, so positions stay in token order within an id.
  LT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + 4 * array_bytes, temp_bytes, keys_in, keys, pos_in, positions,
                                                n, 0, id_bits(V), cuda_stream()));
  dispatch_float(d_table.dtype, op, [&](auto gtag) {
    using G = typename decltype(gtag)::type;
    dispatch_float(d_out.dtype, op, [&](auto ttag) {
      using T_ = typename decltype(ttag)::type;
      embedding_backward_kernel<G, T_><<<static_cast<unsigned>(T), block_size_for(C), 0, cuda_stream()>>>(
          static_cast<G*>(d_table.data), d_table.stride[0], V, static_cast<const T_*>(d_out.data), d_out.stride[0],
          keys, positions, T, C);
    });
  });
  LT_CUDA_LAUNCH_CHECK("embedding_backward_kernel");
}

size_t embedding_backward_scratch_bytes(int64_t tokens, int64_t vocab) {
  if (tokens == 0) return 0;
  size_t temp = 0;
  const cudaError_t e = cub::DeviceRadixSort::SortPairs(
      nullptr, temp, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(tokens), 0, id_bits(vocab));
  if (e != cudaSuccess) {  // no GPU here (a plan made on a CPU machine): the bound ops.cpp documents
    (void)cudaGetLastError();
    temp = 2 * sort_array_bytes(tokens) + (size_t{1} << 20);
  }
  return 4 * sort_array_bytes(tokens) + temp;
}

}  // namespace longtrain::ops::cuda
