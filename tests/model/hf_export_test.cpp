// The Hugging Face Llama directory: config.json both ways (ours, and real configs of Llama 1/2/3,
// TinyLlama), what longtrain cannot represent rejected by name, and weights exported and loaded back
// bit for bit, from one file or from a sharded index.
#include "model/hf_export.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "model/parameters.h"
#include "test_util.h"

namespace longtrain::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

class HfExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("longtrain_hf_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

using ::longtrain::test::error_of;

LlamaConfig small_config() {
  LlamaConfig c;
  c.vocab_size = 101;
  c.dim = 48;
  c.n_layers = 3;
  c.n_heads = 6;
  c.n_kv_heads = 2;
  c.head_dim = 10;  // not dim / n_heads: head_dim must be written explicitly
  c.ffn_dim = 131;
  c.rope_theta = 500000.0;
  c.norm_eps = 1e-5;
  c.max_seq_len = 65536;
  return c;
}

void expect_same_model(const LlamaConfig& a, const LlamaConfig& b) {
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.ffn_dim, b.ffn_dim);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_scaling, b.rope_scaling);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(a.max_seq_len, b.max_seq_len);
}

TEST_F(HfExportTest, ConfigRoundTripsAndHasTransformersKeys) {
  HfLlamaConfig c;
  c.model = small_config();
  c.bos_token_id = 1;
  c.eos_token_ids = {2, 7};
  c.torch_dtype = "bfloat16";
  const std::string text = hf_config_json(c);
  json j = json::parse(text);
  EXPECT_EQ(j["architectures"], json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(j["model_type"], "llama");
  EXPECT_EQ(j["hidden_size"], 48);
  EXPECT_EQ(j["intermediate_size"], 131);
  EXPECT_EQ(j["num_attention_heads"], 6);
  EXPECT_EQ(j["num_key_value_heads"], 2);
  EXPECT_EQ(j["head_dim"], 10);
  EXPECT_EQ(j["num_hidden_layers"], 3);
  EXPECT_EQ(j["vocab_size"], 101);
  EXPECT_EQ(j["rms_norm_eps"], 1e-5);
  EXPECT_EQ(j["rope_theta"], 500000.0);
  EXPECT_TRUE(j["rope_scaling"].is_null());
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["max_position_embeddings"], 65536);
  EXPECT_EQ(j["hidden_act"], "silu");
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  EXPECT_EQ(j["bos_token_id"], 1);
  EXPECT_EQ(j["eos_token_id"], json::array({2, 7}));

  write_hf_config(path("config.json"), c);
  HfLlamaConfig back = read_hf_config(path("config.json"));
  expect_same_model(back.model, c.model);
  EXPECT_EQ(back.bos_token_id, c.bos_token_id);
  EXPECT_EQ(back.eos_token_ids, c.eos_token_ids);
  EXPECT_EQ(back.torch_dtype, "bfloat16");

  HfLlamaConfig tied;
  tied.model = small_config();
  tied.model.tie_embeddings = true;
  json t = json::parse(hf_config_json(tied));
  EXPECT_EQ(t["tie_word_embeddings"], true);
  EXPECT_FALSE(t.contains("bos_token_id")) << "unknown token ids are not invented";
  EXPECT_TRUE(parse_hf_config(hf_config_json(tied), "tied").model.tie_embeddings);
}

TEST_F(HfExportTest, ReadsPublishedLlamaConfigs) {
  // meta-llama/Llama-2-7b-hf's config.json (MHA: num_key_value_heads = heads, no head_dim key).
  const char* llama2 = R"({
    "_name_or_path": "meta-llama/Llama-2-7b-hf", "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "tie_word_embeddings": false,
    "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": true, "vocab_size": 32000})";
  HfLlamaConfig a = parse_hf_config(llama2, "llama2");
  EXPECT_EQ(a.model.dim, 4096);
  EXPECT_EQ(a.model.head_dim, 128);
  EXPECT_EQ(a.model.n_kv_heads, 32);
  EXPECT_EQ(a.model.ffn_dim, 11008);
  EXPECT_EQ(a.model.max_seq_len, 4096);
  EXPECT_EQ(a.model.norm_eps, 1e-5);
  EXPECT_EQ(a.model.rope_theta, 10000.0);
  EXPECT_EQ(a.torch_dtype, "float16");
  EXPECT_EQ(a.bos_token_id, 1);
  EXPECT_EQ(a.eos_token_ids, std::vector<int64_t>{2});

  // TinyLlama-1.1B (GQA 32:4, the shape of our 1.1B benchmark).
  const char* tiny = R"({"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
    "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": null, "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.35.0", "use_cache": true, "vocab_size": 32000})";
  HfLlamaConfig b = parse_hf_config(tiny, "tinyllama");
  EXPECT_EQ(b.model.n_kv_heads, 4);
  EXPECT_EQ(b.model.head_dim, 64);
  EXPECT_EQ(b.model.n_layers, 22);

  // An old config with only the essentials: transformers' defaults fill the rest.
  const char* minimal = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
    "num_hidden_layers": 2, "intermediate_size": 172, "vocab_size": 100, "num_key_value_heads": null,
    "head_dim": null})";
  HfLlamaConfig m = parse_hf_config(minimal, "minimal");
  EXPECT_EQ(m.model.n_kv_heads, 4);
  EXPECT_EQ(m.model.head_dim, 16);
  EXPECT_EQ(m.model.norm_eps, 1e-6);
  EXPECT_EQ(m.model.rope_theta, 10000.0);
  EXPECT_EQ(m.model.max_seq_len, 2048);
  EXPECT_FALSE(m.model.tie_embeddings);
  EXPECT_FALSE(m.bos_token_id.has_value());

  // transformers 5 keeps rope_theta in rope_parameters; 4.56+ writes "dtype".
  const char* v5 = R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    "num_hidden_layers": 2, "intermediate_size": 172, "vocab_size": 100, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}})";
  HfLlamaConfig v = parse_hf_config(v5, "v5");
  EXPECT_EQ(v.model.rope_theta, 250000.0);
  EXPECT_EQ(v.torch_dtype, "bfloat16");
}

// Every rope_type in both of transformers' forms, and written back so that reading the export gives
// the same scaling.
TEST_F(HfExportTest, RopeScalingReadInBothFormsAndWrittenBack) {
  const std::string head = R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    "num_hidden_layers": 2, "intermediate_size": 172, "vocab_size": 100, "max_position_embeddings": 131072, )";
  // Llama 3.1's config.json (4.x form).
  HfLlamaConfig l3 = parse_hf_config(head + R"("rope_theta": 500000.0, "rope_scaling": {"factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    "rope_type": "llama3"}})", "llama3.1");
  EXPECT_EQ(l3.model.rope_scaling.type, "llama3");
  EXPECT_EQ(l3.model.rope_scaling.factor, 8.0);
  EXPECT_EQ(l3.model.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(l3.model.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(l3.model.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(l3.model.rope_theta, 500000.0);
  // The same in 5.x's form: rope_theta inside rope_parameters.
  HfLlamaConfig l3v5 = parse_hf_config(head + R"("rope_parameters": {"rope_theta": 500000.0, "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    "rope_type": "llama3"}})", "llama3.1 v5");
  EXPECT_EQ(l3v5.model.rope_scaling, l3.model.rope_scaling);
  EXPECT_EQ(l3v5.model.rope_theta, 500000.0);

  // yarn: the original length defaults to max_position_embeddings; every field is read.
  HfLlamaConfig y = parse_hf_config(head + R"("rope_scaling": {"rope_type": "yarn", "factor": 4.0,
    "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": false}})", "yarn");
  EXPECT_EQ(y.model.rope_scaling.original_max_position_embeddings, 131072);
  EXPECT_EQ(y.model.rope_scaling.beta_fast, 16.0);
  EXPECT_EQ(y.model.rope_scaling.beta_slow, 2.0);
  EXPECT_EQ(y.model.rope_scaling.mscale, 0.707);
  EXPECT_EQ(y.model.rope_scaling.mscale_all_dim, 1.0);
  EXPECT_FALSE(y.model.rope_scaling.truncate);
  // dynamic: transformers rescales from max_position_embeddings, whatever the object says.
  HfLlamaConfig d = parse_hf_config(head + R"("rope_scaling": {"type": "dynamic", "factor": 2.0,
    "original_max_position_embeddings": 4096}})", "dynamic");
  EXPECT_EQ(d.model.rope_scaling.original_max_position_embeddings, 131072);

  for (const HfLlamaConfig* c : {&l3, &y, &d}) {
    SCOPED_TRACE(c->model.rope_scaling.type);
    const std::string text = hf_config_json(*c);
    json j = json::parse(text);
    ASSERT_TRUE(j["rope_scaling"].is_object()) << text;
    EXPECT_EQ(j["rope_scaling"]["rope_type"], c->model.rope_scaling.type);
    HfLlamaConfig back = parse_hf_config(text, "export");
    EXPECT_EQ(back.model.rope_scaling, c->model.rope_scaling);
    EXPECT_EQ(back.model.rope_theta, c->model.rope_theta);
  }
  // dynamic's export puts its original length where transformers reads it.
  LlamaConfig trained = d.model;
  trained.max_seq_len = 262144;
  trained.rope_scaling.original_max_position_embeddings = 8192;
  HfLlamaConfig trained_hf;
  trained_hf.model = trained;
  json dj = json::parse(hf_config_json(trained_hf));
  EXPECT_EQ(dj["max_position_embeddings"], 8192);
  EXPECT_EQ(dj["rope_scaling"]["original_max_position_embeddings"], 8192);
}

TEST_F(HfExportTest, RejectsWhatLongtrainCannotRepresent) {
  auto with = [](const std::string& extra) {
    return R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "intermediate_size": 172, "vocab_size": 100)" + extra + "}";
  };
  // A rope scaling longtrain does not compute, or a field it does not know: dropping either silently
  // would change the model.
  std::string msg = error_of([&] {
    parse_hf_config(with(R"(, "rope_scaling": {"factor": 8.0, "long_factor": [1.0], "short_factor": [1.0],
        "original_max_position_embeddings": 8192, "rope_type": "longrope"})"), "phi3 config.json");
  });
  EXPECT_NE(msg.find("phi3 config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rope_scaling of type 'longrope' is not supported"), std::string::npos) << msg;
  msg = error_of([&] {
    parse_hf_config(with(R"(, "rope_scaling": {"type": "linear", "factor": 2.0, "ramp": 3})"), "c");
  });
  EXPECT_NE(msg.find("rope_scaling.ramp is not a field longtrain knows"), std::string::npos) << msg;
  msg = error_of([&] { parse_hf_config(with(R"(, "rope_scaling": {"type": "linear"})"), "lin.json"); });
  EXPECT_NE(msg.find("lin.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("needs model.rope_factor"), std::string::npos) << msg;
  msg = error_of([&] {
    parse_hf_config(with(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
        "high_freq_factor": 4})"), "l3.json");
  });
  EXPECT_NE(msg.find("l3.json: rope_scaling llama3 needs original_max_position_embeddings"), std::string::npos)
      << msg;
  msg = error_of([&] { parse_hf_config(with(R"(, "hidden_act": "gelu")"), "c"); });
  EXPECT_NE(msg.find("hidden_act 'gelu'"), std::string::npos) << msg;
  msg = error_of([&] { parse_hf_config(with(R"(, "attention_bias": true)"), "c"); });
  EXPECT_NE(msg.find("attention_bias"), std::string::npos) << msg;
  msg = error_of([&] { parse_hf_config(with(R"(, "mlp_bias": true)"), "c"); });
  EXPECT_NE(msg.find("mlp_bias"), std::string::npos) << msg;
  msg = error_of([&] { parse_hf_config(R"({"model_type": "mistral", "hidden_size": 64})", "c"); });
  EXPECT_NE(msg.find("model_type is 'mistral'"), std::string::npos) << msg;
  msg = error_of([&] { parse_hf_config(with(R"(, "num_hidden_layers": "two")"), "c"); });
  EXPECT_NE(msg.find("key 'num_hidden_layers' must be an integer"), std::string::npos) << msg;
  msg = error_of([&] { parse_hf_config(with(R"(, "num_key_value_heads": 3)"), "cfg.json"); });
  EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("n_kv_heads"), std::string::npos) << msg;
  msg = error_of([&] { parse_hf_config("{\"model_type\": ", "broken.json"); });
  EXPECT_NE(msg.find("broken.json: not valid JSON"), std::string::npos) << msg;
  msg = error_of([&] { read_hf_config(path("absent/config.json")); });
  EXPECT_NE(msg.find("absent/config.json"), std::string::npos) << msg;
}

TEST_F(HfExportTest, ExportedDirectoryLoadsBackBitwise) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied embeddings" : "separate lm_head");
    HfLlamaConfig c;
    c.model = small_config();
    c.model.tie_embeddings = tied;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    Arena params("params", Device::cpu), loaded("loaded", Device::cpu);
    add_parameter_entries(params, c.model, DType::f32);
    add_parameter_entries(loaded, c.model, DType::f32);
    params.allocate();
    loaded.allocate();
    initialize_parameters(params, 99);

    const std::string out = path(tied ? "tied" : "untied");
    export_hf_directory(out, c, params);
    HfLlamaConfig back = read_hf_config(out + "/config.json");
    expect_same_model(back.model, c.model);
    EXPECT_EQ(back.torch_dtype, "float32");
    SafetensorsFile st(out + "/model.safetensors");
    EXPECT_EQ(st.find("lm_head.weight") != nullptr, !tied);
    EXPECT_EQ(st.metadata().at("format"), "pt");

    SafetensorsLoadReport report = load_hf_weights(out, loaded);
    EXPECT_TRUE(report.ignored.empty());
    for (size_t i = 0; i < params.table().size(); ++i)
      EXPECT_EQ(std::memcmp(params.at(i).data, loaded.at(i).data, params.at(i).nbytes()), 0)
          << params.table()[i].name;
  }

  // bf16 export of f32 master weights: torch_dtype follows, values are the bf16 rounding.
  HfLlamaConfig c;
  c.model = small_config();
  Arena params("params", Device::cpu), loaded("loaded", Device::cpu);
  add_parameter_entries(params, c.model, DType::f32);
  add_parameter_entries(loaded, c.model, DType::f32);
  params.allocate();
  loaded.allocate();
  initialize_parameters(params, 5);
  export_hf_directory(path("bf16"), c, params, DType::bf16);
  EXPECT_EQ(read_hf_config(path("bf16/config.json")).torch_dtype, "bfloat16");
  load_hf_weights(path("bf16"), loaded);
  const Tensor q0 = params.get("model.layers.0.self_attn.q_proj.weight");
  const Tensor q1 = loaded.get("model.layers.0.self_attn.q_proj.weight");
  for (int64_t i = 0; i < q0.numel(); ++i)
    ASSERT_EQ(q1.ptr<float>()[i], static_cast<float>(bf16(q0.ptr<float>()[i]))) << i;

  // An arena that does not match the config is refused.
  HfLlamaConfig other = c;
  other.model.ffn_dim = 130;
  std::string msg = error_of([&] { export_hf_directory(path("wrong"), other, params); });
  EXPECT_NE(msg.find("mlp.gate_proj.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[131, 48]"), std::string::npos) << msg;
}

TEST_F(HfExportTest, LoadsShardedCheckpointThroughTheIndex) {
  HfLlamaConfig c;
  c.model = small_config();
  Arena params("params", Device::cpu), loaded("loaded", Device::cpu);
  add_parameter_entries(params, c.model, DType::f32);
  add_parameter_entries(loaded, c.model, DType::f32);
  params.allocate();
  loaded.allocate();
  initialize_parameters(params, 3);

  // Two shards split at layer 1, plus a buffer old HF checkpoints carry, as transformers writes them.
  const std::string out = path("sharded");
  fs::create_directories(out);
  std::vector<NamedTensor> first, second;
  json weight_map;
  for (size_t i = 0; i < params.table().size(); ++i) {
    const std::string& name = params.table()[i].name;
    bool early = name == "model.embed_tokens.weight" || name.rfind("model.layers.0.", 0) == 0;
    (early ? first : second).push_back({name, params.at(i)});
    weight_map[name] = early ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  std::vector<float> inv_freq(5, 0.5f);
  first.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", Tensor(inv_freq.data(), DType::f32, {5})});
  weight_map["model.layers.0.self_attn.rotary_emb.inv_freq"] = "model-00001-of-00002.safetensors";
  save_safetensors(out + "/model-00001-of-00002.safetensors", first);
  save_safetensors(out + "/model-00002-of-00002.safetensors", second);
  auto write_index = [&](const json& map) {
    std::ofstream(out + "/model.safetensors.index.json") << json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump(2);
  };
  write_index(weight_map);
  write_hf_config(out + "/config.json", c);

  SafetensorsLoadReport report = load_hf_weights(out, loaded);
  EXPECT_EQ(report.ignored, std::vector<std::string>{"model.layers.0.self_attn.rotary_emb.inv_freq"});
  for (size_t i = 0; i < params.table().size(); ++i)
    EXPECT_EQ(std::memcmp(params.at(i).data, loaded.at(i).data, params.at(i).nbytes()), 0) << params.table()[i].name;
  std::string msg = error_of([&] { load_hf_weights(out, loaded, ExtraTensors::error); });
  EXPECT_NE(msg.find("rotary_emb.inv_freq' is not part of arena 'loaded'"), std::string::npos) << msg;

  json wrong = weight_map;
  wrong["model.norm.weight"] = "model-00001-of-00002.safetensors";
  write_index(wrong);
  msg = error_of([&] { load_hf_weights(out, loaded); });
  EXPECT_NE(msg.find("model.safetensors.index.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("puts tensor 'model.norm.weight' in"), std::string::npos) << msg;

  wrong = weight_map;
  wrong["model.norm.weight"] = "model-00003-of-00002.safetensors";
  write_index(wrong);
  msg = error_of([&] { load_hf_weights(out, loaded); });
  EXPECT_NE(msg.find("model-00003-of-00002.safetensors', which does not exist"), std::string::npos) << msg;

  wrong = weight_map;
  wrong["model.norm.weight"] = "../elsewhere.safetensors";
  write_index(wrong);
  msg = error_of([&] { load_hf_weights(out, loaded); });
  EXPECT_NE(msg.find("not a file name inside the directory"), std::string::npos) << msg;

  msg = error_of([&] { load_hf_weights(path("nothing_here"), loaded); });
  EXPECT_NE(msg.find("neither model.safetensors nor model.safetensors.index.json"), std::string::npos) << msg;
}

// An f16 number exactly: v must be a normal f16 value (the test picks such values).
uint16_t exact_half(float v) {
  if (v == 0.0f) return std::signbit(v) ? 0x8000 : 0;
  int e = 0;
  const float m = std::frexp(std::fabs(v), &e);  // |v| = m · 2^e, m in [0.5, 1)
  const auto mantissa = static_cast<uint16_t>(std::lround((m * 2.0f - 1.0f) * 1024.0f));
  return static_cast<uint16_t>((v < 0 ? 0x8000 : 0) | ((e - 1 + 15) << 10) | mantissa);
}

// A safetensors file of F16 tensors, written byte by byte as another writer would.
void write_f16_safetensors(const std::string& file, const Arena& values) {
  json header = json::object();
  std::vector<unsigned char> data;
  for (size_t i = 0; i < values.table().size(); ++i) {
    const ArenaEntry& e = values.table()[i];
    const size_t begin = data.size();
    const float* v = values.at(i).ptr<float>();
    for (int64_t k = 0; k < e.numel; ++k) {
      const uint16_t h = exact_half(v[k]);
      data.push_back(static_cast<unsigned char>(h & 0xff));
      data.push_back(static_cast<unsigned char>(h >> 8));
    }
    header[e.name] = {{"dtype", "F16"}, {"shape", e.shape}, {"data_offsets", {begin, data.size()}}};
  }
  const std::string text = header.dump();
  std::ofstream out(file, std::ios::binary);
  for (int b = 0; b < 8; ++b) out.put(static_cast<char>(static_cast<uint64_t>(text.size()) >> (8 * b)));
  out << text;
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

// model.init_from, then export, then model.init_from again is the identity: for f32, bf16 and f16
// directories, tied and untied, with a RoPE scaling that must survive config.json.
TEST_F(HfExportTest, InitFromExportInitFromIsTheIdentity) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    HfLlamaConfig c;
    c.model = small_config();
    c.model.tie_embeddings = tied;
    c.model.rope_scaling.type = "yarn";
    c.model.rope_scaling.factor = 4;
    c.model.rope_scaling.original_max_position_embeddings = 16384;
    auto arena = [&](const char* name) {
      Arena a(name, Device::cpu);
      add_parameter_entries(a, c.model, DType::f32);
      a.allocate();
      return a;
    };
    Arena a = arena("a"), b = arena("b"), d = arena("d");
    initialize_parameters(a, tied ? 17 : 18);
    auto expect_equal = [&](const Arena& x, const Arena& y, const char* what) {
      for (size_t i = 0; i < x.table().size(); ++i)
        ASSERT_EQ(std::memcmp(x.at(i).data, y.at(i).data, x.at(i).nbytes()), 0) << what << ": " << x.table()[i].name;
    };

    export_hf_directory(path("f32"), c, a);
    init_from_hf_directory(path("f32"), c.model, b, /*threads=*/2);
    expect_equal(a, b, "f32 directory");
    export_hf_directory(path("f32_again"), read_hf_config(path("f32/config.json")), b);
    init_from_hf_directory(path("f32_again"), c.model, d, 1);
    expect_equal(a, d, "f32 directory re-exported");
    expect_same_model(read_hf_config(path("f32_again/config.json")).model, c.model);

    // bf16 storage: the first load rounds the f32 weights once; from then on it is the identity.
    export_hf_directory(path("bf16"), c, a, DType::bf16);
    init_from_hf_directory(path("bf16"), c.model, b);
    const float w = a.get("model.norm.weight").ptr<float>()[3], wb = b.get("model.norm.weight").ptr<float>()[3];
    EXPECT_EQ(wb, static_cast<float>(bf16(w)));
    export_hf_directory(path("bf16_again"), c, b, DType::bf16);
    init_from_hf_directory(path("bf16_again"), c.model, d);
    expect_equal(b, d, "bf16 directory re-exported");

    // f16 storage (what many published Llama checkpoints hold): values that f16 holds exactly.
    for (size_t i = 0; i < a.table().size(); ++i) {
      float* v = a.at(i).ptr<float>();
      for (int64_t k = 0; k < a.table()[i].numel; ++k) v[k] = static_cast<float>((k * 37 + i) % 1023 + 1) / 1024.0f;
    }
    fs::create_directories(path("f16"));
    write_f16_safetensors(path("f16/model.safetensors"), a);
    write_hf_config(path("f16/config.json"), c);
    init_from_hf_directory(path("f16"), c.model, b);
    expect_equal(a, b, "f16 directory");
  }
}

TEST_F(HfExportTest, InitFromErrorsNameTheTensorKeyAndDirectory) {
  HfLlamaConfig c;
  c.model = small_config();
  Arena a("params", Device::cpu);
  add_parameter_entries(a, c.model, DType::f32);
  a.allocate();
  initialize_parameters(a, 4);
  // A directory missing one tensor the model needs.
  std::vector<NamedTensor> all_but_one;
  for (size_t i = 0; i < a.table().size(); ++i)
    if (a.table()[i].name != "model.layers.2.mlp.down_proj.weight") all_but_one.push_back({a.table()[i].name, a.at(i)});
  fs::create_directories(path("missing"));
  save_safetensors(path("missing/model.safetensors"), all_but_one);
  write_hf_config(path("missing/config.json"), c);
  std::string msg = error_of([&] { init_from_hf_directory(path("missing"), c.model, a); });
  EXPECT_NE(msg.find("model.init_from '" + path("missing") + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1 tensor(s) of arena 'params' are missing: model.layers.2.mlp.down_proj.weight"),
            std::string::npos)
      << msg;

  // A config.json of another shape.
  export_hf_directory(path("other"), c, a);
  LlamaConfig wider = c.model;
  wider.ffn_dim = 140;
  msg = error_of([&] { init_from_hf_directory(path("other"), wider, a); });
  EXPECT_NE(msg.find("model.ffn_dim is 140 but config.json has intermediate_size = 131"), std::string::npos) << msg;
  // A tensor of another shape (config.json edited by hand).
  HfLlamaConfig edited = c;
  edited.model.vocab_size = 102;
  write_hf_config(path("other/config.json"), edited);
  LlamaConfig v102 = c.model;
  v102.vocab_size = 102;
  Arena big("params", Device::cpu);
  add_parameter_entries(big, v102, DType::f32);
  big.allocate();
  msg = error_of([&] { init_from_hf_directory(path("other"), v102, big); });
  EXPECT_NE(msg.find("model.embed_tokens.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[102, 48]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[101, 48]"), std::string::npos) << msg;
  msg = error_of([&] { init_from_hf_directory(path("absent"), c.model, a); });
  EXPECT_NE(msg.find("absent/config.json"), std::string::npos) << msg;
}

}  // namespace
}  // namespace longtrain::model
