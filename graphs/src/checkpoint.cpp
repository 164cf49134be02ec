#include "weave/graphs/checkpoint.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

namespace weave::graphs {

namespace {

using nlohmann::json;

constexpr char kMagic[] = "WEAVE-CHECKPOINT-1\n";
constexpr std::size_t kMagicSize = sizeof(kMagic) - 1;

json describe(const ModelConfig& m) {
  return {{"num_layers", m.num_layers},
          {"hidden_size", m.hidden_size},
          {"num_attention_heads", m.num_attention_heads},
          {"ffn_hidden_size", m.ffn_hidden_size},
          {"seq_length", m.seq_length},
          {"max_position_embeddings", m.positions()},
          {"vocab_size", m.vocab_size},
          {"make_vocab_size_divisible_by", m.make_vocab_size_divisible_by},
          {"swiglu", m.activation == Activation::swiglu},
          {"num_experts", m.num_experts},
          {"moe_layer_freq", m.moe_layer_freq}};
}

json describe(const ParallelPlan& p) {
  return {{"tensor_model_parallel_size", p.tensor_parallel},
          {"sequence_parallel", p.sequence_parallel},
          {"context_parallel_size", p.context_parallel},
          {"expert_model_parallel_size", p.expert_parallel},
          {"data_parallel_size", p.data_parallel},
          {"pipeline_model_parallel_size", p.pipeline_parallel},
          {"use_distributed_optimizer", p.distributed_optimizer}};
}

std::uint64_t fnv1a(const char* data, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
  for (std::size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 1099511628211ull;
  }
  return h;
}

// Each saved tensor: which rank, which parameter, which of its tensors.
struct Entry {
  int rank;
  std::string name;
  std::string part;  // value, exp_avg, exp_avg_sq
  ops::Tensor tensor;
};

std::vector<Entry> entries_of(TrainingStep& step) {
  if (!step.materialized())
    throw std::invalid_argument(
        "a step built without tensors (StepBuildOptions::materialize = false) has no values to "
        "save or load; build it with tensors");
  for (int r = 0; r < step.mesh().size(); ++r)
    if (!step.holds(r))
      throw std::invalid_argument(fmt::format(
          "a checkpoint holds every rank's shard and rank {} is not built in this step; build "
          "every rank (StepBuildOptions::ranks empty)",
          r));
  std::vector<Entry> out;
  for (int r = 0; r < step.mesh().size(); ++r) {
    for (Parameter& p : step.shard(r).parameters())
      out.push_back({r, p.name, "value", p.value});
    for (GradientBucket& b : step.shard(r).buckets()) {
      out.push_back({r, b.name, "exp_avg", b.exp_avg});
      out.push_back({r, b.name, "exp_avg_sq", b.exp_avg_sq});
    }
  }
  return out;
}

std::string differences(const json& saved, const json& now) {
  std::string out;
  for (const auto& [key, value] : now.items()) {
    if (!saved.contains(key) || saved[key] != value)
      out += fmt::format("{}{} is {} in the checkpoint but {} now", out.empty() ? "" : "; ", key,
                         saved.contains(key) ? saved[key].dump() : "absent", value.dump());
  }
  return out;
}

// fsync of a file or folder by name.
void sync_to_disk(const std::string& name) {
  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int error = errno;
    if (fd >= 0) ::close(fd);
    throw std::runtime_error(fmt::format("cannot flush '{}' to disk while saving a checkpoint: {}",
                                         name, std::strerror(error)));
  }
  ::close(fd);
}

// A header that parses as JSON but is not what save_checkpoint writes.
class DamagedHeader : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A whole-number field of the header. JSON may hold 1e300 there, which no integer type holds.
template <typename Integer>
Integer whole_number(const json& object, const char* key) {
  const json& value = object.at(key);
  if (!value.is_number_integer())
    throw DamagedHeader(fmt::format("'{}' is {}, not a whole number", key, value.dump()));
  return value.get<Integer>();
}

// The rest of load_checkpoint, once the header is parsed.
CheckpointState load_with_header(const std::string& path, const json& header, std::ifstream& in,
                                 const ModelConfig& model, const ParallelPlan& plan,
                                 TrainingStep& step) {
  if (!header.is_object()) throw DamagedHeader("it is not a JSON object");
  if (const std::string diff = differences(header.value("model", json::object()), describe(model));
      !diff.empty())
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' holds another model: {}. Load it with the model flags it was saved with",
        path, diff));
  if (const std::string diff = differences(header.value("plan", json::object()), describe(plan));
      !diff.empty())
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' was saved with another parallel layout: {}. Resume with the layout it was "
        "saved with",
        path, diff));
  const std::vector<Entry> entries = entries_of(step);
  const json& tensors = header.at("tensors");
  if (!tensors.is_array()) throw DamagedHeader("'tensors' is not a list");
  if (tensors.size() != entries.size())
    throw std::runtime_error(fmt::format("checkpoint '{}' holds {} tensors, the model has {}", path,
                                         tensors.size(), entries.size()));
  // Read everything and verify before touching the model.
  std::vector<std::vector<float>> data(entries.size());
  std::uint64_t checksum = 1469598103934665603ull;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const json& t = tensors[i];
    const Entry& e = entries[i];
    if (whole_number<std::int64_t>(t, "rank") != e.rank ||
        t.at("name").get<std::string>() != e.name || t.at("part").get<std::string>() != e.part ||
        whole_number<std::int64_t>(t, "numel") != e.tensor.numel())
      throw std::runtime_error(
          fmt::format("checkpoint '{}': tensor {} is {} {} of rank {} ({} elements), the model "
                      "expects {} {} of "
                      "rank {} ({} elements)",
                      path, i, t.value("name", "?"), t.value("part", "?"), t.value("rank", -1),
                      t.value("numel", -1), e.name, e.part, e.rank, e.tensor.numel()));
    data[i].resize(static_cast<std::size_t>(e.tensor.numel()));
    in.read(reinterpret_cast<char*>(data[i].data()),
            static_cast<std::streamsize>(data[i].size() * sizeof(float)));
    if (!in) throw std::runtime_error(fmt::format("checkpoint '{}' is truncated", path));
    checksum = fnv1a(reinterpret_cast<const char*>(data[i].data()), data[i].size() * sizeof(float),
                     checksum);
  }
  if (checksum != whole_number<std::uint64_t>(header, "checksum"))
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is damaged: its checksum does not match", path));
  for (std::size_t i = 0; i < entries.size(); ++i)
    std::copy(data[i].begin(), data[i].end(), entries[i].tensor.data());
  return {whole_number<std::int64_t>(header, "iteration"),
          whole_number<std::uint64_t>(header, "consumed_samples")};
}

}  // namespace

void save_checkpoint(const std::string& path, const ModelConfig& model, const ParallelPlan& plan,
                     TrainingStep& step, const CheckpointState& state) {
  const std::vector<Entry> entries = entries_of(step);
  json header{{"model", describe(model)},
              {"plan", describe(plan)},
              {"iteration", state.iteration},
              {"consumed_samples", state.consumed_samples}};
  json tensors = json::array();
  std::uint64_t checksum = 1469598103934665603ull;
  for (const Entry& e : entries) {
    tensors.push_back(
        {{"rank", e.rank}, {"name", e.name}, {"part", e.part}, {"numel", e.tensor.numel()}});
    checksum = fnv1a(reinterpret_cast<const char*>(e.tensor.data()),
                     static_cast<std::size_t>(e.tensor.numel()) * sizeof(float), checksum);
  }
  header["tensors"] = tensors;
  header["checksum"] = checksum;
  const std::string text = header.dump();
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    if (!out)
      throw std::runtime_error(
          fmt::format("cannot write checkpoint '{}': check that the directory "
                      "exists and is writable",
                      partial));
    out.write(kMagic, kMagicSize);
    const std::uint64_t size = text.size();
    out.write(reinterpret_cast<const char*>(&size), sizeof size);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const Entry& e : entries)
      out.write(reinterpret_cast<const char*>(e.tensor.data()),
                static_cast<std::streamsize>(e.tensor.numel() * sizeof(float)));
    out.flush();
    if (!out)
      throw std::runtime_error(fmt::format("writing checkpoint '{}' failed (disk full?)", partial));
  }
  // The data reaches the disk before the rename makes it the checkpoint, and the rename before
  // save returns: after a crash or a power loss the name holds the old checkpoint or the new one.
  sync_to_disk(partial);
  std::filesystem::rename(partial, path);
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  sync_to_disk(folder.empty() ? std::string(".") : folder.string());
}

CheckpointState load_checkpoint(const std::string& path, const ModelConfig& model,
                                const ParallelPlan& plan, TrainingStep& step) {
  std::ifstream in(path, std::ios::binary);
  std::error_code size_error;
  const std::uintmax_t file_size = std::filesystem::file_size(path, size_error);
  if (!in || size_error) throw std::runtime_error(fmt::format("cannot open checkpoint '{}'", path));
  char magic[kMagicSize];
  in.read(magic, kMagicSize);
  if (!in || std::memcmp(magic, kMagic, kMagicSize) != 0)
    throw std::runtime_error(
        fmt::format("'{}' is not a weave checkpoint (its first bytes differ)", path));
  std::uint64_t size = 0;
  in.read(reinterpret_cast<char*>(&size), sizeof size);
  // The header must fit in the file: a damaged size must not make this allocate gigabytes.
  if (!in || size > file_size - kMagicSize - sizeof size)
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' is damaged: its header size ({} bytes) runs past the end of the file",
        path, size));
  std::string text(size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("checkpoint '{}' is damaged: {}", path, e.what()));
  }
  // The checksum covers the tensors, not the header: a header field that is missing or of the
  // wrong kind is damage, reported as such.
  try {
    return load_with_header(path, header, in, model, plan, step);
  } catch (const json::exception& e) {
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is damaged: its header is not as saved ({})", path, e.what()));
  } catch (const DamagedHeader& e) {
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is damaged: its header is not as saved ({})", path, e.what()));
  }
}

}  // namespace weave::graphs
