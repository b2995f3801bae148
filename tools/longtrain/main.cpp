// longtrain: the command-line entry point. Subcommands are registered by the add_*_command
// functions of commands.h, one source file each.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <exception>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "runtime/error.h"
#include "tools/longtrain/commands.h"

namespace {
// LONGTRAIN_DEBUG=1 adds, after an error, the source location that raised it.
bool debug_enabled() {
  const char* v = std::getenv("LONGTRAIN_DEBUG");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}
}  // namespace

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
  } catch (const longtrain::cli::ExitCode& e) {
    return e.code;
  } catch (const longtrain::Error& e) {
    fmt::print(stderr, "longtrain: error: {}\n", e.what());
    // The source location is for whoever debugs longtrain, not for the user.
    if (debug_enabled() && !e.where().empty())
      fmt::print(stderr, "longtrain: debug: raised at {}\n", e.where());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "longtrain: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
