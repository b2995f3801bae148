// `longtrain prepare`: tokenizes .txt/.jsonl inputs into .bin/.idx shards with a manifest
// (data/prepare.h), on several threads, with a progress bar.
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "data/prepare.h"
#include "tools/longtrain/commands.h"

namespace longtrain::cli {

void add_prepare_command(CLI::App& app) {
  auto o = std::make_shared<data::PrepareOptions>();
  auto no_progress = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("prepare", "Tokenize .txt/.jsonl inputs into token shards for training");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "SentencePiece .model or Hugging Face tokenizer.json (byte-level BPE: Llama 3, Qwen 2.5, GPT-2)")
      ->required();
  cmd->add_option("-i,--input", o->inputs, ".txt files (one document each), .jsonl files (one document "
                  "per line) or directories of them")->required();
  cmd->add_option("-o,--output", o->output, "the shard directory to write")->required();
  cmd->add_option("--val-fraction", o->val_fraction, "share of documents held out for validation")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "tokenizer threads (0: all cores)")->capture_default_str();
  cmd->add_flag("--bos,!--no-bos", o->add_bos, "put the tokenizer's BOS before each document (default: no)");
  cmd->add_flag("--eos,!--no-eos", o->add_eos, "put the tokenizer's EOS after each document (default: yes)");
  cmd->add_option("--text-key", o->text_key, "field of .jsonl records")->capture_default_str();
  cmd->add_option("--shard-tokens", o->shard_tokens, "at most this many tokens per .bin")
      ->capture_default_str();
  cmd->add_flag("--overwrite", o->overwrite, "replace an existing output directory");
  cmd->add_flag("--no-progress", *no_progress, "no progress bar");
  cmd->callback([o, no_progress] {
    o->progress = !*no_progress;
    const data::PrepareSummary s = data::prepare_corpus(*o);
    fmt::print("prepared {}: {} documents from {:.2f} MB of text in {:.2f} s ({:.2f} MB/s, {} threads)\n",
               o->output, s.documents, s.input_bytes / 1e6, s.seconds,
               s.seconds > 0 ? s.input_bytes / 1e6 / s.seconds : 0.0, s.threads);
    fmt::print("  train: {} documents, {} tokens\n", s.train_documents, s.train_tokens);
    if (s.val_documents > 0) fmt::print("  val:   {} documents, {} tokens\n", s.val_documents, s.val_tokens);
    fmt::print("  vocabulary {}, {:.2f} bytes of text per token\n", s.vocab_size,
               static_cast<double>(s.input_bytes) / std::max<int64_t>(1, s.train_tokens + s.val_tokens));
  });
}

}  // namespace longtrain::cli
