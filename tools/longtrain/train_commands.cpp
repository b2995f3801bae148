// `longtrain train`, `longtrain eval`, `longtrain generate` and `longtrain schema`.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/loader.h"
#include "data/mixture.h"
#include "data/tokenizer.h"
#include "model/generate.h"
#include "parallel/distributed.h"
#include "parallel/layout.h"
#include "parallel/store.h"
#include "runtime/device.h"
#include "tools/longtrain/commands.h"
#include "trainer/config.h"
#include "trainer/passkey.h"
#include "trainer/trainer.h"

namespace longtrain::cli {

namespace fs = std::filesystem;

void add_train_commands(CLI::App& app) {
  {
    auto* cmd = app.add_subcommand("train", "Train a model from a YAML config");
    auto config_path = std::make_shared<std::string>();
    auto sets = std::make_shared<std::vector<std::string>>();
    auto resume = std::make_shared<std::string>();
    cmd->add_option("config", *config_path, "YAML config (see `longtrain schema`)")->required();
    cmd->add_option("--set", *sets, "Override a key: --set optim.lr=1e-3 (repeatable)");
    cmd->add_option("--resume", *resume, "Resume: 'auto' (newest complete checkpoint, if any) or a checkpoint dir");
    auto plan = std::make_shared<bool>(false);
    cmd->add_flag("--plan", *plan, "Print the memory plan per rank (parameters, gradients, optimizer, activations, "
                                   "workspace) and, with sequence parallelism, the attention cost model's "
                                   "prediction per schedule; exit without allocating");
    auto device_gib = std::make_shared<double>(0.0);
    cmd->add_option("--device-memory", *device_gib,
                    "With --plan: the free device memory (GiB) to plan model.checkpoint/model.offload auto for "
                    "(default: what this machine's device has free)");
    auto topo = std::make_shared<attn::Topology>();
    cmd->add_option("--plan-ranks-per-node", topo->ranks_per_node, "--plan's cost model: GPUs per node")
        ->capture_default_str()->check(CLI::PositiveNumber);
    auto intra_gbs = std::make_shared<double>(topo->intra.bytes_per_second / 1e9);
    auto inter_gbs = std::make_shared<double>(topo->inter.bytes_per_second / 1e9);
    auto tflops = std::make_shared<double>(topo->flops_per_second / 1e12);
    cmd->add_option("--plan-intra-gbs", *intra_gbs, "--plan's cost model: GB/s per GPU inside a node")
        ->capture_default_str()->check(CLI::PositiveNumber);
    cmd->add_option("--plan-inter-gbs", *inter_gbs, "--plan's cost model: GB/s per GPU across nodes")
        ->capture_default_str()->check(CLI::PositiveNumber);
    cmd->add_option("--plan-tflops", *tflops, "--plan's cost model: attention TFLOP/s per GPU")
        ->capture_default_str()->check(CLI::PositiveNumber);
    cmd->callback([=] {
      trainer::TrainConfig c = trainer::load_config(*config_path, *sets);
      if (*plan) {
        // A plan for train.device: cuda is planned even on a machine without a GPU (to size a run
        // before getting one); only the free-memory line needs the device.
        const bool gpu_here = cuda_available();
        trainer::resolve_device(c, gpu_here || c.train.device == trainer::DeviceChoice::cuda);
        const char* ws = std::getenv("WORLD_SIZE");
        const int world = ws ? std::atoi(ws) : static_cast<int>(c.parallel.sp_size);
        const Device dev = c.train.device == trainer::DeviceChoice::cuda ? Device::cuda : Device::cpu;
        const bool measured = *device_gib <= 0 && (dev == Device::cpu || gpu_here);
        const bool automatic = !c.model.checkpoint || !c.model.offload;
        LT_CHECK(*device_gib > 0 || measured || !automatic,
                 "train --plan for CUDA on a machine without a GPU: model.checkpoint/model.offload auto choose by free "
                 "GPU memory; pass --device-memory GIB (an H200 has about 139), or set both keys");
        model::DeviceMemory m = measured ? model::device_memory(dev) : model::DeviceMemory{};
        if (*device_gib > 0) {
          m.free = static_cast<size_t>(*device_gib * 1073741824.0);
          m.total = m.free;
        } else if (!measured) {
          m.free = m.total = ~size_t{0} / 4;  // no device here and nothing to choose: only the table is printed
        }
        const model::DeviceMemory host = dev == Device::cpu ? m : model::device_memory(Device::cpu);
        const model::MemoryChoice choice = trainer::plan_training_memory(c, world, m, host);
        fmt::print("{}", choice.plan.table());
        fmt::print("memory: {}\n", choice.reason);
        topo->intra.bytes_per_second = *intra_gbs * 1e9;
        topo->inter.bytes_per_second = *inter_gbs * 1e9;
        topo->flops_per_second = *tflops * 1e12;
        fmt::print("{}", trainer::attention_plan_text(c, *topo));
        if (measured || *device_gib > 0) {
          fmt::print("free on this {}{}: {:.2f} GiB of {:.2f} GiB{}\n", dev == Device::cuda ? "GPU" : "host",
                     *device_gib > 0 ? " (as given by --device-memory)" : "", m.free / 1073741824.0,
                     m.total / 1073741824.0, choice.fits ? "" : "; it does not fit");
        } else {
          fmt::print("(no GPU here: compare the total with the free memory of the GPU you will train on)\n");
        }
        return;
      }
      trainer::resolve_device(c, cuda_available());
      trainer::TrainSummary s = trainer::train(c, *resume);
      if (s.stopped_by_signal != 0) throw ExitCode{parallel::kExitPreempted};
      if (s.final_eval)
        fmt::print("final validation loss {:.4f} (perplexity {:.2f}) after step {}\n", s.final_eval->loss,
                   s.final_eval->perplexity, s.last_step);
    });
  }
  {
    auto* cmd = app.add_subcommand("schema", "Print every config key with its type, default and meaning");
    cmd->callback([] { fmt::print("{}", trainer::schema_text()); });
  }
  {
    auto* cmd = app.add_subcommand(
        "eval", "Validation loss, perplexity and loss by position of a checkpoint or a Hugging Face Llama directory");
    auto dir = std::make_shared<std::string>();
    auto data_dir = std::make_shared<std::string>();
    auto batches = std::make_shared<int64_t>(0);
    auto buckets = std::make_shared<int64_t>(0);
    auto seq_len = std::make_shared<int64_t>(0);
    auto device = std::make_shared<std::string>("cpu");
    cmd->add_option("--checkpoint", *dir,
                    "Checkpoint directory (…/checkpoints/step_N) or a Hugging Face Llama directory (config.json, "
                    "safetensors)")
        ->required();
    cmd->add_option("--data", *data_dir,
                    "Prepared data directory (default: the config's data.val or data.train; required for a Hugging "
                    "Face directory)");
    cmd->add_option("--batches", *batches, "Validation windows to evaluate (default: the config's eval.batches; 0 = all)");
    cmd->add_option("--buckets", *buckets, "Position buckets (default: the config's eval.position_buckets)");
    cmd->add_option("--seq-len", *seq_len,
                    "Tokens per window (default: the run's data.seq_len; a Hugging Face directory's "
                    "max_position_embeddings); may exceed the training length");
    cmd->add_option("--device", *device, "cpu (f32, default) or cuda (bf16 mixed precision)")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    auto document_mask = std::make_shared<std::string>();
    cmd->add_option("--document-mask", *document_mask,
                    "true or false: evaluate with per-document attention, positions and labels (default: the run's "
                    "data.document_mask; false for a Hugging Face directory)")
        ->check(CLI::IsMember({"true", "false"}));
    auto passkey = std::make_shared<bool>(false);
    auto pk = std::make_shared<trainer::PasskeyOptions>();
    auto out_dir = std::make_shared<std::string>("passkey");
    auto tokenizer_path = std::make_shared<std::string>();
    cmd->add_flag("--passkey", *passkey,
                  "Passkey retrieval instead of the loss: the length x depth grid of exact-match accuracy");
    cmd->add_option("--lengths", pk->lengths, "Passkey prompt lengths in tokens, e.g. 4096,16384")->delimiter(',');
    cmd->add_option("--depths", pk->depths, "Passkey depths in [0, 1] (default 0,0.25,0.5,0.75,1)")->delimiter(',');
    cmd->add_option("--trials", pk->trials, "Passkey keys per cell (default 5)");
    cmd->add_option("--seed", pk->seed, "Seed of the passkey keys (default 0)");
    cmd->add_option("--out", *out_dir, "Directory for passkey.json and passkey.svg (default ./passkey)");
    auto json_out = std::make_shared<std::string>();
    cmd->add_option("--json", *json_out, "Also write the loss, tokens and bucket losses to this JSON file");
    cmd->add_option("--tokenizer", *tokenizer_path,
                    "SentencePiece .model or tokenizer.json (default: the directory's tokenizer.model or tokenizer.json)");
    auto sp_size = std::make_shared<int64_t>(0);
    auto schedule = std::make_shared<std::string>();
    auto layout = std::make_shared<std::string>();
    cmd->add_option("--sp-size", *sp_size,
                    "Under longtrain-run: ranks per sequence-parallel group (default: every rank; the rest is data "
                    "parallel)");
    cmd->add_option("--schedule", *schedule, "Under longtrain-run: the attention schedule (default: the checkpoint's)");
    cmd->add_option("--layout", *layout, "Under longtrain-run: contiguous or zigzag (default: the checkpoint's)");
    cmd->callback([=] {
      const Device dev = *device == "cuda" ? Device::cuda : Device::cpu;
      LT_CHECK(dev == Device::cpu || cuda_available(), "eval --device cuda: no CUDA device is usable here");
      LT_CHECK(*seq_len >= 0, "eval --seq-len must be positive, got {}", *seq_len);
      // The job: one process, or every rank of longtrain-run (sequence-parallel groups of --sp-size).
      const int world_size = parallel::world_from_env().world_size;
      LT_CHECK(*sp_size >= 0, "eval --sp-size must be positive, got {}", *sp_size);
      LT_CHECK(world_size > 1 || *sp_size <= 1,
               "eval --sp-size {} needs that many processes: run it as `longtrain-run --nproc-per-node {} longtrain "
               "eval ...`", *sp_size, *sp_size);
      std::vector<std::string> overrides;
      if (!schedule->empty()) overrides.push_back("attention.schedule=" + *schedule);
      if (!layout->empty()) overrides.push_back("parallel.layout=" + *layout);
      if (*passkey) {
        LT_CHECK(!pk->lengths.empty(), "eval --passkey: no lengths given (--lengths 4096,16384,...)");
        // Sized for the longest trial, rounded so that any layout splits it over the job's ranks.
        const int64_t longest = *std::max_element(pk->lengths.begin(), pk->lengths.end());
        const int64_t T = trainer::passkey_forward_length(longest, SeqLayout::zigzag, world_size);
        trainer::LoadedModel m = trainer::load_model_from_checkpoint(*dir, T, dev, overrides, *sp_size);
        LT_CHECK(m.config.attention.causal, "eval --passkey needs causal attention; {} has attention.causal false",
                 *dir);
        std::string tok = !tokenizer_path->empty() ? *tokenizer_path : data::find_tokenizer_in(*dir);
        if (tok.empty() || !fs::exists(tok)) tok = m.config.data.tokenizer;
        LT_CHECK(!tok.empty() && fs::exists(tok),
                 "eval --passkey: no tokenizer: {} has no tokenizer.model or tokenizer.json and the config names none; "
                 "pass --tokenizer",
                 *dir);
        data::Tokenizer tokenizer(tok);
        trainer::PasskeyRanks ranks;
        ranks.layout = m.config.parallel.layout;
        ranks.sp_rank = m.sp_rank, ranks.sp_size = m.sp_size, ranks.dp_rank = m.dp_rank, ranks.dp_size = m.dp_size;
        ranks.world = m.world();
        const std::vector<trainer::PasskeyCell> cells = trainer::passkey_eval_forward(*m.model, tokenizer, *pk, ranks);
        if (!m.main) return;
        fmt::print("passkey retrieval, {} (step {}): correct / trials\n{}", *dir, m.step, trainer::passkey_table(cells));
        fs::create_directories(*out_dir);
        std::ofstream(fs::path(*out_dir) / "passkey.json") << trainer::passkey_json(cells);
        std::ofstream(fs::path(*out_dir) / "passkey.svg") << trainer::passkey_svg(cells, "passkey retrieval: " + *dir);
        LT_CHECK(fs::file_size(fs::path(*out_dir) / "passkey.svg") > 0, "eval --passkey: writing {} failed", *out_dir);
        fmt::print("wrote {}/passkey.json and {}/passkey.svg\n", *out_dir, *out_dir);
        return;
      }
      trainer::LoadedModel m = trainer::load_model_from_checkpoint(*dir, *seq_len, dev, overrides, *sp_size);
      trainer::TrainConfig& c = m.config;
      if (*seq_len > 0) {
        if (*seq_len > c.model.max_seq_len && m.main)
          fmt::print("note: --seq-len {} is beyond the model's max_seq_len {} (extrapolation)\n", *seq_len,
                     c.model.max_seq_len);
        c.data.seq_len = *seq_len;
      }
      const std::string shard_dir = !data_dir->empty() ? *data_dir : (!c.data.val.empty() ? c.data.val : c.data.train);
      LT_CHECK(!shard_dir.empty(), "eval: {} is a Hugging Face directory with no data of its own: pass --data DIR "
               "(a directory made by `longtrain prepare`)", *dir);
      LT_CHECK(!data::is_mixture_spec(shard_dir), "eval: the run's data.train is a mixture and it has no data.val: "
               "pass --data DIR (a shard directory or Megatron dataset to evaluate on)");
      LT_CHECK(!data_dir->empty() || !c.data.val.empty() || data::megatron_prefix(c.data.train).empty(),
               "eval: the run's data.train '{}' is a Megatron dataset, which has no validation split, and it has no "
               "data.val: pass --data", c.data.train);
      // The windows the way training saw them: with or without the document mask (--document-mask
      // overrides the run's setting).
      if (!document_mask->empty()) c.data.document_mask = *document_mask == "true";
      // This rank's share of the validation windows: its data-parallel rank's windows, its
      // sequence-parallel rank's tokens of each; `evaluate` sums the ranks' losses.
      data::LoaderOptions o = trainer::eval_loader_options(m, shard_dir);
      if (o.document_mask && m.main) fmt::print("document mask on: attention, positions and labels per document\n");
      data::Loader loader(o);
      const int64_t n = *batches > 0 ? *batches : c.eval.batches;
      trainer::EvalResult e =
          trainer::evaluate(*m.model, loader, n, *buckets > 0 ? *buckets : c.eval.position_buckets, m.world());
      if (!m.main) return;
      if (m.dist)
        fmt::print("{} ranks: data parallel {} x sequence parallel {} (attention {}, layout {})\n",
                   m.dp_size * m.sp_size, m.dp_size, m.sp_size, trainer::enum_name(c.attention.schedule),
                   layout_name(c.parallel.layout));
      fmt::print("checkpoint {} (step {})\nvalidation loss {:.4f}, perplexity {:.2f}, {} tokens\n", *dir, m.step,
                 e.loss, e.perplexity, e.tokens);
      const int64_t S = c.data.seq_len, B = static_cast<int64_t>(e.bucket_loss.size());
      // The baseline counts one train corpus (not a mixture's several).
      if (!c.data.train.empty() && !data::is_mixture_spec(c.data.train)) {
        data::Loader train_split([&] {
          data::LoaderOptions t = o;
          t.shard_dir = c.data.train;
          t.split = "train";
          return t;
        }());
        trainer::UnigramBaseline u = trainer::unigram_baseline(train_split.corpus(), loader.corpus());
        fmt::print("unigram baseline: train entropy {:.4f} nats/token, validation cross-entropy {:.4f}\n",
                   u.train_entropy, u.val_cross_entropy);
      }
      for (int64_t b = 0; b < B; ++b)
        fmt::print("  positions {:>6}-{:<6} loss {:.4f} ({} tokens)\n", b * S / B, (b + 1) * S / B - 1,
                   e.bucket_loss[static_cast<size_t>(b)], e.bucket_tokens[static_cast<size_t>(b)]);
      if (!json_out->empty()) {
        nlohmann::ordered_json j;
        j["checkpoint"] = *dir;
        j["step"] = m.step;
        j["seq_len"] = S;
        j["loss"] = e.loss;
        j["perplexity"] = e.perplexity;
        j["tokens"] = e.tokens;
        j["buckets"] = nlohmann::ordered_json::array();
        for (int64_t b = 0; b < B; ++b)
          j["buckets"].push_back({{"first", b * S / B}, {"last", (b + 1) * S / B - 1},
                                  {"loss", e.bucket_loss[static_cast<size_t>(b)]},
                                  {"tokens", e.bucket_tokens[static_cast<size_t>(b)]}});
        std::ofstream f(*json_out);
        f << j.dump(1) << "\n";
        f.close();
        LT_CHECK(f.good(), "eval --json: could not write {}", *json_out);
      }
    });
  }
  {
    auto* cmd = app.add_subcommand("generate", "Sample text from a checkpoint or a Hugging Face Llama directory");
    auto dir = std::make_shared<std::string>();
    auto prompt = std::make_shared<std::string>();
    auto tokenizer_path = std::make_shared<std::string>();
    auto max_new = std::make_shared<int64_t>(100);
    auto sp = std::make_shared<model::SamplingParams>();
    cmd->add_option("--checkpoint", *dir,
                    "Checkpoint directory (…/checkpoints/step_N) or a Hugging Face Llama directory")
        ->required();
    cmd->add_option("--prompt", *prompt, "Text to continue")->required();
    cmd->add_option("--tokenizer", *tokenizer_path,
                    "SentencePiece .model or tokenizer.json (default: the checkpoint's tokenizer.model or tokenizer.json)");
    cmd->add_option("--max-new-tokens", *max_new, "Tokens to sample (default 100)");
    cmd->add_option("--temperature", sp->temperature, "Sampling temperature; 0 = greedy (default 0.8)");
    cmd->add_option("--top-p", sp->top_p, "Nucleus sampling mass (default 0.95)");
    cmd->add_option("--seed", sp->seed, "Sampling seed (default 0)");
    auto device = std::make_shared<std::string>("cpu");
    cmd->add_option("--device", *device, "cpu (f32, default) or cuda (bf16 mixed precision)")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    cmd->callback([=] {
      const Device dev = *device == "cuda" ? Device::cuda : Device::cpu;
      LT_CHECK(dev == Device::cpu || cuda_available(), "generate --device cuda: no CUDA device is usable here");
      // Under longtrain-run all ranks form one sequence-parallel group that shards the KV cache
      // (model/generate.h); the model itself is only used through its weights (2 tokens per rank of
      // training activations, the least every layout splits).
      const int world_size = parallel::world_from_env().world_size;
      trainer::LoadedModel m = trainer::load_model_from_checkpoint(*dir, 2 * world_size, dev, {}, world_size);
      parallel::Communicator* group = m.dist ? &m.dist->sp() : nullptr;
      // An explicit --tokenizer is used or refused, never replaced by another one.
      std::string tok = *tokenizer_path;
      if (!tok.empty()) {
        LT_CHECK(fs::exists(tok), "generate: --tokenizer {} does not exist", tok);
      } else {
        tok = data::find_tokenizer_in(*dir);
        if (tok.empty()) tok = m.config.data.tokenizer;
        LT_CHECK(!tok.empty() && fs::exists(tok),
                 "generate: no tokenizer: {} has no tokenizer.model or tokenizer.json and the config's data.tokenizer "
                 "({}) is not there; "
                 "pass --tokenizer",
                 *dir, m.config.data.tokenizer.empty() ? "unset" : m.config.data.tokenizer);
      }
      data::Tokenizer tokenizer(tok);
      // A tokenizer.json's vocabulary may be smaller than the model's (embeddings padded, as Qwen's).
      LT_CHECK(tokenizer.is_hf() ? tokenizer.vocab_size() <= m.config.model.vocab_size
                                 : tokenizer.vocab_size() == m.config.model.vocab_size,
               "generate: tokenizer {} has {} pieces but the model's vocabulary is {}", tok, tokenizer.vocab_size(),
               m.config.model.vocab_size);
      std::vector<int32_t> ids;
      if (tokenizer.bos_id() >= 0) ids.push_back(tokenizer.bos_id());
      const size_t first_text_id = ids.size();
      for (int32_t id : tokenizer.encode(*prompt)) ids.push_back(id);
      const std::vector<int32_t> out = model::generate(*m.model, ids, *max_new, *sp, tokenizer.eos_id(), group);
      if (!m.main) return;  // every rank generated the same tokens
      // Prompt and continuation are decoded as one sequence: SentencePiece marks a word's leading
      // space on its first piece and drops it at the start of a decode, so decoding the continuation
      // alone would glue its first word to the prompt's last one.
      std::vector<int32_t> text_ids(ids.begin() + static_cast<std::ptrdiff_t>(first_text_id), ids.end());
      text_ids.insert(text_ids.end(), out.begin(), out.end());
      fmt::print("{}\n", tokenizer.decode(text_ids));
    });
  }
}

}  // namespace longtrain::cli
