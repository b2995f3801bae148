// cuDNN SDPA forward and backward as backend-API operation graphs, built once per shape and cached.
// The graphs are the ones cudnn-frontend emits for cuDNN 9.x (composite MATMUL / POINTWISE /
// REDUCTION / RESHAPE operations, docs/cudnn-sdpa.md §3), which the runtime-fusion engines match to
// the Hopper flash kernels. The dedicated SDPA_FWD/SDPA_BWD descriptors cannot express a causal mask
// before 9.21 and their backward graph does not finalize on 9.19, so they are not used.
#include "attention/cuda/cudnn_sdpa.h"

#include <cudnn.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_host.h"

namespace longtrain::attn::cudnn_sdpa {

using cuda_util::Scratch;
using cuda_util::scratch;

namespace {

[[noreturn]] void cudnn_fail(const char* what, cudnnStatus_t st) {
  char detail[1024] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  LT_FAIL("cuDNN: {} failed: {} ({}){}{}. Set CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr for cuDNN's reasons", what,
          cudnnGetErrorString(st), static_cast<int>(st), detail[0] ? ": " : "", detail);
}

#define LT_CUDNN_CHECK(expr)                              \
  do {                                                    \
    cudnnStatus_t st_ = (expr);                           \
    if (st_ != CUDNN_STATUS_SUCCESS) cudnn_fail(#expr, st_); \
  } while (0)

// A backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) { LT_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d_)); }
  ~Desc() {
    if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  cudnnBackendDescriptor_t get() const { return d_; }
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const void* values) {
    cudnnStatus_t st = cudnnBackendSetAttribute(d_, name, type, count, values);
    if (st != CUDNN_STATUS_SUCCESS) cudnn_fail(fmt::format("setting attribute {}", static_cast<int>(name)).c_str(), st);
  }
  void set_desc(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t d) {
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d);
  }
  void finalize(const char* what) {
    cudnnStatus_t st = cudnnBackendFinalize(d_);
    if (st != CUDNN_STATUS_SUCCESS) cudnn_fail(what, st);
  }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// Unique ids of the tensors a caller binds (the variant pack); virtual tensors count up from 1000.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNegInf, kDO, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum, kOne,
  // segmented calls: per-segment lengths and one ragged-offset tensor per strided operand
  kSeqQ, kSeqKV, kRagQ, kRagK, kRagV, kRagO, kRagStats, kRagDO, kRagDQ, kRagDK, kRagDV,
};

// One finalized execution plan with every descriptor it was built from.
struct Plan {
  std::vector<std::shared_ptr<Desc>> keep;
  std::shared_ptr<Desc> plan;
  int64_t workspace = 0;
};

cudnnHandle_t handle() {
  static cudnnHandle_t h = [] {
    cudnnHandle_t x = nullptr;
    LT_CUDNN_CHECK(cudnnCreate(&x));
    return x;
  }();
  LT_CUDNN_CHECK(cudnnSetStream(h, cuda_stream()));
  return h;
}

// Builds one operation graph, then asks the heuristics for engine configurations and keeps the first
// that finalizes into an execution plan.
class GraphBuilder {
 public:
  // `ragged`: the ragged-offset tensor of a segmented operand (its rows start at per-segment element
  // offsets instead of at multiples of the batch stride).
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, Dims dims, Dims strides, bool is_virtual,
                                  bool by_value = false, cudnnBackendDescriptor_t ragged = nullptr) {
    auto t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    int64_t alignment = 16;
    bool virt = is_virtual;
    t->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    t->set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    t->set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    t->set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    t->set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    t->set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt);
    if (by_value) {
      bool bv = true;
      t->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &bv);
    }
    if (ragged != nullptr) t->set_desc(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, ragged);
    t->finalize("tensor descriptor");
    return t->get();
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t type, Dims dims, Dims strides, cudnnBackendDescriptor_t ragged = nullptr) {
    return tensor(next_virtual_++, type, dims, strides, true, false, ragged);
  }
  // An int32 [n, 1, 1, 1] device tensor: segment lengths (n = segments) or ragged offsets (n = segments + 1).
  cudnnBackendDescriptor_t ints(int64_t uid, int64_t n) {
    return tensor(uid, CUDNN_DATA_INT32, {n, 1, 1, 1}, {1, 1, 1, 1}, false);
  }
  // An fp32 scalar passed by value at execution (a host pointer in the variant pack).
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  // y = mode(x[, b[, t]]); math precision FLOAT unless given; axis only for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t math = CUDNN_DATA_FLOAT,
                 int64_t axis = -1) {
    auto pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    pw->set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
    if (axis >= 0) pw->set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    pw->finalize("pointwise descriptor");
    auto op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw->get());
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b != nullptr) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t != nullptr) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    float one = 1.0f;
    op->set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    op->set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    op->finalize("pointwise operation");
    ops_.push_back(op->get());
  }
  void unary(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    pointwise(mode, x, nullptr, nullptr, y);
  }
  void binary(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
              cudnnBackendDescriptor_t y) {
    pointwise(mode, x, b, nullptr, y);
  }

  // c = a · b (batched over dims 0-1, broadcast where b has fewer heads: GQA). The overrides (segmented
  // calls) are per-batch extents of M, N and K read from device tensors.
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
              cudnnBackendDescriptor_t m_override = nullptr, cudnnBackendDescriptor_t n_override = nullptr,
              cudnnBackendDescriptor_t k_override = nullptr) {
    auto mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    mm->set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    mm->finalize("matmul descriptor");
    auto op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm->get());
    if (m_override != nullptr) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_override);
    if (n_override != nullptr) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_override);
    if (k_override != nullptr) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_override);
    op->finalize("matmul operation");
    ops_.push_back(op->get());
  }

  // y = reduce(x) over the dimensions where y has extent 1 (or fewer heads: the GQA group sum)
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    auto red = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    red->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    red->set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    red->finalize("reduction descriptor");
    auto op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, red->get());
    op->finalize("reduction operation");
    ops_.push_back(op->get());
  }

  // y = x viewed with y's dims and strides (used as a transpose)
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    auto op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    op->finalize("reshape operation");
    ops_.push_back(op->get());
  }

  // The causal block of the frontend: keep = (row >= column), s_out = keep ? s_in : -inf.
  cudnnBackendDescriptor_t causal_mask(cudnnBackendDescriptor_t s_in, Dims dims, Dims strides,
                                       cudnnBackendDescriptor_t neg_inf) {
    auto row = virt(CUDNN_DATA_INT32, dims, strides);
    auto col = virt(CUDNN_DATA_INT32, dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s_in, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s_in, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
    auto keep = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
    auto s_out = virt(CUDNN_DATA_FLOAT, dims, strides);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s_in, neg_inf, keep, s_out);
    return s_out;
  }

  // The frontend's padding mask: keep = (row < seq_q[b]) and (column < seq_kv[b]).
  cudnnBackendDescriptor_t padding_mask(cudnnBackendDescriptor_t s_in, Dims dims, Dims strides,
                                        cudnnBackendDescriptor_t seq_q, cudnnBackendDescriptor_t seq_kv,
                                        cudnnBackendDescriptor_t neg_inf) {
    auto row = virt(CUDNN_DATA_INT32, dims, strides);
    auto col = virt(CUDNN_DATA_INT32, dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s_in, nullptr, nullptr, row, CUDNN_DATA_INT32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s_in, nullptr, nullptr, col, CUDNN_DATA_INT32, 3);
    auto row_ok = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    auto col_ok = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    pointwise(CUDNN_POINTWISE_CMP_LT, row, seq_q, nullptr, row_ok, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_CMP_LT, col, seq_kv, nullptr, col_ok, CUDNN_DATA_BOOLEAN);
    auto keep = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    pointwise(CUDNN_POINTWISE_LOGICAL_AND, row_ok, col_ok, nullptr, keep, CUDNN_DATA_BOOLEAN);
    auto s_out = virt(CUDNN_DATA_FLOAT, dims, strides);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s_in, neg_inf, keep, s_out);
    return s_out;
  }

  std::unique_ptr<Plan> build(const char* what) {
    cudnnHandle_t h = handle();
    auto graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()),
               ops_.data());
    graph->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
    graph->finalize("operation graph");

    std::string tried;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      auto heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      heur->set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph->get());
      heur->set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      if (cudnnBackendFinalize(heur->get()) != CUDNN_STATUS_SUCCESS) continue;
      int64_t count = 0;
      LT_CUDNN_CHECK(cudnnBackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                              CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
      std::vector<std::shared_ptr<Desc>> cfgs;
      std::vector<cudnnBackendDescriptor_t> raw;
      for (int64_t i = 0; i < count; ++i) {
        cfgs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
        raw.push_back(cfgs.back()->get());
      }
      int64_t got = 0;
      if (count > 0)
        LT_CUDNN_CHECK(cudnnBackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()));
      for (int64_t i = 0; i < got; ++i) {
        auto plan = std::make_shared<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
        plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[i]);
        cudnnStatus_t st = cudnnBackendFinalize(plan->get());
        if (st != CUDNN_STATUS_SUCCESS) {
          tried += fmt::format(" [mode {} config {}: {}]", static_cast<int>(mode), i, cudnnGetErrorString(st));
          continue;
        }
        auto result = std::make_unique<Plan>();
        LT_CUDNN_CHECK(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                CUDNN_TYPE_INT64, 1, &got, &result->workspace));
        log_once(what, raw[i], plan->get(), mode, i, count, result->workspace);
        result->keep = std::move(keep_);
        result->keep.push_back(graph);
        result->keep.insert(result->keep.end(), cfgs.begin(), cfgs.end());
        result->plan = plan;
        return result;
      }
    }
    LT_FAIL("cuDNN {}: no engine configuration finalized for this attention shape{}. cuDNN {} is loaded; the "
            "graph needs cuDNN >= 9 on sm_90 or newer. Set CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr for "
            "cuDNN's reasons",
            what, tried, cudnnGetVersion());
  }

 private:
  std::shared_ptr<Desc> make(cudnnBackendDescriptorType_t type) {
    keep_.push_back(std::make_shared<Desc>(type));
    return keep_.back();
  }

  // The engine behind a plan, logged once per graph kind and distinct engine configuration per
  // process: cuDNN's global engine index and the plan's knob choices. Keyed by the configuration,
  // not the kind alone, because two graphs of one kind (token-major against head-major LSE
  // strides) may get different kernel configurations, and only a line each shows it. Measured on
  // cuDNN 9.19 / H200: forward engine 2, backward engine 6 (docs/cudnn-sdpa.md).
  static void log_once(const char* what, cudnnBackendDescriptor_t cfg, cudnnBackendDescriptor_t plan,
                       cudnnBackendHeurMode_t mode, int64_t index, int64_t count, int64_t workspace) {
    static std::mutex m;
    static std::set<std::string> logged;
    std::lock_guard<std::mutex> lock(m);
    int64_t engine_index = -1, n = 0;
    cudnnBackendDescriptor_t engine = nullptr;
    if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine) == CUDNN_STATUS_SUCCESS) {
      if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine) ==
          CUDNN_STATUS_SUCCESS)
        cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &engine_index);
      cudnnBackendDestroyDescriptor(engine);
    }
    std::string json;
    int64_t size = 0;
    if (cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR, 0, &size,
                                 nullptr) == CUDNN_STATUS_SUCCESS &&
        size > 0) {
      json.assign(static_cast<size_t>(size) + 1, '\0');
      if (cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                                   static_cast<int64_t>(json.size()), &size, json.data()) != CUDNN_STATUS_SUCCESS)
        json.clear();
      json.resize(std::strlen(json.c_str()));
      // The JSON holds the whole graph and the kernels' binaries (base64): keep the engine's knob
      // choices, which say which kernel configuration runs.
      const size_t knobs = json.find("\"knobChoices\"");
      if (knobs != std::string::npos) {
        const size_t end = json.find('}', knobs);
        json = json.substr(knobs, end == std::string::npos ? 200 : end - knobs + 1);
      } else if (json.size() > 300) {
        json = json.substr(0, 300) + "...";
      }
    }
    // Not the workspace: it follows the shape.
    if (!logged.insert(fmt::format("{} {} {}", what, engine_index, json)).second) return;
    std::fprintf(stderr, "longtrain: cuDNN %zu %s: engine %lld (heuristics mode %s, configuration %lld of %lld), "
                 "workspace %lld bytes, plan %s\n",
                 cudnnGetVersion(), what, static_cast<long long>(engine_index),
                 mode == CUDNN_HEUR_MODE_A ? "A" : "fallback", static_cast<long long>(index),
                 static_cast<long long>(count), static_cast<long long>(workspace), json.c_str());
  }

  std::vector<std::shared_ptr<Desc>> keep_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = 1000;
};

// A graph's batch and sequence extents: one problem of the views' own lengths, or (segmented calls)
// `b` segments padded to `sq` query and `skv` key rows, every operand ragged.
struct Extents {
  int64_t b = 1, sq = 0, skv = 0;
  bool ragged = false;
};
Extents whole(const View& q, const View& k) { return {1, q.tokens, k.tokens, false}; }

// [tokens, heads, dim] as cuDNN's (b, heads, s, dim), and its transposed (b, heads, dim, s) view.
Dims dims_of(const View& t, int64_t b, int64_t s) { return {b, t.heads, s, t.dim}; }
Dims strides_of(const View& t, int64_t s) { return {s * t.token_stride, t.head_stride, t.token_stride, 1}; }
Dims dims_t(const View& t, int64_t b, int64_t s) { return {b, t.heads, t.dim, s}; }
Dims strides_t(const View& t, int64_t s) { return {s * t.token_stride, t.head_stride, 1, t.token_stride}; }
Dims stats_dims(const StatsView& t, int64_t b, int64_t s) { return {b, t.heads, s, 1}; }
Dims stats_strides(const StatsView& t, int64_t s) { return {s * t.token_stride, t.head_stride, t.token_stride, 1}; }

// The per-segment tensors of a segmented graph (all null for a whole-block graph).
struct RaggedDescs {
  cudnnBackendDescriptor_t seq_q = nullptr, seq_kv = nullptr;
  cudnnBackendDescriptor_t q = nullptr, k = nullptr, v = nullptr, o = nullptr, stats = nullptr, d_o = nullptr,
                           dq = nullptr, dk = nullptr, dv = nullptr;
};

RaggedDescs ragged_descs(GraphBuilder& g, const Extents& e, bool backward) {
  RaggedDescs r;
  if (!e.ragged) return r;
  r.seq_q = g.ints(kSeqQ, e.b);
  r.seq_kv = g.ints(kSeqKV, e.b);
  r.q = g.ints(kRagQ, e.b + 1);
  r.k = g.ints(kRagK, e.b + 1);
  r.v = g.ints(kRagV, e.b + 1);
  r.o = g.ints(kRagO, e.b + 1);
  r.stats = g.ints(kRagStats, e.b + 1);
  if (backward) {
    r.d_o = g.ints(kRagDO, e.b + 1);
    r.dq = g.ints(kRagDQ, e.b + 1);
    r.dk = g.ints(kRagDK, e.b + 1);
    r.dv = g.ints(kRagDV, e.b + 1);
  }
  return r;
}

std::unique_ptr<Plan> build_forward(const View& o, const StatsView& lse, const View& q, const View& k, const View& v,
                                    bool causal, const Extents& e) {
  GraphBuilder g;
  const int64_t b = e.b, hq = q.heads, sq = e.sq, skv = e.skv;
  const Dims s_dims{b, hq, sq, skv}, s_strides{hq * sq * skv, sq * skv, skv, 1};
  const Dims row_dims{b, hq, sq, 1}, row_strides{hq * sq, sq, 1, 1};
  const RaggedDescs r = ragged_descs(g, e, false);

  auto Q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, dims_of(q, b, sq), strides_of(q, sq), false, false, r.q);
  auto Kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, dims_t(k, b, skv), strides_t(k, skv), false, false, r.k);
  auto V = g.tensor(kV, CUDNN_DATA_BFLOAT16, dims_of(v, b, skv), strides_of(v, skv), false, false, r.v);
  auto O = g.tensor(kO, CUDNN_DATA_BFLOAT16, dims_of(o, b, sq), strides_of(o, sq), false, false, r.o);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, stats_dims(lse, b, sq), stats_strides(lse, sq), false, false, r.stats);
  auto scale = g.scalar(kScale);
  auto neg_inf = (causal || e.ragged) ? g.scalar(kNegInf) : nullptr;

  auto S = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.matmul(Q, Kt, S, r.seq_q, r.seq_kv);  // S = Q·Kᵀ
  auto S2 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.binary(CUDNN_POINTWISE_MUL, S, scale, S2);
  if (e.ragged) S2 = g.padding_mask(S2, s_dims, s_strides, r.seq_q, r.seq_kv, neg_inf);
  if (causal) S2 = g.causal_mask(S2, s_dims, s_strides, neg_inf);
  auto M = g.virt(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, S2, M);
  auto Z = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.binary(CUDNN_POINTWISE_SUB, S2, M, Z);
  auto E = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.unary(CUDNN_POINTWISE_EXP, Z, E);
  auto L = g.virt(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, E, L);
  auto logL = g.virt(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.unary(CUDNN_POINTWISE_LOG, L, logL);
  g.binary(CUDNN_POINTWISE_ADD, M, logL, stats);  // LSE = max + log Σ exp
  // P must have the I/O type: it is the bf16 operand of the second matmul.
  auto P = g.virt(CUDNN_DATA_BFLOAT16, s_dims, s_strides);
  g.binary(CUDNN_POINTWISE_DIV, E, L, P);
  g.matmul(P, V, O, r.seq_q, nullptr, r.seq_kv);
  return g.build(e.ragged ? "SDPA forward (segments)" : "SDPA forward");
}

// With `o` set: the frontend's graph, which forms softmax_sum = rowsum(dO ⊙ O) itself. With `delta`
// set instead: the same graph minus that subgraph, softmax_sum being the caller's delta. Segmented
// graphs (e.ragged) take o, and their softmax_sum and dQ accumulator follow the stats' and dQ's
// ragged layouts, as the frontend lays them out for THD.
std::unique_ptr<Plan> build_backward(const View& dq, const View& dk, const View& dv, const View& q, const View& k,
                                     const View& v, const View* o, const View& d_o, const StatsView& lse,
                                     const StatsView* delta, bool causal, const Extents& e) {
  GraphBuilder g;
  const int64_t b = e.b, hq = q.heads, hkv = k.heads, sq = e.sq, skv = e.skv, d = q.dim;
  const Dims s_dims{b, hq, sq, skv}, s_strides{hq * sq * skv, sq * skv, skv, 1};
  const Dims st_dims{b, hq, skv, sq}, st_strides{hq * sq * skv, sq * skv, 1, skv};  // transposed views
  const Dims row_dims{b, hq, sq, 1}, row_strides{hq * sq, sq, 1, 1};
  const RaggedDescs r = ragged_descs(g, e, true);

  auto Q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, dims_of(q, b, sq), strides_of(q, sq), false, false, r.q);
  auto Kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, dims_t(k, b, skv), strides_t(k, skv), false, false, r.k);
  auto Vt = g.tensor(kV, CUDNN_DATA_BFLOAT16, dims_t(v, b, skv), strides_t(v, skv), false, false, r.v);
  auto dO = g.tensor(kDO, CUDNN_DATA_BFLOAT16, dims_of(d_o, b, sq), strides_of(d_o, sq), false, false, r.d_o);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, stats_dims(lse, b, sq), stats_strides(lse, sq), false, false, r.stats);
  auto dQ = g.tensor(kDQ, CUDNN_DATA_BFLOAT16, dims_of(dq, b, sq), strides_of(dq, sq), false, false, r.dq);
  auto dK = g.tensor(kDK, CUDNN_DATA_BFLOAT16, dims_of(dk, b, skv), strides_of(dk, skv), false, false, r.dk);
  auto dV = g.tensor(kDV, CUDNN_DATA_BFLOAT16, dims_of(dv, b, skv), strides_of(dv, skv), false, false, r.dv);
  auto dQ_accum = e.ragged ? g.tensor(kDQAccum, CUDNN_DATA_FLOAT, dims_of(dq, b, sq), strides_of(dq, sq), false,
                                      false, r.dq)
                           : g.tensor(kDQAccum, CUDNN_DATA_FLOAT, {1, hq, sq, d}, {hq * sq * d, sq * d, d, 1}, false);
  auto scale = g.scalar(kScale);
  auto neg_inf = (causal || e.ragged) ? g.scalar(kNegInf) : nullptr;

  cudnnBackendDescriptor_t softmax_sum;
  if (o != nullptr) {
    // softmax_sum = rowsum(dO ⊙ O) · 1  (strides of the product as the frontend sets them)
    softmax_sum = e.ragged ? g.tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, stats_dims(lse, b, sq), stats_strides(lse, sq),
                                      false, false, r.stats)
                           : g.tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, row_dims, row_strides, false);
    auto O = g.tensor(kO, CUDNN_DATA_BFLOAT16, dims_of(*o, b, sq), strides_of(*o, sq), false, false, r.o);
    auto one = g.scalar(kOne);
    auto dOO = g.virt(CUDNN_DATA_FLOAT, {b, hq, sq, d}, {hq * sq * d, sq * d, hq * d, 1});
    g.binary(CUDNN_POINTWISE_MUL, dO, O, dOO);
    auto rs = g.virt(CUDNN_DATA_FLOAT, row_dims, row_strides);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dOO, rs);
    g.binary(CUDNN_POINTWISE_MUL, rs, one, softmax_sum);
  } else {
    softmax_sum = g.tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, stats_dims(*delta, b, sq), stats_strides(*delta, sq), false);
  }

  // P = exp(scale · Q·Kᵀ - LSE) [masked]
  auto S = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.matmul(Q, Kt, S, r.seq_q, r.seq_kv);
  auto S2 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.binary(CUDNN_POINTWISE_MUL, S, scale, S2);
  if (e.ragged) S2 = g.padding_mask(S2, s_dims, s_strides, r.seq_q, r.seq_kv, neg_inf);
  auto S3 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.binary(CUDNN_POINTWISE_SUB, S2, stats, S3);
  if (causal) S3 = g.causal_mask(S3, s_dims, s_strides, neg_inf);
  auto P = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.unary(CUDNN_POINTWISE_EXP, S3, P);

  // dV = Pᵀ·dO (summed over each KV head's query-head group for GQA)
  auto Pt = g.virt(CUDNN_DATA_BFLOAT16, st_dims, st_strides);
  g.reshape(P, Pt);
  if (hq == hkv) {
    g.matmul(Pt, dO, dV, r.seq_kv, nullptr, r.seq_q);
  } else {
    auto dV_full = g.virt(CUDNN_DATA_BFLOAT16, {b, hq, skv, d}, {hq * skv * d, skv * d, d, 1});
    g.matmul(Pt, dO, dV_full, r.seq_kv, nullptr, r.seq_q);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dV_full, dV);
  }

  // dS = scale · P ⊙ (dO·Vᵀ - softmax_sum)
  auto dP = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.matmul(dO, Vt, dP, r.seq_q, r.seq_kv);
  auto dP2 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.binary(CUDNN_POINTWISE_SUB, dP, softmax_sum, dP2);
  auto dP3 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.binary(CUDNN_POINTWISE_MUL, dP2, P, dP3);
  auto dS = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.binary(CUDNN_POINTWISE_MUL, dP3, scale, dS);

  // dK = dSᵀ·Q (GQA: group sum)
  auto dSt = g.virt(CUDNN_DATA_BFLOAT16, st_dims, st_strides);
  g.reshape(dS, dSt);
  if (hq == hkv) {
    g.matmul(dSt, Q, dK, r.seq_kv, nullptr, r.seq_q);
  } else {
    auto dK_full = g.virt(CUDNN_DATA_BFLOAT16, {b, hq, skv, d}, {hq * skv * d, skv * d, d, 1});
    g.matmul(dSt, Q, dK_full, r.seq_kv, nullptr, r.seq_q);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dK_full, dK);
  }

  // dQ = dS·K into the fp32 accumulator, then converted to bf16
  const Dims kt_strides = strides_t(k, skv);
  auto Kview = g.virt(CUDNN_DATA_FLOAT, {b, hkv, skv, d}, {kt_strides[0], kt_strides[1], kt_strides[3], kt_strides[2]},
                      r.k);
  g.reshape(Kt, Kview);
  g.matmul(dS, Kview, dQ_accum, r.seq_q, nullptr, r.seq_kv);
  g.unary(CUDNN_POINTWISE_IDENTITY, dQ_accum, dQ);
  if (e.ragged) return g.build("SDPA backward (segments)");
  return g.build(o != nullptr ? "SDPA backward (delta from O)" : "SDPA backward (delta as input)");
}

// Plans per shape and layout. The scale is a by-value scalar, so it needs no new plan.
std::mutex g_plans_mutex;
std::map<std::vector<int64_t>, std::unique_ptr<Plan>> g_plans;
std::set<std::vector<int64_t>> g_unsupported;  // backward shapes whose delta-input graph has no engine

void append(std::vector<int64_t>& key, const View& t) {
  key.insert(key.end(), {t.tokens, t.heads, t.dim, t.token_stride, t.head_stride});
}
void append(std::vector<int64_t>& key, const StatsView& s) {
  key.insert(key.end(), {s.tokens, s.heads, s.token_stride, s.head_stride});
}

void check_aligned(const void* p, const char* what) {
  LT_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0,
           "cuDNN attention: {} at {} is not 16-byte aligned; Q/K/V/O views must start on 16-byte boundaries "
           "(head_dim a multiple of 8 keeps fused-QKV views aligned)",
           what, p);
}

void execute(const Plan& plan, const std::vector<int64_t>& uids, std::vector<void*>& pointers) {
  void* workspace = plan.workspace > 0 ? scratch(Scratch::attn_workspace, static_cast<size_t>(plan.workspace)) : nullptr;
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(pointers.size()),
           pointers.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  pack.finalize("variant pack");
  LT_CUDNN_CHECK(cudnnBackendExecute(handle(), plan.plan->get(), pack.get()));
}

}  // namespace

void forward(View o, StatsView lse, View q, View k, View v, bool causal, float scale) {
  for (auto [p, name] : {std::pair<const void*, const char*>{q.data, "q"}, {k.data, "k"}, {v.data, "v"}, {o.data, "o"},
                         {lse.data, "lse"}})
    check_aligned(p, name);
  std::vector<int64_t> key{0, causal ? 1 : 0};
  for (const View* t : {&o, &q, &k, &v}) append(key, *t);
  append(key, lse);
  const Plan* plan;
  {
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    auto& slot = g_plans[key];
    if (!slot) slot = build_forward(o, lse, q, k, v, causal, whole(q, k));
    plan = slot.get();
  }
  // The variant pack lists exactly the graph's non-virtual tensors: -inf exists only with the mask.
  float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{q.data, k.data, v.data, o.data, lse.data, &scale};
  if (causal) {
    uids.push_back(kNegInf);
    ptrs.push_back(&neg_inf);
  }
  execute(*plan, uids, ptrs);
}

void backward(View dq, View dk, View dv, View q, View k, View v, View o, View d_o, StatsView lse, bool causal,
              float scale) {
  for (auto [p, name] : {std::pair<const void*, const char*>{q.data, "q"}, {k.data, "k"}, {v.data, "v"},
                         {o.data, "o"}, {d_o.data, "d_o"}, {lse.data, "lse"}, {dq.data, "dq"}, {dk.data, "dk"},
                         {dv.data, "dv"}})
    check_aligned(p, name);
  std::vector<int64_t> key{1, causal ? 1 : 0};
  for (const View* t : {&dq, &dk, &dv, &q, &k, &v, &d_o}) append(key, *t);
  append(key, lse);
  append(key, o);
  const Plan* plan;
  {
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    auto& slot = g_plans[key];
    if (!slot) slot = build_backward(dq, dk, dv, q, k, v, &o, d_o, lse, nullptr, causal, whole(q, k));
    plan = slot.get();
  }
  // cuDNN's fp32 dQ accumulator [Hq, Sq, D]; the engine initialises it (measured: never zeroing it
  // still gives correct repeated results). rowsum(dO ⊙ O) [Hq, Sq], written by the graph.
  void* dq_accum = scratch(Scratch::attn_dq_accum, static_cast<size_t>(q.heads * q.tokens * q.dim) * sizeof(float));
  void* softmax_sum = scratch(Scratch::attn_softmax_sum, static_cast<size_t>(q.heads * q.tokens) * sizeof(float));
  float neg_inf = -std::numeric_limits<float>::infinity(), one = 1.0f;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum, kScale, kOne};
  std::vector<void*> ptrs{q.data,  k.data,  v.data,      o.data,   d_o.data, lse.data, dq.data,
                          dk.data, dv.data, softmax_sum, dq_accum, &scale,   &one};
  if (causal) {
    uids.push_back(kNegInf);
    ptrs.push_back(&neg_inf);
  }
  execute(*plan, uids, ptrs);
}

void backward_from_delta(View dq, View dk, View dv, View q, View k, View v, View d_o, StatsView lse, StatsView delta,
                         const std::function<View()>& make_o, bool causal, float scale) {
  for (auto [p, name] : {std::pair<const void*, const char*>{q.data, "q"}, {k.data, "k"}, {v.data, "v"},
                         {d_o.data, "d_o"}, {lse.data, "lse"}, {delta.data, "delta"}, {dq.data, "dq"},
                         {dk.data, "dk"}, {dv.data, "dv"}})
    check_aligned(p, name);
  std::vector<int64_t> key{2, causal ? 1 : 0};
  for (const View* t : {&dq, &dk, &dv, &q, &k, &v, &d_o}) append(key, *t);
  append(key, lse);
  append(key, delta);
  const Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    if (g_unsupported.count(key) == 0) {
      auto& slot = g_plans[key];
      if (!slot) {
        try {
          slot = build_backward(dq, dk, dv, q, k, v, nullptr, d_o, lse, &delta, causal, whole(q, k));
        } catch (const Error& e) {  // no engine takes delta as an input: use the frontend's graph
          g_plans.erase(key);
          g_unsupported.insert(key);
          static bool logged = false;
          if (!logged) {
            logged = true;
            std::string reason = e.what();
            std::fprintf(stderr, "longtrain: cuDNN SDPA backward with delta as input is not supported here (%s); "
                         "using an O stand-in\n", reason.substr(0, 300).c_str());
          }
        }
      }
      if (g_unsupported.count(key) == 0) plan = g_plans[key].get();
    }
  }
  if (plan == nullptr) {
    backward(dq, dk, dv, q, k, v, make_o(), d_o, lse, causal, scale);
    return;
  }
  void* dq_accum = scratch(Scratch::attn_dq_accum, static_cast<size_t>(q.heads * q.tokens * q.dim) * sizeof(float));
  float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kQ, kK, kV, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum, kScale};
  std::vector<void*> ptrs{q.data, k.data, v.data, d_o.data, lse.data, dq.data, dk.data, dv.data, delta.data,
                          dq_accum, &scale};
  if (causal) {
    uids.push_back(kNegInf);
    ptrs.push_back(&neg_inf);
  }
  execute(*plan, uids, ptrs);
}

// ---- segmented calls ------------------------------------------------------------------------------

namespace {

// Graph extents are bucketed to powers of two (at least 64 rows), so windows whose documents differ
// in length share plans; the per-segment lengths mask the rest.
int64_t bucket_rows(int64_t n) {
  int64_t b = 64;
  while (b < n) b *= 2;
  return b;
}

// The int32 device tensors of one segmented call: per-segment lengths and, per strided operand, the
// element offset of each segment's first row (its start times the operand's token stride; the last
// entry is the end of the last segment). Packed into one scratch buffer, each array 16-byte aligned,
// and copied on the compute stream, so the previous call's arrays are no longer read when they are
// overwritten.
class SegmentArrays {
 public:
  explicit SegmentArrays(const std::vector<Segment>& segments) : segments_(segments) {}

  void lengths() {
    std::vector<int32_t> q, k;
    for (const Segment& s : segments_) {
      q.push_back(static_cast<int32_t>(s.q_len));
      k.push_back(static_cast<int32_t>(s.k_len));
    }
    add(kSeqQ, q);
    add(kSeqKV, k);
  }
  // Offsets of the query-side (rows = true) or key-side rows of an operand with `token_stride`.
  void offsets(int64_t uid, bool query_rows, int64_t token_stride, const char* name) {
    std::vector<int32_t> off;
    int64_t end = 0;
    for (const Segment& s : segments_) {
      const int64_t start = query_rows ? s.q_start : s.k_start, len = query_rows ? s.q_len : s.k_len;
      off.push_back(checked(start * token_stride, name));
      end = std::max(end, start + len);
    }
    off.push_back(checked(end * token_stride, name));
    add(uid, off);
  }
  // Uploads the arrays and appends their uids and device pointers to a variant pack.
  void bind(std::vector<int64_t>& uids, std::vector<void*>& ptrs) {
    auto* dev = static_cast<int32_t*>(scratch(Scratch::attn_segments, host_.size() * sizeof(int32_t)));
    LT_CUDA_CHECK(cudaMemcpyAsync(dev, host_.data(), host_.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                  cuda_stream()));
    for (size_t i = 0; i < uids_.size(); ++i) {
      uids.push_back(uids_[i]);
      ptrs.push_back(dev + at_[i]);
    }
  }

 private:
  static int32_t checked(int64_t v, const char* name) {
    LT_CHECK(v <= std::numeric_limits<int32_t>::max(),
             "cuDNN segmented attention: the {} offset {} exceeds int32 (too many tokens in one block for "
             "document-masked attention on cuda); use fewer tokens per rank (data.seq_len or more sequence-parallel "
             "ranks)",
             name, v);
    return static_cast<int32_t>(v);
  }
  void add(int64_t uid, const std::vector<int32_t>& values) {
    uids_.push_back(uid);
    at_.push_back(host_.size());
    host_.insert(host_.end(), values.begin(), values.end());
    host_.resize((host_.size() + 3) / 4 * 4, 0);  // 16-byte alignment of the next array
  }

  const std::vector<Segment>& segments_;
  std::vector<int32_t> host_;
  std::vector<int64_t> uids_;
  std::vector<size_t> at_;
};

Extents segment_extents(const std::vector<Segment>& segments) {
  LT_CHECK(!segments.empty(), "cuDNN segmented attention needs at least one segment");
  int64_t max_q = 1, max_k = 1;
  for (const Segment& s : segments) {
    max_q = std::max(max_q, s.q_len);
    max_k = std::max(max_k, s.k_len);
  }
  return {static_cast<int64_t>(segments.size()), bucket_rows(max_q), bucket_rows(max_k), true};
}

const Plan* cached_plan(const std::vector<int64_t>& key, const std::function<std::unique_ptr<Plan>()>& build) {
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  auto& slot = g_plans[key];
  if (!slot) slot = build();
  return slot.get();
}

// Row extents of the segments' last rows (sizes of the accumulators indexed through the offsets).
int64_t query_rows_end(const std::vector<Segment>& segments) {
  int64_t end = 0;
  for (const Segment& s : segments) end = std::max(end, s.q_start + s.q_len);
  return end;
}

}  // namespace

namespace {

// Segments grouped by their padded extent (bucket_rows of the longer side), one cuDNN call per group:
// a call's grid and its backward workspace scale with segments × padded rows, so one long document
// would otherwise pad every short one to its length (47 documents at 128K tokens: 6.3 GB of backward
// workspace in one call, at most 2·S rows' worth grouped).
std::vector<std::vector<Segment>> length_groups(const std::vector<Segment>& segments) {
  std::map<int64_t, std::vector<Segment>> by_rows;
  for (const Segment& s : segments) by_rows[bucket_rows(std::max(s.q_len, s.k_len))].push_back(s);
  std::vector<std::vector<Segment>> out;
  for (auto& [rows, group] : by_rows) out.push_back(std::move(group));
  return out;
}

void forward_group(View o, StatsView lse, View q, View k, View v, const std::vector<Segment>& segments, bool causal,
                   float scale);
void backward_group(View dq, View dk, View dv, View q, View k, View v, View o, View d_o, StatsView lse,
                    const std::vector<Segment>& segments, bool causal, float scale);

}  // namespace

void forward_segments(View o, StatsView lse, View q, View k, View v, const std::vector<Segment>& segments,
                      bool causal, float scale) {
  for (const auto& group : length_groups(segments)) forward_group(o, lse, q, k, v, group, causal, scale);
}

void backward_segments(View dq, View dk, View dv, View q, View k, View v, View o, View d_o, StatsView lse,
                       const std::vector<Segment>& segments, bool causal, float scale) {
  for (const auto& group : length_groups(segments))
    backward_group(dq, dk, dv, q, k, v, o, d_o, lse, group, causal, scale);
}

namespace {

void forward_group(View o, StatsView lse, View q, View k, View v, const std::vector<Segment>& segments, bool causal,
                   float scale) {
  for (auto [p, name] : {std::pair<const void*, const char*>{q.data, "q"}, {k.data, "k"}, {v.data, "v"}, {o.data, "o"},
                         {lse.data, "lse"}})
    check_aligned(p, name);
  const Extents e = segment_extents(segments);
  std::vector<int64_t> key{3, causal ? 1 : 0, e.b, e.sq, e.skv};
  for (const View* t : {&o, &q, &k, &v}) append(key, *t);
  append(key, lse);
  const Plan* plan = cached_plan(key, [&] { return build_forward(o, lse, q, k, v, causal, e); });

  SegmentArrays arrays(segments);
  arrays.lengths();
  arrays.offsets(kRagQ, true, q.token_stride, "q");
  arrays.offsets(kRagK, false, k.token_stride, "k");
  arrays.offsets(kRagV, false, v.token_stride, "v");
  arrays.offsets(kRagO, true, o.token_stride, "o");
  arrays.offsets(kRagStats, true, lse.token_stride, "lse");
  float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kNegInf};
  std::vector<void*> ptrs{q.data, k.data, v.data, o.data, lse.data, &scale, &neg_inf};
  arrays.bind(uids, ptrs);
  execute(*plan, uids, ptrs);
}

void backward_group(View dq, View dk, View dv, View q, View k, View v, View o, View d_o, StatsView lse,
                    const std::vector<Segment>& segments, bool causal, float scale) {
  for (auto [p, name] : {std::pair<const void*, const char*>{q.data, "q"}, {k.data, "k"}, {v.data, "v"},
                         {o.data, "o"}, {d_o.data, "d_o"}, {lse.data, "lse"}, {dq.data, "dq"}, {dk.data, "dk"},
                         {dv.data, "dv"}})
    check_aligned(p, name);
  const Extents e = segment_extents(segments);
  std::vector<int64_t> key{4, causal ? 1 : 0, e.b, e.sq, e.skv};
  for (const View* t : {&dq, &dk, &dv, &q, &k, &v, &d_o, &o}) append(key, *t);
  append(key, lse);
  const Plan* plan =
      cached_plan(key, [&] { return build_backward(dq, dk, dv, q, k, v, &o, d_o, lse, nullptr, causal, e); });

  // The fp32 dQ accumulator and rowsum(dO ⊙ O) are laid out as dQ and the stats are (the same ragged
  // offsets index them), so they span the rows up to the last segment's end.
  const int64_t rows = query_rows_end(segments);
  void* dq_accum = scratch(Scratch::attn_dq_accum, static_cast<size_t>(rows * dq.token_stride) * sizeof(float));
  // (any stats layout: token-major [T, Hq] or head-major [Hq, rows] storage)
  const int64_t sum_floats = (lse.heads - 1) * lse.head_stride + (rows - 1) * lse.token_stride + 1;
  void* softmax_sum = scratch(Scratch::attn_softmax_sum, static_cast<size_t>(sum_floats) * sizeof(float));
  SegmentArrays arrays(segments);
  arrays.lengths();
  arrays.offsets(kRagQ, true, q.token_stride, "q");
  arrays.offsets(kRagK, false, k.token_stride, "k");
  arrays.offsets(kRagV, false, v.token_stride, "v");
  arrays.offsets(kRagO, true, o.token_stride, "o");
  arrays.offsets(kRagStats, true, lse.token_stride, "lse");
  arrays.offsets(kRagDO, true, d_o.token_stride, "d_o");
  arrays.offsets(kRagDQ, true, dq.token_stride, "dq");
  arrays.offsets(kRagDK, false, dk.token_stride, "dk");
  arrays.offsets(kRagDV, false, dv.token_stride, "dv");
  float neg_inf = -std::numeric_limits<float>::infinity(), one = 1.0f;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum, kScale, kOne, kNegInf};
  std::vector<void*> ptrs{q.data,  k.data,  v.data,      o.data,   d_o.data, lse.data, dq.data,
                          dk.data, dv.data, softmax_sum, dq_accum, &scale,   &one,     &neg_inf};
  arrays.bind(uids, ptrs);
  execute(*plan, uids, ptrs);
}

}  // namespace

}  // namespace longtrain::attn::cudnn_sdpa
