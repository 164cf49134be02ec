#include "weave/graphs/checkpoint.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "model/half_precision.hpp"
#include "weave/graphs/config_flags.hpp"
#include "weave/graphs/moe_layer_freq.hpp"

namespace weave::graphs {

namespace {

using nlohmann::json;

constexpr char kMagic[] = "WEAVE-CHECKPOINT-1\n";
constexpr std::size_t kMagicSize = sizeof(kMagic) - 1;
// A checkpoint saved by several processes: the manifest at the checkpoint's path, and each
// process's part (both begin with a magic line of the same length as kMagic).
constexpr char kManifestMagic[] = "WEAVE-CHECKPOINT-M\n";
constexpr char kPartMagic[] = "WEAVE-CHECKPOINT-P\n";
static_assert(sizeof(kManifestMagic) == sizeof(kMagic) && sizeof(kPartMagic) == sizeof(kMagic));

// The settings of `section` that a checkpoint's header holds (config_flags.hpp marks them).
json describe_section(const TrainerConfig& config, DescribedSection section) {
  json out = json::object();
  for (const DescribedSetting& s : describe_configuration(config, DescribedSettings::checkpointed))
    if (s.section == section) std::visit([&](const auto& value) { out[s.key] = value; }, s.value);
  return out;
}

json describe(const ModelConfig& m) {
  TrainerConfig config;
  config.model = m;
  return describe_section(config, DescribedSection::model);
}

// The settings of `section` in a header saved before some of them existed: each one the flag
// table marks as added later, when missing, as `defaults` describe it.
json with_defaults(json saved, DescribedSection section, const TrainerConfig& defaults) {
  if (!saved.is_object()) return saved;
  const json implied = describe_section(defaults, section);
  for (const ConfigFlag& f : config_flags()) {
    const FlagDescription& d = f.description;
    if (d.section != section || !d.absent_from_older_checkpoints) continue;
    const std::string key(d.key);
    if (!saved.contains(key)) saved[key] = implied.at(key);
  }
  return saved;
}

// The model as a checkpoint saved before a field existed describes it: the field's default.
json with_defaults(json saved, const ModelConfig& m) {
  TrainerConfig defaults;
  defaults.model = ModelConfig{.num_attention_heads = m.num_attention_heads};
  // Before --moe-ffn-hidden-size the experts were --ffn-hidden-size wide: the saved one's.
  if (saved.is_object() && !saved.contains("moe_ffn_hidden_size") &&
      saved.contains("ffn_hidden_size") && saved["ffn_hidden_size"].is_number_integer())
    defaults.model.ffn_hidden_size = saved["ffn_hidden_size"].get<int>();
  // Before --kv-channels every head was hidden / heads wide: the saved ones'.
  if (saved.is_object() && !saved.contains("kv_channels") && saved.contains("hidden_size") &&
      saved["hidden_size"].is_number_integer()) {
    const int heads =
        saved.contains("num_attention_heads") && saved["num_attention_heads"].is_number_integer()
            ? saved["num_attention_heads"].get<int>()
            : m.num_attention_heads;
    if (heads > 0) saved["kv_channels"] = saved["hidden_size"].get<int>() / heads;
  }
  return with_defaults(std::move(saved), DescribedSection::model, defaults);
}

json describe(const ParallelPlan& p) {
  TrainerConfig config;
  config.plan = p;
  return describe_section(config, DescribedSection::plan);
}

// The layout as a checkpoint saved before a field existed describes it: the field's default.
json plan_with_defaults(json saved) {
  return with_defaults(std::move(saved), DescribedSection::plan, TrainerConfig{});
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

// Bucket `name` of rank `device`'s shard; the replicas' moments of a checkpoint loaded across
// layouts must all be built in this process.
GradientBucket& bucket_of_rank(TrainingStep& step, rt::DeviceId device, const std::string& name) {
  const int rank = static_cast<int>(device);
  if (!step.holds(rank))
    throw std::invalid_argument(fmt::format(
        "bucket {} is sharded over replicas that are not all in this process (rank {} is not): "
        "a checkpoint saved with --use-distributed-optimizer (ZeRO stages 1 to 3) and loaded "
        "without it puts every replica's AdamW moments end to end, so load it with one process, "
        "or with --use-distributed-optimizer",
        name, rank));
  for (GradientBucket& b : step.shard(rank).buckets())
    if (b.name == name) return b;
  throw std::logic_error(fmt::format("rank {} has no gradient bucket {}", rank, name));
}

// Whether the step keeps parameters as the replicas' shards (GradientBucket::value_shard): ZeRO
// stage 3's layers, and a 16-bit run's every bucket under the distributed optimizer (its fp32
// main values). The same in every process.
bool keeps_parameter_shards(TrainingStep& step) {
  const ParallelPlan& plan = step.mesh().plan();
  if (plan.shard_parameters) return true;
  if (!plan.distributed_optimizer) return false;
  for (int r = 0; r < step.mesh().size(); ++r)
    if (step.holds(r)) return step.shard(r).config().precision != Precision::fp32;
  return false;
}

// Parameters kept as shards over several processes: the parameter shards of the ranks other
// processes build, by rank and bucket, which a checkpoint's whole parameters are assembled from.
// Each process sends its ranks' shards to process 0, which sends them all to every process:
// every process makes this exchange, in the same order. Empty in one process, or without shards.
using ShardsElsewhere = std::map<std::pair<int, std::string>, ops::Tensor>;

ShardsElsewhere parameter_shards_elsewhere(TrainingStep& step) {
  ShardsElsewhere out;
  devices::ProcessSet& processes = step.processes();
  if (processes.size() == 1 || !keeps_parameter_shards(step)) return out;
  std::string mine;
  const auto put = [&mine](const void* at, std::size_t bytes) {
    mine.append(static_cast<const char*>(at), bytes);
  };
  for (int r = 0; r < step.mesh().size(); ++r) {
    if (!step.holds(r)) continue;
    for (GradientBucket& b : step.shard(r).buckets()) {
      if (!b.value_shard.defined()) continue;
      const std::int64_t rank = r, name_size = static_cast<std::int64_t>(b.name.size()),
                         count = b.value_shard.numel();
      put(&rank, sizeof rank);
      put(&name_size, sizeof name_size);
      put(b.name.data(), b.name.size());
      put(&count, sizeof count);
      put(b.value_shard.data(), static_cast<std::size_t>(count) * sizeof(float));
    }
  }
  std::string all;
  for (const std::string& part : processes.gather(mine))
    all += part;
  all = processes.broadcast(all);
  std::size_t at = 0;
  const auto take = [&all, &at](void* to, std::size_t bytes) {
    if (at + bytes > all.size())
      throw std::logic_error("the processes' parameter shards ended part-way through one");
    std::memcpy(to, all.data() + at, bytes);
    at += bytes;
  };
  while (at < all.size()) {
    std::int64_t rank = 0, name_size = 0, count = 0;
    take(&rank, sizeof rank);
    take(&name_size, sizeof name_size);
    std::string name(static_cast<std::size_t>(name_size), '\0');
    take(name.data(), name.size());
    take(&count, sizeof count);
    const ops::Tensor shard = ops::Tensor::zeros({count});
    take(shard.data(), static_cast<std::size_t>(count) * sizeof(float));
    if (!step.holds(static_cast<int>(rank)))
      out.emplace(std::pair{static_cast<int>(rank), std::move(name)}, shard);
  }
  return out;
}

// Rank `device`'s parameter shard of bucket `name`: in this process's step, or as exchanged.
ops::Tensor parameter_shard(TrainingStep& step, const ShardsElsewhere& elsewhere,
                            rt::DeviceId device, const std::string& name) {
  const int rank = static_cast<int>(device);
  if (step.holds(rank)) return bucket_of_rank(step, device, name).value_shard;
  const auto found = elsewhere.find({rank, name});
  if (found == elsewhere.end())
    throw std::logic_error(
        fmt::format("no process sent rank {}'s parameter shard of bucket {}", rank, name));
  return found->second;
}

// The tensors a checkpoint holds, and the copies that take them, once loaded, where the step
// keeps them when that is not in the tensors themselves.
struct Entries {
  std::vector<Entry> list;
  std::vector<std::pair<ops::Tensor, ops::Tensor>> after_load;  // (to, from)
  // (to, from): a 16-bit copy rounded from the values loaded, where the step keeps no fp32 values
  // whole (GradientBucket::main_values_sharded, and stage 3's value_shard16); in `precision`.
  std::vector<std::pair<ops::Bf16Tensor, ops::Tensor>> rounded_after_load;
  Precision precision = Precision::fp32;
  void apply_after_load() const {
    for (const auto& [to, from] : after_load)
      to.copy_from(from);
    for (const auto& [to, from] : rounded_after_load)
      round_to_half(precision, from, to);
  }
};

// The tensors of the ranks built here: every rank for a checkpoint of one process, this
// process's ranks for its part of a checkpoint of several. Parameters are whole in every layout:
// where the step keeps them as shards (keeps_parameter_shards) each sharded bucket's values are
// assembled from its replicas' shards, those of other processes' ranks exchanged first (and
// loaded back into this replica's, and into a 16-bit run's whole 16-bit copy). The AdamW
// moments are each replica's shard when `moments_sharded` (the distributed optimizer's layout, ZeRO
// stages 1 to 3), else whole (plain data parallelism): converted when the step keeps them the other
// way, every replica's whole moments being equal.
Entries entries_of(TrainingStep& step, bool moments_sharded) {
  if (!step.materialized())
    throw std::invalid_argument(
        "a step built without tensors (StepBuildOptions::materialize = false) has no values to "
        "save or load; build it with tensors");
  const bool one_process = step.processes().size() == 1;
  for (int r = 0; r < step.mesh().size() && one_process; ++r)
    if (!step.holds(r))
      throw std::invalid_argument(fmt::format(
          "a checkpoint holds every rank's shard and rank {} is not built in this step; build "
          "every rank (StepBuildOptions::ranks empty)",
          r));
  const ShardsElsewhere elsewhere = parameter_shards_elsewhere(step);
  Entries out;
  for (int r = 0; r < step.mesh().size(); ++r) {
    if (!step.holds(r)) continue;
    std::map<const Parameter*, ops::Tensor> whole_values;
    out.precision = step.shard(r).config().precision;
    for (GradientBucket& b : step.shard(r).buckets()) {
      if (!b.value_shard.defined()) continue;
      const devices::ProcessGroup& replicas =
          step.mesh().group(b.expert ? GroupKind::expert_data : GroupKind::data_context, r);
      const ops::Tensor whole = ops::Tensor::zeros({b.shard_size * replicas.size()});
      for (int i = 0; i < replicas.size(); ++i)
        whole.slice(0, i * b.shard_size, b.shard_size)
            .copy_from(parameter_shard(step, elsewhere, replicas.device(i), b.name));
      out.after_load.emplace_back(b.value_shard, whole.slice(0, b.shard_begin, b.shard_size));
      if (b.main_values_sharded) out.rounded_after_load.emplace_back(b.values16, whole);
      if (b.value_shard16.has_storage())  // stage 3's: what the next gathers send
        out.rounded_after_load.emplace_back(b.value_shard16,
                                            whole.slice(0, b.shard_begin, b.shard_size));
      std::int64_t at = 0;
      for (const Parameter* p : b.params) {
        whole_values[p] = whole.slice(0, at, p->value.numel()).reshape(p->value.shape());
        at += p->value.numel();
      }
    }
    for (Parameter& p : step.shard(r).parameters()) {
      const auto found = whole_values.find(&p);
      out.list.push_back(
          {r, p.name, "value", found == whole_values.end() ? p.value : found->second});
    }
    for (ModelState& s : step.shard(r).states())
      out.list.push_back({r, s.name, "value", s.value});
    for (GradientBucket& b : step.shard(r).buckets()) {
      for (const auto& [part, moment] :
           {std::pair<const char*, ops::Tensor*>{"exp_avg", &b.exp_avg},
            {"exp_avg_sq", &b.exp_avg_sq}}) {
        if (b.replicas == 1 || b.sharded == moments_sharded) {
          out.list.push_back({r, b.name, part, *moment});
          continue;
        }
        const std::int64_t padded = b.sharded ? b.shard_size * b.replicas : b.shard_size;
        const std::int64_t shard = padded / b.replicas;
        if (b.sharded) {
          // Saved whole: this replica's shard of it.
          const ops::Tensor saved = ops::Tensor::zeros({padded});
          out.list.push_back({r, b.name, part, saved});
          out.after_load.emplace_back(*moment, saved.slice(0, b.shard_begin, b.shard_size));
          continue;
        }
        // Saved as shards: this rank's is its replica's part of every replica's whole moment.
        const ops::Tensor saved = ops::Tensor::zeros({shard});
        out.list.push_back({r, b.name, part, saved});
        const devices::ProcessGroup& replicas =
            step.mesh().group(b.expert ? GroupKind::expert_data : GroupKind::data_context, r);
        for (int i = 0; i < replicas.size(); ++i) {
          GradientBucket& other = bucket_of_rank(step, replicas.device(i), b.name);
          ops::Tensor& to = std::string_view(part) == "exp_avg" ? other.exp_avg : other.exp_avg_sq;
          out.after_load.emplace_back(to.slice(0, b.replica * shard, shard), saved);
        }
      }
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

// The checkpointed settings of `section` that are fields of their own (config_flags.hpp), read
// back from `saved` into `config`. Those the program derives (--swiglu, --normalization, ...) are
// read by the caller.
void read_fields(const json& saved, DescribedSection section, TrainerConfig& config) {
  for (const ConfigFlag& f : config_flags()) {
    const FlagDescription& d = f.description;
    if (d.section != section || !d.checkpointed) continue;
    const std::string key(d.key);
    std::visit(
        [&](auto ref) {
          if constexpr (!std::is_same_v<decltype(ref), std::monostate>) {
            auto& field = ref(config);
            using Value = std::remove_cvref_t<decltype(field)>;
            if constexpr (std::is_integral_v<Value> && !std::is_same_v<Value, bool>)
              field = whole_number<Value>(saved, key.c_str());
            else
              field = saved.at(key).template get<Value>();
          }
        },
        f.field);
  }
}

// Writes `magic`, the header text and the entries' values to `partial`, flushes it to disk and
// renames it to `path`.
void write_and_rename(const std::string& partial, const std::string& path, const char* magic,
                      const std::string& text, const std::vector<Entry>& entries) {
  if (std::filesystem::is_directory(path))
    throw std::runtime_error(fmt::format(
        "cannot save checkpoint '{}': it is a folder; name a file such as '{}/model.ckpt'", path,
        path));
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    if (!out)
      throw std::runtime_error(
          fmt::format("cannot write checkpoint '{}': check that the directory "
                      "exists and is writable",
                      partial));
    out.write(magic, static_cast<std::streamsize>(std::strlen(magic)));
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
  std::error_code error;
  std::filesystem::rename(partial, path, error);
  if (error)
    throw std::runtime_error(
        fmt::format("cannot save checkpoint '{}': renaming '{}' to it failed: {}", path, partial,
                    error.message()));
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  sync_to_disk(folder.empty() ? std::string(".") : folder.string());
}

// Writes `magic`, the header and the entries' values to `path` through a temporary name and a
// rename; returns the values' checksum (also put in the header).
std::uint64_t write_file(const std::string& path, const char* magic, json header,
                         const std::vector<Entry>& entries) {
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
  // A save that fails leaves what `path` held before and nothing else: not a partial file.
  try {
    write_and_rename(partial, path, magic, text, entries);
  } catch (...) {
    std::error_code ignored;
    if (std::filesystem::is_regular_file(partial, ignored))
      std::filesystem::remove(partial, ignored);
    throw;
  }
  return checksum;
}

json run_header(const ModelConfig& model, const ParallelPlan& plan, const CheckpointState& state) {
  // The scheduler places chunks on stages (zb-v's V): read by generation, not compared on load,
  // as a run may resume under another schedule of the same layout. The precision is recorded,
  // not compared: the tensors are the fp32 main parameters and moments in every precision, so a
  // checkpoint loads exactly into a run of another one (whose 16-bit copies are rounded from
  // them); a loss scaler's state resumes in a run that has one.
  json header = {{"model", describe(model)},
                 {"plan", describe(plan)},
                 {"pipeline_scheduler", plan.pipeline_scheduler},
                 {"precision", precision_name(model.precision)},
                 {"iteration", state.iteration},
                 {"consumed_samples", state.consumed_samples},
                 {"skipped_iterations", state.skipped_iterations},
                 {"skipped_samples", state.skipped_samples}};
  if (state.loss_scaler)
    header["loss_scaler"] = {{"scale", state.loss_scaler->scale},
                             {"growth_tracker", state.loss_scaler->growth_tracker},
                             {"hysteresis_tracker", state.loss_scaler->hysteresis_tracker}};
  return header;
}

// What the header holds of the run's progress; older checkpoints hold no skipped iterations
// (none were) and no loss scaler.
CheckpointState progress_of(const json& header) {
  CheckpointState s;
  s.iteration = whole_number<std::int64_t>(header, "iteration");
  s.consumed_samples = whole_number<std::uint64_t>(header, "consumed_samples");
  if (header.contains("skipped_iterations")) {
    s.skipped_iterations = whole_number<std::int64_t>(header, "skipped_iterations");
    s.skipped_samples = whole_number<std::uint64_t>(header, "skipped_samples");
  }
  if (header.contains("loss_scaler")) {
    const json& l = header.at("loss_scaler");
    const json& scale = l.at("scale");
    if (!scale.is_number())
      throw DamagedHeader(fmt::format("'scale' is {}, not a number", scale.dump()));
    s.loss_scaler =
        LossScalerState{.scale = scale.get<float>(),
                        .growth_tracker = whole_number<std::int64_t>(l, "growth_tracker"),
                        .hysteresis_tracker = whole_number<int>(l, "hysteresis_tracker")};
  }
  return s;
}

// A checkpoint of a run spread over processes: each process writes the shards of its ranks to
// a part file of its own, named by the iteration, then process 0 writes the manifest at `path`
// (the parts and their checksums) through a rename, and only then do the processes remove the
// parts of older saves: at any moment `path` names a complete set of parts.
std::string part_name(const std::string& path, int process, int processes, std::int64_t iteration) {
  return fmt::format("{}.part{}-of-{}.iter{}", path, process, processes, iteration);
}

void save_parts(const std::string& path, const ModelConfig& model, const ParallelPlan& plan,
                TrainingStep& step, const CheckpointState& state) {
  devices::ProcessSet& processes = step.processes();
  const int me = processes.index(), n = processes.size();
  const std::string part = part_name(path, me, n, state.iteration);
  json header = run_header(model, plan, state);
  header["process"] = me;
  header["processes"] = n;
  std::string failure;
  std::uint64_t checksum = 0;
  try {
    checksum =
        write_file(part, kPartMagic, header, entries_of(step, plan.distributed_optimizer).list);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  const std::vector<std::string> written =
      processes.gather(failure.empty() ? fmt::format("ok {}", checksum) : "failed " + failure);
  std::string outcome = "ok";
  if (me == 0) {
    json manifest = run_header(model, plan, state);
    manifest["processes"] = n;
    json parts = json::array();
    for (int p = 0; p < n; ++p) {
      const std::string& w = written[static_cast<std::size_t>(p)];
      if (w.rfind("ok ", 0) != 0) {
        outcome = fmt::format("process {} could not write its part: {}", p, w.substr(7));
        break;
      }
      parts.push_back(
          {{"file", std::filesystem::path(part_name(path, p, n, state.iteration)).filename()},
           {"checksum", std::stoull(w.substr(3))}});
    }
    if (outcome == "ok") {
      manifest["parts"] = parts;
      try {
        write_file(path, kManifestMagic, manifest, {});
      } catch (const std::exception& e) {
        outcome = e.what();
      }
    }
  }
  outcome = processes.broadcast(outcome);
  if (outcome != "ok")
    throw std::runtime_error(fmt::format("saving checkpoint '{}' failed: {}", path, outcome));
  // The manifest names this save's parts now: older ones of this process can go.
  const std::filesystem::path own(part);
  const std::string prefix =
      own.filename().string().substr(0, own.filename().string().rfind(".iter") + 5);
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(
           own.parent_path().empty() ? std::filesystem::path(".") : own.parent_path(), ec)) {
    const std::string name = f.path().filename().string();
    if (name.rfind(prefix, 0) == 0 && name != own.filename().string())
      std::filesystem::remove(f.path(), ec);
  }
}

}  // namespace

void save_checkpoint(const std::string& path, const ModelConfig& model, const ParallelPlan& plan,
                     TrainingStep& step, const CheckpointState& state) {
  if (step.processes().size() > 1) return save_parts(path, model, plan, step, state);
  write_file(path, kMagic, run_header(model, plan, state),
             entries_of(step, plan.distributed_optimizer).list);
}

namespace {

// A checkpoint file opened: which kind (its magic line), its header, and the stream at its
// values.
struct OpenedFile {
  std::ifstream in;
  std::string magic;
  json header;
};

OpenedFile open_file(const std::string& path) {
  OpenedFile f{std::ifstream(path, std::ios::binary), std::string(kMagicSize, '\0'), {}};
  std::error_code size_error;
  const std::uintmax_t file_size = std::filesystem::file_size(path, size_error);
  if (!f.in || size_error)
    throw std::runtime_error(fmt::format("cannot open checkpoint '{}'", path));
  f.in.read(f.magic.data(), kMagicSize);
  if (!f.in || (f.magic != kMagic && f.magic != kManifestMagic && f.magic != kPartMagic))
    throw std::runtime_error(
        fmt::format("'{}' is not a weave checkpoint (its first bytes differ)", path));
  std::uint64_t size = 0;
  f.in.read(reinterpret_cast<char*>(&size), sizeof size);
  // The header must fit in the file: a damaged size must not make this allocate gigabytes.
  if (!f.in || size > file_size - kMagicSize - sizeof size)
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' is damaged: its header size ({} bytes) runs past the end of the file",
        path, size));
  std::string text(size, '\0');
  f.in.read(text.data(), static_cast<std::streamsize>(size));
  try {
    f.header = json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("checkpoint '{}' is damaged: {}", path, e.what()));
  }
  if (!f.header.is_object())
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is damaged: its header is not a JSON object", path));
  return f;
}

// Reads the values of `entries` from an opened file and verifies them (names, shapes, the
// checksum) before anything is copied into the model.
std::vector<std::vector<float>> read_values(OpenedFile& f, const std::string& path,
                                            const std::vector<Entry>& entries) {
  const json& tensors = f.header.at("tensors");
  if (!tensors.is_array()) throw DamagedHeader("'tensors' is not a list");
  if (tensors.size() != entries.size())
    throw std::runtime_error(fmt::format("checkpoint '{}' holds {} tensors, the model has {}", path,
                                         tensors.size(), entries.size()));
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
    f.in.read(reinterpret_cast<char*>(data[i].data()),
              static_cast<std::streamsize>(data[i].size() * sizeof(float)));
    if (!f.in) throw std::runtime_error(fmt::format("checkpoint '{}' is truncated", path));
    checksum = fnv1a(reinterpret_cast<const char*>(data[i].data()), data[i].size() * sizeof(float),
                     checksum);
  }
  if (checksum != whole_number<std::uint64_t>(f.header, "checksum"))
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is damaged: its checksum does not match", path));
  return data;
}

std::string process_count(int n) {
  return n == 1 ? "one process" : fmt::format("{} processes", n);
}

// This process's part of a checkpoint saved by several, read and verified against the
// manifest; the outcome is shared so that every process refuses when any cannot load its part.
std::vector<std::vector<float>> read_part(const std::string& path, const json& manifest,
                                          const std::vector<Entry>& entries,
                                          devices::ProcessSet& processes) {
  const int me = processes.index();
  std::vector<std::vector<float>> data;
  std::string failure;
  try {
    const json& part = manifest.at("parts").at(static_cast<std::size_t>(me));
    const std::string file =
        (std::filesystem::path(path).parent_path() / part.at("file").get<std::string>()).string();
    OpenedFile f = open_file(file);
    if (f.magic != kPartMagic || f.header.value("process", -1) != me ||
        f.header.value("iteration", std::int64_t{-1}) !=
            manifest.at("iteration").get<std::int64_t>() ||
        f.header.value("checksum", std::uint64_t{0}) != part.at("checksum").get<std::uint64_t>())
      throw std::runtime_error(fmt::format(
          "'{}' is not the part of process {} that checkpoint '{}' names (another save's?)", file,
          me, path));
    data = read_values(f, file, entries);
  } catch (const std::exception& e) {
    failure = fmt::format("process {}: {}", me, e.what());
  }
  std::vector<std::string> failures = processes.gather(failure);
  std::string all;
  for (const std::string& f : failures)
    if (!f.empty()) all += (all.empty() ? "" : "; ") + f;
  all = processes.broadcast(all);
  if (!all.empty())
    throw std::runtime_error(fmt::format("checkpoint '{}' cannot be loaded: {}", path, all));
  return data;
}

// The rest of load_checkpoint, once the header is parsed.
CheckpointState load_opened(OpenedFile& f, const std::string& path, const ModelConfig& model,
                            const ParallelPlan& plan, TrainingStep& step) {
  const json& header = f.header;
  if (f.magic == kPartMagic)
    throw std::runtime_error(fmt::format(
        "'{}' is one process's part of a checkpoint: load the checkpoint's own path, the "
        "manifest beside it (the name without '.part...')",
        path));
  devices::ProcessSet& processes = step.processes();
  const int saved = f.magic == kManifestMagic ? header.value("processes", 0) : 1;
  if (saved != processes.size())
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' was saved by {} and this run has {}: each process saves and loads the "
        "shards of its own ranks, so resume it with {}",
        path, process_count(saved), process_count(processes.size()),
        saved == 1 ? "one process (without mpirun, or mpirun -np 1)"
                   : fmt::format("mpirun -np {}", saved)));
  if (const std::string diff =
          differences(with_defaults(header.value("model", json::object()), model), describe(model));
      !diff.empty())
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' holds another model: {}. Load it with the model flags it was saved with",
        path, diff));
  // The distributed optimizer (ZeRO stages 1 to 3) keeps each replica's shard of the moments,
  // plain data parallelism every replica's whole ones: either loads the other's checkpoint.
  json saved_plan = plan_with_defaults(header.value("plan", json::object())),
       now_plan = describe(plan);
  const bool moments_sharded = saved_plan.value("use_distributed_optimizer", false);
  saved_plan.erase("use_distributed_optimizer");
  now_plan.erase("use_distributed_optimizer");
  if (const std::string diff = differences(saved_plan, now_plan); !diff.empty())
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' was saved with another parallel layout: {}. Resume with the layout it was "
        "saved with",
        path, diff));
  const Entries entries = entries_of(step, moments_sharded);
  // Read everything and verify before touching the model.
  const std::vector<std::vector<float>> data =
      f.magic == kManifestMagic ? read_part(path, header, entries.list, processes)
                                : read_values(f, path, entries.list);
  for (std::size_t i = 0; i < entries.list.size(); ++i)
    std::copy(data[i].begin(), data[i].end(), entries.list[i].tensor.data());
  entries.apply_after_load();
  return progress_of(header);
}

}  // namespace

CheckpointState load_checkpoint(const std::string& path, const ModelConfig& model,
                                const ParallelPlan& plan, TrainingStep& step) {
  OpenedFile f = open_file(path);
  // The checksum covers the tensors, not the header: a header field that is missing or of the
  // wrong kind is damage, reported as such.
  try {
    return load_opened(f, path, model, plan, step);
  } catch (const json::exception& e) {
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is damaged: its header is not as saved ({})", path, e.what()));
  } catch (const DamagedHeader& e) {
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is damaged: its header is not as saved ({})", path, e.what()));
  }
}

void copy_checkpointed_state(TrainingStep& from, TrainingStep& to) {
  const std::vector<Entry> source = entries_of(from, from.mesh().plan().distributed_optimizer).list;
  const Entries target_entries = entries_of(to, to.mesh().plan().distributed_optimizer);
  const std::vector<Entry>& target = target_entries.list;
  const auto same = [&](std::size_t i) {
    return source[i].rank == target[i].rank && source[i].name == target[i].name &&
           source[i].part == target[i].part && source[i].tensor.numel() == target[i].tensor.numel();
  };
  for (std::size_t i = 0; i < std::max(source.size(), target.size()); ++i)
    if (i >= source.size() || i >= target.size() || !same(i))
      throw std::invalid_argument(
          "the two steps hold different tensors: state is copied only between steps of the same "
          "model and parallel layout");
  for (std::size_t i = 0; i < source.size(); ++i)
    target[i].tensor.copy_from(source[i].tensor);
  target_entries.apply_after_load();
}

SavedConfiguration read_checkpoint_config(const std::string& path) {
  OpenedFile f = open_file(path);
  if (f.magic == kPartMagic)
    throw std::runtime_error(fmt::format(
        "'{}' is one process's part of a checkpoint: name the checkpoint's own path, the "
        "manifest beside it (the name without '.part...')",
        path));
  try {
    const json& m = f.header.at("model");
    const json p = plan_with_defaults(f.header.at("plan"));
    SavedConfiguration c;
    ModelConfig& model = c.model;
    model.num_attention_heads = whole_number<int>(m, "num_attention_heads");
    const json full = with_defaults(m, model);
    TrainerConfig saved;
    read_fields(full, DescribedSection::model, saved);
    read_fields(p, DescribedSection::plan, saved);
    model = saved.model;
    // The header records the experts' width as used (--ffn-hidden-size when unset, and in a
    // dense model): as wide as the dense MLPs, it reads back as unset.
    if (model.num_experts == 0 || model.moe_ffn_hidden_size == model.ffn_hidden_size)
      model.moe_ffn_hidden_size = 0;
    model.activation = full.at("swiglu").get<bool>() ? Activation::swiglu : Activation::gelu;
    const std::string positions = full.at("position_embedding_type").get<std::string>();
    model.position_embedding = positions == "rope"   ? PositionEmbedding::rope
                               : positions == "none" ? PositionEmbedding::none
                                                     : PositionEmbedding::learned_absolute;
    model.normalization = full.at("normalization").get<std::string>() == "RMSNorm"
                              ? Normalization::rms_norm
                              : Normalization::layer_norm;
    const std::string balancing = full.at("moe_router_load_balancing_type").get<std::string>();
    model.moe_load_balancing = balancing == "sinkhorn"       ? MoeLoadBalancing::sinkhorn
                               : balancing == "seq_aux_loss" ? MoeLoadBalancing::seq_aux_loss
                                                             : MoeLoadBalancing::aux_loss;
    // The header records each head's width as used: hidden / heads reads back as unset.
    if (model.num_attention_heads > 0 && model.hidden_size % model.num_attention_heads == 0 &&
        model.kv_channels == model.hidden_size / model.num_attention_heads)
      model.kv_channels = 0;
    const int groups = whole_number<int>(full, "num_query_groups");
    model.num_query_groups = groups == model.num_attention_heads ? 0 : groups;
    model.add_bias_linear = full.at("add_bias_linear").get<bool>();
    const json& freq = full.at("moe_layer_freq");
    if (freq.is_string())
      set_moe_layer_freq(model, freq.get<std::string>());
    else
      model.moe_layer_freq = whole_number<int>(full, "moe_layer_freq");
    ParallelPlan& plan = c.plan;
    plan = saved.plan;
    plan.data_parallel = whole_number<int>(p, "data_parallel_size");
    plan.pipeline_scheduler = f.header.value("pipeline_scheduler", std::string());
    c.processes = f.magic == kManifestMagic ? whole_number<int>(f.header, "processes") : 1;
    c.state = progress_of(f.header);
    return c;
  } catch (const json::exception& e) {
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is damaged: its header is not as saved ({})", path, e.what()));
  } catch (const DamagedHeader& e) {
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is damaged: its header is not as saved ({})", path, e.what()));
  }
}

}  // namespace weave::graphs
