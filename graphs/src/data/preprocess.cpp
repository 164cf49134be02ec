#include "weave/graphs/preprocess.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <barrier>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <thread>
#include <utility>

#include "weave/graphs/indexed_dataset.hpp"
#include "weave/graphs/indexed_dataset_writer.hpp"

namespace weave::graphs {

namespace {

// Lines tokenised together: enough to keep the workers busy between writes.
constexpr std::size_t kBatchLines = 2048;

struct Batch {
  std::vector<std::string> lines;
  std::vector<std::uint64_t> numbers;          // each line's number in the input, for messages
  std::vector<std::vector<std::int32_t>> ids;  // [line * keys + key]
};

void tokenize_line(const PreprocessOptions& o, const Tokenizer& tokenizer, Batch& batch,
                   std::size_t line) {
  const std::uint64_t number = batch.numbers[line];
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(batch.lines[line]);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error(
        fmt::format("--input '{}' line {} is not JSON ({}): each line must be one JSON object",
                    o.input, number, e.what()));
  }
  for (std::size_t k = 0; k < o.json_keys.size(); ++k) {
    const auto it = doc.is_object() ? doc.find(o.json_keys[k]) : doc.end();
    if (it == doc.end() || !it->is_string())
      throw std::runtime_error(fmt::format(
          "--input '{}' line {} has no string under \"{}\": every line needs each --json-keys "
          "key holding its text",
          o.input, number, o.json_keys[k]));
    auto& ids = batch.ids[line * o.json_keys.size() + k];
    ids.clear();
    tokenizer.encode(it->get_ref<const std::string&>(), ids);
    if (o.append_eod && !ids.empty()) ids.push_back(tokenizer.eod());
  }
}

// Threads that live for the whole run, so each keeps what its tokenizer caches (GPT-2's merged
// words), tokenising each batch side by side: line i by worker i % workers, worker 0 being the
// calling thread. A barrier starts a batch and another ends it.
class Workers {
 public:
  Workers(const PreprocessOptions& o, const Tokenizer& tokenizer)
      : o_(o),
        tokenizer_(tokenizer),
        sync_(o.workers),
        errors_(static_cast<std::size_t>(o.workers)) {
    for (int w = 1; w < o.workers; ++w)
      threads_.emplace_back([this, w] { loop(static_cast<std::size_t>(w)); });
  }
  ~Workers() {
    stop_ = true;
    sync_.arrive_and_wait();  // releases the workers, which see stop_ and end
  }

  void tokenize(Batch& batch) {
    batch.ids.resize(batch.lines.size() * o_.json_keys.size());
    batch_ = &batch;
    sync_.arrive_and_wait();
    work(0);
    sync_.arrive_and_wait();
    for (auto& e : errors_)
      if (e) std::rethrow_exception(std::exchange(e, nullptr));
  }

 private:
  void loop(std::size_t w) {
    for (;;) {
      sync_.arrive_and_wait();
      if (stop_) return;
      work(w);
      sync_.arrive_and_wait();
    }
  }
  void work(std::size_t w) {
    try {
      for (std::size_t i = w; i < batch_->lines.size(); i += errors_.size())
        tokenize_line(o_, tokenizer_, *batch_, i);
    } catch (...) {
      errors_[w] = std::current_exception();
    }
  }

  const PreprocessOptions& o_;
  const Tokenizer& tokenizer_;
  Batch* batch_ = nullptr;
  std::barrier<> sync_;
  std::atomic<bool> stop_{false};
  std::vector<std::exception_ptr> errors_;
  std::vector<std::jthread> threads_;  // last: joined before the rest is destroyed
};

}  // namespace

PreprocessResult preprocess_jsonl(const PreprocessOptions& o, const Tokenizer& tokenizer) {
  if (o.workers < 1)
    throw std::invalid_argument(fmt::format("--workers must be at least 1 (got {})", o.workers));
  if (o.json_keys.empty())
    throw std::invalid_argument("--json-keys must name at least one key (like text)");
  std::ifstream in(o.input, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("--input '{}': cannot read it", o.input));
  PreprocessResult result;
  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers;
  const TokenType type = token_type_for_vocabulary(tokenizer.vocab_size());
  for (const std::string& key : o.json_keys) {
    result.prefixes.push_back(fmt::format("{}_{}_document", o.output_prefix, key));
    writers.push_back(std::make_unique<IndexedDatasetWriter>(result.prefixes.back(), type));
  }
  Workers workers(o, tokenizer);
  Batch batch;
  std::string line;
  std::uint64_t number = 0;
  for (bool more = true; more;) {
    batch.lines.clear();
    batch.numbers.clear();
    while (batch.lines.size() < kBatchLines && (more = static_cast<bool>(std::getline(in, line)))) {
      result.bytes += line.size() + 1;
      ++number;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
      batch.lines.push_back(line);
      batch.numbers.push_back(number);
    }
    workers.tokenize(batch);
    for (std::size_t i = 0; i < batch.ids.size(); ++i) {
      writers[i % writers.size()]->add_document(batch.ids[i]);
      result.tokens += batch.ids[i].size();
    }
    result.documents += batch.lines.size();
  }
  for (auto& w : writers)
    w->finish();
  return result;
}

}  // namespace weave::graphs
