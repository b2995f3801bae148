// longtrain: the command-line entry point. Subcommands are registered by the add_*_command
// functions of commands.h, one source file each.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "runtime/error.h"
#include "tools/longtrain/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"longtrain: a C++/CUDA trainer for Llama-style models on very long sequences"};
  app.require_subcommand(1);
  longtrain::cli::add_corpus_command(app);
  longtrain::cli::add_tokenizer_commands(app);
  longtrain::cli::add_prepare_command(app);
  longtrain::cli::add_train_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const longtrain::Error& e) {
    fmt::print(stderr, "longtrain: error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "longtrain: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
