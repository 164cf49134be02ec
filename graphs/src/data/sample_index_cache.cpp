#include "data/sample_index_cache.hpp"

#include <fmt/format.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace weave::graphs::data {

namespace {

constexpr char kMagic[] = "weave GPT sample index 1\n";

std::uint64_t fnv1a(const std::string& text) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

template <typename T>
void put_array(std::ofstream& out, const std::vector<T>& values) {
  const std::uint64_t n = values.size();
  out.write(reinterpret_cast<const char*>(&n), sizeof n);
  out.write(reinterpret_cast<const char*>(values.data()),
            static_cast<std::streamsize>(n * sizeof(T)));
}

// Reads an array at `at`; false when the bytes end first.
template <typename T>
bool get_array(const std::string& bytes, std::size_t& at, std::vector<T>& values) {
  std::uint64_t n = 0;
  if (bytes.size() - at < sizeof n) return false;
  std::memcpy(&n, bytes.data() + at, sizeof n);
  at += sizeof n;
  if ((bytes.size() - at) / sizeof(T) < n) return false;
  values.resize(n);
  std::memcpy(values.data(), bytes.data() + at, n * sizeof(T));
  at += n * sizeof(T);
  return true;
}

bool read_index(const std::string& path, const std::string& description, GptSampleIndex& index) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const std::string head = kMagic + description + '\0';
  if (bytes.compare(0, head.size(), head) != 0) return false;
  std::size_t at = head.size();
  std::vector<std::int32_t> epochs;
  const bool whole = get_array(bytes, at, epochs) && get_array(bytes, at, index.documents) &&
                     get_array(bytes, at, index.samples) && get_array(bytes, at, index.shuffle) &&
                     at == bytes.size();
  if (!whole || epochs.size() != 1 || index.samples.size() != 2 * (index.shuffle.size() + 1))
    return false;
  index.epochs = epochs[0];
  return true;
}

bool write_index(const std::string& path, const std::string& description,
                 const GptSampleIndex& index) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  // Processes of one job may build the same index side by side: each writes its own file.
  const std::string partial = fmt::format("{}.{}.partial", path, ::getpid());
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    if (!out) return false;
    out << kMagic << description << '\0';
    put_array(out, std::vector<std::int32_t>{index.epochs});
    put_array(out, index.documents);
    put_array(out, index.samples);
    put_array(out, index.shuffle);
    out.close();
    if (out.fail()) {
      std::filesystem::remove(partial, ec);
      return false;
    }
  }
  std::filesystem::rename(partial, path, ec);
  return !ec;
}

}  // namespace

CachedIndex cached_gpt_sample_index(const std::string& folder, const std::string& description,
                                    const std::function<GptSampleIndex()>& build,
                                    const std::function<bool(const GptSampleIndex&)>& sound) {
  CachedIndex c;
  c.path = (std::filesystem::path(folder) /
            fmt::format("{:016x}-GPTDataset-indices.bin", fnv1a(description)))
               .string();
  if (read_index(c.path, description, c.index) && sound(c.index)) {
    c.from_cache = true;
    return c;
  }
  c.index = build();
  if (!write_index(c.path, description, c.index)) c.path.clear();
  return c;
}

}  // namespace weave::graphs::data
