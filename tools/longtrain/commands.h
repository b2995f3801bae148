// Subcommands of the `longtrain` CLI. Each file registers its own with one function, so commands
// are added (train, eval, generate, ...) without touching the others; main.cpp calls them all.
// A command's callback throws longtrain::Error on bad input; main prints it and exits with 1.
#pragma once

namespace CLI {
class App;
}

namespace longtrain::cli {

// Thrown by a command that ends without an error but with an exit status other than 0 (train stopped
// by SIGTERM/SIGINT after its checkpoint: parallel::kExitPreempted); main returns `code`.
struct ExitCode {
  int code;
};

// `longtrain corpus RDB --output DIR`: R lazy-load database (Debian's r-cran-janeaustenr
// data/Rdata.rdb) -> one .txt per record (corpus_command.cpp).
void add_corpus_command(CLI::App& app);

// `longtrain tokenizer train|encode|decode` (tokenizer_commands.cpp).
void add_tokenizer_commands(CLI::App& app);

// `longtrain prepare`: text -> token shards (prepare_command.cpp).
void add_prepare_command(CLI::App& app);

// `longtrain train`, `eval`, `generate` and `schema` (train_commands.cpp).
void add_train_commands(CLI::App& app);

}  // namespace longtrain::cli
