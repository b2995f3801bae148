// `longtrain corpus`: extracts the texts of an R lazy-load database into one .txt file per record.
// The demo corpus is Jane Austen's six novels from Debian's r-cran-janeaustenr (see
// scripts/fetch-corpus.sh, which downloads the package and runs this).
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include "data/rdata.h"
#include "runtime/error.h"
#include "tools/longtrain/commands.h"

namespace longtrain::cli {

namespace fs = std::filesystem;

namespace {

struct CorpusOptions {
  std::string rdb;
  std::string output;
};

void run_corpus(const CorpusOptions& o) {
  const std::vector<data::RdbText> texts = data::read_rdb_texts(o.rdb);
  LT_CHECK(!texts.empty(), "'{}' holds no records", o.rdb);
  fs::create_directories(o.output);
  int64_t total = 0;
  std::vector<std::string> names;
  for (size_t i = 0; i < texts.size(); ++i) {
    const data::RdbText& t = texts[i];
    std::string name = t.slug + ".txt";
    if (std::find(names.begin(), names.end(), name) != names.end())
      name = fmt::format("{}-{:02d}.txt", t.slug, i);
    names.push_back(name);
    // Written under a temporary name and renamed, so a file that exists is complete.
    const fs::path path = fs::path(o.output) / name;
    const fs::path partial = fs::path(path.string() + fmt::format(".partial-{}", ::getpid()));
    {
      std::ofstream out(partial, std::ios::binary);
      out.write(t.text.data(), static_cast<std::streamsize>(t.text.size()));
      out.close();
      LT_CHECK(out.good(), "error writing '{}'", partial.string());
    }
    fs::rename(partial, path);
    total += static_cast<int64_t>(t.text.size());
    fmt::print("{:<28} {:>7} lines {:>9} bytes  {}{}\n", name, t.lines, t.text.size(), t.title,
               t.na_lines ? fmt::format(" ({} NA lines left empty)", t.na_lines) : "");
  }
  fmt::print("{} texts, {:.2f} MB, in {}\n", texts.size(), total / 1e6, o.output);
}

}  // namespace

void add_corpus_command(CLI::App& app) {
  auto o = std::make_shared<CorpusOptions>();
  CLI::App* cmd = app.add_subcommand(
      "corpus", "Extract the texts of an R lazy-load database (e.g. janeaustenr's data/Rdata.rdb) into "
                "one .txt file per record");
  cmd->add_option("rdb", o->rdb, "the .rdb file")->required();
  cmd->add_option("-o,--output", o->output, "directory for the .txt files")->required();
  cmd->callback([o] { run_corpus(*o); });
}

}  // namespace longtrain::cli
