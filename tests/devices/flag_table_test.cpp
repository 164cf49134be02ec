// docs/flags.md against the flag table (graphs/config_flags.hpp) and the parsers of `weave train`
// and `weave predict`: every row is handled as the table says. An implemented flag parses as a
// script writes it, by the command it belongs to; a flag without effect is accepted, values and
// all, and named in the run's "no effect here" list with the table's reason; a refused flag is
// refused with the table's reason. Every flag of both commands and of the table is in
// docs/flags.md with the table's class.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "train_command_line.hpp"
#include "train_options.hpp"
#include "weave/graphs/config_flags.hpp"

namespace {

using weave::cli::TrainOptions;
using weave::graphs::ConfigFlag;
using weave::graphs::FlagCommand;
using weave::graphs::FlagStatus;

// The table's entries of one class.
std::vector<ConfigFlag> table_flags(FlagStatus status) {
  std::vector<ConfigFlag> out;
  for (const ConfigFlag& f : weave::graphs::config_flags())
    if (f.status == status) out.push_back(f);
  return out;
}

struct Row {
  std::string flag;
  std::vector<std::string> values;
  std::string status;  // implemented, no effect, refused
  std::string note;
};

// The cells of a Markdown table row, "\|" read as "|".
std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> out;
  std::string cell;
  for (std::size_t i = 1; i < line.size(); ++i) {
    if (line[i] == '\\' && i + 1 < line.size() && line[i + 1] == '|') {
      cell += '|';
      ++i;
    } else if (line[i] == '|') {
      out.push_back(cell.substr(1, cell.size() - 2));  // the spaces around it
      cell.clear();
    } else {
      cell += line[i];
    }
  }
  return out;
}

std::vector<Row> table() {
  std::ifstream in(WEAVE_FLAG_TABLE);
  std::vector<Row> rows;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| `", 0) != 0) continue;
    const std::vector<std::string> c = cells(line);
    if (c.size() != 3) {
      ADD_FAILURE() << "a row of three cells: " << line;
      continue;
    }
    std::istringstream words(c[0].substr(1, c[0].size() - 2));  // inside the backticks
    Row row{.status = c[1], .note = c[2]};
    words >> row.flag;
    for (std::string v; words >> v;)
      row.values.push_back(v);
    rows.push_back(row);
  }
  return rows;
}

// Parses `weave train FLAGS` as the program does (a --config file reads as {}), without running:
// one command line for every row, since building it costs far more than a parse.
void parse(const std::vector<std::string>& flags, TrainOptions& o) {
  static weave::cli::TrainCommandLine command_line;
  o = command_line.parse(flags,
                         [](const std::string&) { return std::optional<std::string>("{}"); });
}

// Thrown once `weave predict`'s command line is parsed and checked, before it predicts.
struct Parsed {};

// Parses `weave predict FLAGS` as the program does, without predicting.
void parse_predict(const std::vector<std::string>& flags) {
  CLI::App app{"", "weave"};
  weave::cli::add_predict_command(app);
  app.get_subcommand("predict")->parse_complete_callback([] { throw Parsed{}; });
  std::vector<std::string> args{"predict"};
  args.insert(args.end(), flags.begin(), flags.end());
  args = weave::cli::prepare_arguments(
      app, args, [](const std::string&) { return std::optional<std::string>("{}"); });
  std::reverse(args.begin(), args.end());
  try {
    app.parse(args);
  } catch (const Parsed&) {
    return;
  }
  ADD_FAILURE() << "weave predict ran past its parsing";
}

// The command the table says a row's flag belongs to.
FlagCommand command_of(const std::string& flag) {
  const ConfigFlag* f = weave::graphs::find_config_flag(flag);
  return f ? f->command : FlagCommand::train;
}

std::vector<std::string> command_line(const Row& row) {
  std::vector<std::string> args{row.flag};
  args.insert(args.end(), row.values.begin(), row.values.end());
  return args;
}

TEST(FlagTable, HoldsTheThreeKindsOfFlag) {
  const std::vector<Row> rows = table();
  std::map<std::string, int> kinds;
  for (const Row& r : rows)
    ++kinds[r.status];
  EXPECT_EQ(kinds.size(), 3u) << "statuses other than implemented, no effect and refused";
  EXPECT_GT(kinds["implemented"], 50);
  EXPECT_GT(kinds["no effect"], 50);
  EXPECT_GT(kinds["refused"], 5);
  std::set<std::string> seen;
  for (const Row& r : rows)
    EXPECT_TRUE(seen.insert(r.flag).second) << r.flag << " is in the table twice";
}

TEST(FlagTable, ImplementedFlagsParseAsScriptsWriteThem) {
  for (const Row& row : table()) {
    if (row.status != "implemented") continue;
    SCOPED_TRACE(row.flag);
    if (command_of(row.flag) == FlagCommand::predict) {
      try {
        parse_predict(command_line(row));
      } catch (const std::exception& e) {
        ADD_FAILURE() << fmt::format("{}: {}", fmt::join(command_line(row), " "), e.what());
      }
      TrainOptions o;
      EXPECT_THROW(parse(command_line(row), o), std::invalid_argument)
          << "weave predict's own flag taken by weave train";
      continue;
    }
    TrainOptions o;
    try {
      parse(command_line(row), o);
    } catch (const std::exception& e) {
      ADD_FAILURE() << fmt::format("{}: {}", fmt::join(command_line(row), " "), e.what());
    }
    EXPECT_TRUE(o.no_effect.empty()) << "an implemented flag reported as without effect";
  }
}

TEST(FlagTable, FlagsWithoutEffectAreAcceptedAndNamedWithTheTablesReason) {
  std::vector<std::string> all;
  std::vector<std::string> names;
  for (const Row& row : table()) {
    if (row.status != "no effect") continue;
    SCOPED_TRACE(row.flag);
    TrainOptions o;
    EXPECT_NO_THROW(parse(command_line(row), o));
    EXPECT_EQ(o.no_effect, std::vector<std::string>{row.flag});
    const auto flags = table_flags(FlagStatus::no_effect);
    const auto f =
        std::find_if(flags.begin(), flags.end(), [&](const auto& x) { return x.name == row.flag; });
    ASSERT_NE(f, flags.end());
    EXPECT_EQ(std::string(f->help), row.note);
    EXPECT_EQ(static_cast<std::size_t>(f->values), row.values.size());
    const std::vector<std::string> args = command_line(row);
    all.insert(all.end(), args.begin(), args.end());
    names.push_back(row.flag);
  }
  // All at once, as a script carries them: each named once.
  TrainOptions o;
  EXPECT_NO_THROW(parse(all, o));
  std::sort(names.begin(), names.end());
  std::sort(o.no_effect.begin(), o.no_effect.end());
  EXPECT_EQ(o.no_effect, names);
}

TEST(FlagTable, RefusedFlagsAreRefusedWithTheTablesReason) {
  for (const Row& row : table()) {
    if (row.status != "refused") continue;
    SCOPED_TRACE(row.flag);
    TrainOptions o;
    try {
      parse(command_line(row), o);
      ADD_FAILURE() << row.flag << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("{} is refused: {}", row.flag, row.note)),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(FlagTable, EveryFlagOfTheProgramIsInTheTable) {
  std::map<std::string, std::string> status;
  for (const Row& row : table())
    status[row.flag] = row.status;
  CLI::App app;
  TrainOptions o;
  CLI::App* train = app.add_subcommand("train");
  weave::cli::add_train_flags(*train, o);
  for (const CLI::Option* opt : train->get_options()) {
    for (const std::string& name : opt->get_lnames()) {
      const std::string flag = "--" + name;
      if (flag == "--help") continue;
      const ConfigFlag* f = weave::graphs::find_config_flag(flag);
      ASSERT_NE(f, nullptr) << flag << " is not in the flag table";
      EXPECT_NE(f->status, FlagStatus::refused) << flag;
      EXPECT_EQ(status[flag], weave::graphs::flag_status_name(f->status)) << flag;
    }
  }
  for (const auto& f : table_flags(FlagStatus::refused))
    EXPECT_EQ(status[std::string(f.name)], "refused") << f.name;
}

// `weave predict` takes `weave train`'s flags, its own and the refused ones it models: each is in
// the table, and each of its own only there.
TEST(FlagTable, EveryFlagOfPredictIsInTheTable) {
  std::map<std::string, std::string> status;
  for (const Row& row : table())
    status[row.flag] = row.status;
  CLI::App app;
  weave::cli::add_predict_command(app);
  const CLI::App* predict = app.get_subcommand("predict");
  int own = 0;
  for (const CLI::Option* opt : predict->get_options()) {
    for (const std::string& name : opt->get_lnames()) {
      const std::string flag = "--" + name;
      if (flag == "--help") continue;
      const ConfigFlag* f = weave::graphs::find_config_flag(flag);
      ASSERT_NE(f, nullptr) << flag << " is not in the flag table";
      EXPECT_TRUE(f->status != FlagStatus::refused || f->has(weave::graphs::kModelledByPredict))
          << flag;
      EXPECT_EQ(status[flag], weave::graphs::flag_status_name(f->status)) << flag;
      own += f->command == FlagCommand::predict;
    }
  }
  int declared = 0;
  for (const ConfigFlag& f : weave::graphs::config_flags())
    declared += f.command == FlagCommand::predict;
  EXPECT_EQ(own, declared) << "weave predict's own flags in the table and on its command line";
  EXPECT_GE(own, 6);
}

// The values the table says each flag takes are those the command line reads after it: none for
// a switch, its count for the others.
TEST(FlagTable, EachFlagTakesTheValuesTheTableSays) {
  CLI::App app;
  TrainOptions o;
  CLI::App* train = app.add_subcommand("train");
  weave::cli::add_train_flags(*train, o);
  weave::cli::add_predict_command(app);
  const CLI::App* predict = app.get_subcommand("predict");
  for (const ConfigFlag& f : weave::graphs::config_flags()) {
    const bool predicts =
        f.command == FlagCommand::predict || f.has(weave::graphs::kModelledByPredict);
    if (f.status == FlagStatus::refused && !predicts) continue;
    const CLI::Option* opt = (predicts ? predict : train)->get_option(std::string(f.name));
    EXPECT_EQ(opt->get_expected_max() == 0, f.values == 0) << f.name;
    if (f.values > 0) {
      EXPECT_EQ(opt->get_expected_min(), f.values) << f.name;
    }
  }
}

// Every name of every entry of the table, aliases too, is a row of docs/flags.md with the entry's
// class and its help (or its reason): a flag declared in the table and left out of the
// documentation, or documented otherwise, fails here.
TEST(FlagTable, EveryFlagOfTheTableIsDocumentedWithItsClassAndHelp) {
  std::map<std::string, Row> rows;
  for (const Row& row : table())
    rows[row.flag] = row;
  for (const ConfigFlag& f : weave::graphs::config_flags())
    for (const std::string& name : f.names()) {
      EXPECT_EQ(rows[name].status, weave::graphs::flag_status_name(f.status))
          << name << " in " << WEAVE_FLAG_TABLE;
      EXPECT_EQ(rows[name].note, f.help) << name << " in " << WEAVE_FLAG_TABLE;
    }
}

}  // namespace
