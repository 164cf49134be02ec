#include "weave/graphs/token_dataset.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace weave::graphs {

namespace {

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Why `bytes` (the contents of `file`) is not text, or "" when it is. Text may hold UTF-8 and a
// few control characters (tab, line breaks, form feed, escape, backspace: the fortunes corpus
// has them); an executable, an archive or an image holds NUL bytes or many other controls.
std::string not_text(const std::string& file, const std::vector<std::uint8_t>& bytes) {
  if (bytes.size() >= 4 && bytes[0] == 0x7f && bytes[1] == 'E' && bytes[2] == 'L' &&
      bytes[3] == 'F')
    return fmt::format("'{}' is an ELF binary (it starts with 0x7F 'ELF')", file);
  const auto nul = std::find(bytes.begin(), bytes.end(), std::uint8_t{0});
  if (nul != bytes.end())
    return fmt::format("'{}' holds NUL bytes (the first at byte {}), which text does not", file,
                       nul - bytes.begin());
  std::size_t controls = 0;
  for (const std::uint8_t b : bytes)
    controls += b < 0x20 && b != '\t' && b != '\n' && b != '\r' && b != '\f' && b != '\v' &&
                b != 0x1b && b != '\b';
  // One in a hundred: the fortunes corpus has one in ten thousand, a binary one in a few.
  if (controls * 100 > bytes.size())
    return fmt::format("'{}' is {:.0f}% control bytes, which text is not", file,
                       100.0 * static_cast<double>(controls) / static_cast<double>(bytes.size()));
  return {};
}

// The bytes of `file` (none when it cannot be read), read in one call: copying them one by one
// through a stream iterator took twice as long for a gigabyte (9.1 s against 4.3 s), and ten
// times as long in a build without -O3.
std::vector<std::uint8_t> read_whole(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(file, ec);
  std::vector<std::uint8_t> bytes(in && !ec ? size : 0);
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  bytes.resize(static_cast<std::size_t>(in.gcount()));
  return bytes;
}

}  // namespace

TokenDataset TokenDataset::from_text(const std::string& path, int seq_length,
                                     double valid_fraction) {
  if (seq_length < 1)
    throw std::invalid_argument(fmt::format(
        "a text dataset's sequence length must be at least 1 (got {}): set --seq-length",
        seq_length));
  if (!(valid_fraction >= 0 && valid_fraction < 1))
    throw std::invalid_argument(
        fmt::format("the validation fraction of '{}' must be at least 0 and less than 1 (got {}): "
                    "it is the share of the text held out for evaluation",
                    path, valid_fraction));
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& entry : fs::recursive_directory_iterator(path, ec)) {
      const std::string ext = entry.path().extension().string();
      if (entry.is_regular_file() && ext != ".dat" && ext != ".u8") files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
  } else if (fs::is_regular_file(path, ec)) {
    files.push_back(path);
  }
  if (files.empty())
    throw std::runtime_error(fmt::format(
        "--data-path '{}': no such file or folder of text files (use --mock-data for synthetic "
        "tokens)",
        path));
  std::vector<std::uint8_t> bytes;
  for (const auto& f : files) {
    const std::vector<std::uint8_t> file = read_whole(f);
    if (const std::string why = not_text(f.string(), file); !why.empty())
      throw std::runtime_error(fmt::format(
          "--data-path {}: weave trains on the bytes of text files; name a text file or a folder "
          "of them (or use --mock-data)",
          f.string() == path ? why : fmt::format("'{}': {}", path, why)));
    bytes.insert(bytes.end(), file.begin(), file.end());
  }
  const auto valid = static_cast<std::size_t>(static_cast<double>(bytes.size()) * valid_fraction);
  const std::size_t need = 2 * (static_cast<std::size_t>(seq_length) + 1);
  if (bytes.size() - valid < need || (valid > 0 && valid < need))
    throw std::runtime_error(fmt::format(
        "--data-path '{}' holds {} bytes: too little for training and validation windows of "
        "--seq-length {} + 1",
        path, bytes.size(), seq_length));
  TokenDataset d;
  d.valid_.assign(bytes.end() - static_cast<std::ptrdiff_t>(valid), bytes.end());
  bytes.resize(bytes.size() - valid);
  d.train_ = std::move(bytes);
  d.seq_length_ = seq_length;
  d.description_ = fmt::format("{} ({} file{}, {:.1f} MB, byte tokens)", path, files.size(),
                               files.size() == 1 ? "" : "s",
                               static_cast<double>(d.train_.size() + d.valid_.size()) * 1e-6);
  return d;
}

TokenDataset TokenDataset::mock(int seq_length, std::uint64_t seed) {
  TokenDataset d;
  d.mock_ = true;
  d.seq_length_ = seq_length;
  d.seed_ = seed;
  d.description_ = "mock data (a fixed cycle through 32 tokens)";
  std::vector<std::int32_t> order(256);
  for (int i = 0; i < 256; ++i)
    order[i] = i;
  for (int i = 255; i > 0; --i)  // Fisher-Yates with the seeded mixer
    std::swap(order[i], order[mix(seed + static_cast<std::uint64_t>(i)) % (i + 1)]);
  order.resize(32);
  d.successor_.assign(256, 0);
  for (std::size_t i = 0; i < order.size(); ++i)
    d.successor_[order[i]] = order[(i + 1) % order.size()];
  d.cycle_start_ = order;
  return d;
}

std::size_t TokenDataset::tokens(Split split) const {
  if (mock_) return std::size_t{1} << 40;
  return split == Split::train ? train_.size() : valid_.size();
}

void TokenDataset::sample(Split split, std::uint64_t index, std::vector<std::int32_t>& out) const {
  const auto n = static_cast<std::size_t>(seq_length_) + 1;
  out.resize(n);
  const std::uint64_t key = mix(index * 2 + (split == Split::valid ? 1 : 0) + seed_);
  if (mock_) {
    // A walk round a fixed cycle of 32 of the 256 tokens from a random start: each token
    // determines the next, so a model learns it quickly (the loss heads towards 0).
    auto t = cycle_start_[key % cycle_start_.size()];
    for (std::size_t i = 0; i < n; ++i, t = successor_[static_cast<std::size_t>(t)])
      out[i] = t;
    return;
  }
  const auto& bytes = split == Split::train ? train_ : valid_;
  const std::size_t start = static_cast<std::size_t>(key % (bytes.size() - n + 1));
  for (std::size_t i = 0; i < n; ++i)
    out[i] = bytes[start + i];
}

}  // namespace weave::graphs
