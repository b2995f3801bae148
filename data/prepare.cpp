#include "data/prepare.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <unistd.h>
#include <zlib.h>

#include <nlohmann/json.hpp>

#include "data/documents.h"
#include "data/progress.h"
#include "data/shards.h"
#include "data/tokenizer.h"
#include "runtime/error.h"

namespace longtrain::data {

namespace fs = std::filesystem;

std::vector<int64_t> validation_documents(int64_t documents, double val_fraction) {
  LT_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, "--val-fraction {} must be in [0, 1)", val_fraction);
  std::vector<int64_t> val;
  if (val_fraction == 0.0) return val;
  LT_CHECK(documents >= 2, "--val-fraction {} needs at least 2 documents (one for each split); the "
           "inputs hold {}", val_fraction, documents);
  const int64_t k = std::clamp<int64_t>(std::llround(val_fraction * static_cast<double>(documents)), 1,
                                        documents - 1);
  for (int64_t j = 0; j < k; ++j)
    val.push_back(static_cast<int64_t>((static_cast<double>(j) + 0.5) * static_cast<double>(documents) /
                                       static_cast<double>(k)));
  return val;
}

namespace {

uint32_t file_crc32(const std::string& path) {
  const std::string bytes = read_file(path);
  return static_cast<uint32_t>(::crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()),
                                       static_cast<uInt>(bytes.size())));
}

// A batch of consecutive documents: the unit of work of the tokenizer threads.
struct Job {
  int64_t seq = 0;
  int64_t first_document = 0;
  int64_t bytes_end = 0;  // input bytes read once this batch was read (for progress)
  std::vector<std::string> texts;
};

struct Encoded {
  int64_t first_document = 0;
  int64_t bytes_end = 0;
  std::vector<std::vector<uint32_t>> tokens;
};

// The reader (this thread) -> tokenizer threads -> writer thread pipeline. Results are written in
// batch order; at most `max_in_flight` batches are read but not yet written, which bounds memory.
class Pipeline {
 public:
  Pipeline(const Tokenizer& tok, const PrepareOptions& o, int threads, ShardWriter& train, ShardWriter& val,
           const std::vector<int64_t>& val_docs, ProgressBar& progress)
      : tok_(tok), o_(o), train_(train), val_(val), val_docs_(val_docs), progress_(progress),
        max_in_flight_(4 * threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { guarded([this] { work(); }); });
    writer_ = std::thread([this] { guarded([this] { write(); }); });
  }

  ~Pipeline() {
    {
      std::lock_guard lock(m_);
      reading_done_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
    if (writer_.joinable()) writer_.join();
  }

  // Reads every document, waits for the threads and rethrows the first error of any of them.
  int64_t run(DocumentReader& reader) {
    int64_t documents = 0;
    guarded([&] {
      // Small enough that a few large documents (books) still spread over the threads.
      constexpr size_t kBatchBytes = size_t{256} << 10;
      constexpr size_t kBatchDocuments = 1024;
      Job job;
      size_t bytes = 0;
      std::string text;
      while (!failed() && reader.next(text)) {
        bytes += text.size();
        job.texts.push_back(std::move(text));
        ++documents;
        if (bytes >= kBatchBytes || job.texts.size() >= kBatchDocuments) {
          job.bytes_end = reader.bytes_read();
          submit(std::move(job));
          job = Job{};
          job.first_document = documents;
          bytes = 0;
        }
      }
      if (!job.texts.empty()) {
        job.bytes_end = reader.bytes_read();
        submit(std::move(job));
      }
    });
    {
      std::lock_guard lock(m_);
      reading_done_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    writer_.join();
    if (error_) std::rethrow_exception(error_);
    return documents;
  }

 private:
  template <class F> void guarded(F&& f) {
    try {
      f();
    } catch (...) {
      std::lock_guard lock(m_);
      if (!error_) error_ = std::current_exception();
      cv_.notify_all();
    }
  }
  bool failed() {
    std::lock_guard lock(m_);
    return error_ != nullptr;
  }

  void submit(Job job) {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return error_ || submitted_ - written_ < max_in_flight_; });
    if (error_) return;
    job.seq = submitted_++;
    jobs_.push_back(std::move(job));
    cv_.notify_all();
  }

  void work() {
    while (true) {
      Job job;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return error_ || !jobs_.empty() || reading_done_; });
        if (error_ || jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      Encoded out;
      out.first_document = job.first_document;
      out.bytes_end = job.bytes_end;
      out.tokens.resize(job.texts.size());
      for (size_t i = 0; i < job.texts.size(); ++i) {
        if (job.texts[i].empty()) continue;  // an empty document is not written at all
        const std::vector<int32_t> ids = tok_.encode(job.texts[i]);
        std::vector<uint32_t>& t = out.tokens[i];
        t.reserve(ids.size() + 2);
        if (o_.add_bos) t.push_back(static_cast<uint32_t>(tok_.bos_id()));
        for (int32_t id : ids) t.push_back(static_cast<uint32_t>(id));
        if (o_.add_eos) t.push_back(static_cast<uint32_t>(tok_.eos_id()));
      }
      std::lock_guard lock(m_);
      done_.emplace(job.seq, std::move(out));
      cv_.notify_all();
    }
  }

  void write() {
    while (true) {
      Encoded batch;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] {
          return error_ || done_.count(written_) || (reading_done_ && written_ == submitted_);
        });
        if (error_ || !done_.count(written_)) return;
        auto it = done_.find(written_);
        batch = std::move(it->second);
        done_.erase(it);
      }
      for (size_t i = 0; i < batch.tokens.size(); ++i) {
        const int64_t d = batch.first_document + static_cast<int64_t>(i);
        const bool is_val = std::binary_search(val_docs_.begin(), val_docs_.end(), d);
        (is_val ? val_ : train_).add_document(batch.tokens[i]);
      }
      progress_.update(batch.bytes_end);
      std::lock_guard lock(m_);
      ++written_;
      cv_.notify_all();
    }
  }

  const Tokenizer& tok_;
  const PrepareOptions& o_;
  ShardWriter& train_;
  ShardWriter& val_;
  const std::vector<int64_t>& val_docs_;
  ProgressBar& progress_;
  const int64_t max_in_flight_;

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::map<int64_t, Encoded> done_;
  int64_t submitted_ = 0, written_ = 0;
  bool reading_done_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
  std::thread writer_;
};

nlohmann::json split_json(const std::vector<ShardInfo>& shards, const ShardWriter& w) {
  nlohmann::json list = nlohmann::json::array();
  for (const ShardInfo& s : shards)
    list.push_back({{"bin", s.bin}, {"idx", s.idx}, {"documents", s.documents}, {"tokens", s.tokens}});
  return {{"documents", w.documents()}, {"tokens", w.tokens()}, {"shards", list}};
}

}  // namespace

PrepareSummary prepare_corpus(const PrepareOptions& o) {
  LT_CHECK(!o.output.empty(), "prepare: --output DIR is required");
  LT_CHECK(o.threads >= 0, "prepare: --threads {} must be >= 0 (0: all cores)", o.threads);
  LT_CHECK(o.shard_tokens > 0, "prepare: --shard-tokens {} must be positive", o.shard_tokens);
  LT_CHECK(o.val_fraction >= 0.0 && o.val_fraction < 1.0, "prepare: --val-fraction {} must be in [0, 1)",
           o.val_fraction);
  fs::path output = fs::path(o.output).lexically_normal();
  if (!output.has_filename()) output = output.parent_path();  // "shards/" -> "shards"
  LT_CHECK(o.overwrite || !fs::exists(output),
           "prepare: output '{}' already exists: pass --overwrite to replace it", output.string());

  const Tokenizer tok(o.tokenizer);
  LT_CHECK(!o.add_bos || tok.bos_id() >= 0, "prepare: tokenizer '{}' has no BOS token; do not ask for one",
           o.tokenizer);
  LT_CHECK(!o.add_eos || tok.eos_id() >= 0, "prepare: tokenizer '{}' has no EOS token; pass --no-eos",
           o.tokenizer);
  std::vector<InputFile> inputs = list_inputs(o.inputs);
  count_documents(inputs);
  int64_t documents = 0, total_bytes = 0;
  for (const InputFile& f : inputs) {
    documents += f.documents;
    total_bytes += f.bytes;
  }
  const std::vector<int64_t> val_docs = validation_documents(documents, o.val_fraction);
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  // Everything goes into a directory beside the output and is renamed into place when complete.
  if (output.has_parent_path()) fs::create_directories(output.parent_path());
  const fs::path partial = fs::path(output.string() + fmt::format(".partial-{}", ::getpid()));
  fs::remove_all(partial);
  fs::create_directories(partial);

  PrepareSummary summary;
  try {
    ShardWriter train(partial.string(), "train", tok.vocab_size(), o.shard_tokens);
    ShardWriter val(partial.string(), "val", tok.vocab_size(), o.shard_tokens);
    ProgressBar progress("prepare", total_bytes, o.progress);
    DocumentReader reader(inputs, o.text_key);
    Pipeline pipeline(tok, o, threads, train, val, val_docs, progress);
    const int64_t read = pipeline.run(reader);
    progress.finish();
    LT_CHECK(read == documents, "prepare: the inputs changed while they were read ({} documents counted, "
             "{} read)", documents, read);
    const std::vector<ShardInfo> train_shards = train.finish();
    const std::vector<ShardInfo> val_shards = val.finish();
    LT_CHECK(train.tokens() > 0, "prepare: the inputs ({} file(s), first '{}') hold no text for the train "
             "split", inputs.size(), inputs.front().path);

    nlohmann::json manifest;
    manifest["format"] = "longtrain-shards";
    manifest["version"] = kManifestVersion;
    manifest["vocab_size"] = tok.vocab_size();
    manifest["dtype"] = "uint32";
    manifest["tokenizer"] = {{"path", o.tokenizer},     {"crc32", file_crc32(o.tokenizer)},
                             {"vocab_size", tok.vocab_size()}, {"bos_id", tok.bos_id()},
                             {"eos_id", tok.eos_id()},   {"add_bos", o.add_bos},
                             {"add_eos", o.add_eos}};
    manifest["text_key"] = o.text_key;
    manifest["val_fraction"] = o.val_fraction;
    manifest["documents_read"] = documents;
    nlohmann::json in = nlohmann::json::array();
    for (const InputFile& f : inputs)
      in.push_back({{"path", f.path}, {"bytes", f.bytes}, {"documents", f.documents}});
    manifest["inputs"] = in;
    manifest["splits"]["train"] = split_json(train_shards, train);
    if (val.tokens() > 0) manifest["splits"]["val"] = split_json(val_shards, val);
    {
      const fs::path mpath = partial / kManifestName;
      std::ofstream out(mpath);
      out << manifest.dump(2) << "\n";
      out.close();
      LT_CHECK(out.good(), "prepare: error writing '{}'", mpath.string());
    }

    if (fs::exists(output)) {
      const fs::path old = fs::path(output.string() + fmt::format(".old-{}", ::getpid()));
      fs::rename(output, old);
      fs::rename(partial, output);
      fs::remove_all(old);
    } else {
      fs::rename(partial, output);
    }

    summary.input_bytes = total_bytes;
    summary.documents = documents;
    summary.train_documents = train.documents();
    summary.train_tokens = train.tokens();
    summary.val_documents = val.documents();
    summary.val_tokens = val.tokens();
    summary.vocab_size = tok.vocab_size();
    summary.threads = threads;
    summary.seconds = progress.seconds();
  } catch (...) {
    std::error_code ec;
    fs::remove_all(partial, ec);
    throw;
  }
  return summary;
}

}  // namespace longtrain::data
