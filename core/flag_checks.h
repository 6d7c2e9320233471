// Range checks for numeric command-line flags (CLI11 validators), with messages a user reads as
// a sentence about the flag: "--batch must be at least 1, got 0" instead of CLI11's own
// "--batch: Value 0 not in range 2.22507e-308 to 1.79769e+308".
//
//   app.add_option("--batch", flags.batch, "Sequences per step")->check(tessera::AtLeast(1));
//   ...
//   } catch (const CLI::ParseError& e) {
//     std::fprintf(stderr, "%s: %s\n", program, tessera::FlagErrorMessage(e).c_str());
//
// Also: FlagErrorMessage(error, app) adds the flag a mistyped one was likely meant to be ("did you
// mean --steps?"), PrepareHelp(app) makes help start with the usage line and show every option's
// default, and ParseCommandLine puts it all together for a program's main.
//
// Header-only, for the code that declares a program's flags (it links CLI11 itself; core does not);
// internal, not installed. The checks read a value as a number (integer or floating point), so one
// works for any numeric flag; a value that is not a number is left to CLI11's conversion, which
// names it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

namespace tessera {

namespace detail {

// A validator that passes `value` when `ok(value)` holds, else says "must be <requirement>".
template <typename Ok>
CLI::Validator NumberCheck(std::string name, std::string requirement, Ok ok) {
  return CLI::Validator(
      [requirement = std::move(requirement), ok](std::string& text) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(text, value)) return "";  // CLI11 names a non-number
        return ok(value) ? "" : fmt::format("must be {}, got {}", requirement, text);
      },
      std::move(name));
}

}  // namespace detail

// value >= min.
inline CLI::Validator AtLeast(int64_t min) {
  return detail::NumberCheck(fmt::format(">={}", min), fmt::format("at least {}", min),
                             [min](double value) { return value >= static_cast<double>(min); });
}

// min <= value <= max.
inline CLI::Validator Between(int64_t min, int64_t max) {
  return detail::NumberCheck(fmt::format("{}..{}", min, max),
                             fmt::format("from {} to {}", min, max), [min, max](double value) {
                               return value >= static_cast<double>(min) &&
                                      value <= static_cast<double>(max);
                             });
}

// value > 0 (for real-valued flags: a learning rate, a temperature).
inline CLI::Validator AboveZero() {
  return detail::NumberCheck(">0", "above 0", [](double value) { return value > 0; });
}

// CLI11 words a failed check as "<flag>: <what the check said>"; ours say "must be ...", which
// reads as one sentence without the colon: "--batch must be at least 1, got 0". Other parse
// errors are returned as CLI11 words them.
inline std::string FlagErrorMessage(const CLI::ParseError& error) {
  std::string message = error.what();
  if (const size_t colon = message.find(": must be "); colon != std::string::npos) {
    message.erase(colon, 1);
  }
  return message;
}

namespace detail {

// Edits (insert, delete, substitute) between a and b.
inline size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// Every long flag of `app` and of its subcommands ("--steps").
inline void LongFlags(const CLI::App& app, std::vector<std::string>& flags) {
  for (const CLI::Option* option : app.get_options()) {
    for (const std::string& name : option->get_lnames()) flags.push_back("--" + name);
  }
  for (const CLI::App* sub : app.get_subcommands({})) LongFlags(*sub, flags);
}

}  // namespace detail

// The flag of `app` closest to a mistyped `word` ("--step": "--steps"), within two edits or a
// third of its length; empty when none is that close.
inline std::string ClosestFlag(const CLI::App& app, const std::string& word) {
  std::vector<std::string> flags;
  detail::LongFlags(app, flags);
  std::string best;
  size_t best_distance = std::max<size_t>(2, word.size() / 3) + 1;
  for (const std::string& flag : flags) {
    const size_t distance = detail::EditDistance(word, flag);
    if (distance < best_distance) {
      best_distance = distance;
      best = flag;
    }
  }
  return best;
}

// FlagErrorMessage, and for arguments the program did not expect, the flags they were likely
// meant to be: "The following argument was not expected: --step (did you mean --steps?)".
inline std::string FlagErrorMessage(const CLI::ParseError& error, const CLI::App& app) {
  std::string message = FlagErrorMessage(error);
  const std::string marker = "not expected: ";
  const size_t at = message.find(marker);
  if (at == std::string::npos) return message;
  std::vector<std::string> hints;
  size_t start = at + marker.size();
  while (start < message.size()) {
    size_t end = message.find(' ', start);
    if (end == std::string::npos) end = message.size();
    std::string word = message.substr(start, end - start);
    if (const size_t equals = word.find('='); equals != std::string::npos) word.resize(equals);
    if (word.starts_with("--")) {
      const std::string closest = ClosestFlag(app, word);
      if (!closest.empty() && closest != word) hints.push_back(closest);
    }
    start = end + 1;
  }
  if (hints.empty()) return message;
  std::string joined;
  for (const std::string& hint : hints) joined += (joined.empty() ? "" : " or ") + hint;
  return message + " (did you mean " + joined + "?)";
}

// Help that starts with how to call the program: the usage line, then the description, the
// options and subcommands, then the footer (where programs put the settings they read from the
// environment).
class UsageFirstFormatter : public CLI::Formatter {
 public:
  std::string make_help(const CLI::App* app, std::string name,
                        CLI::AppFormatMode mode) const override {
    if (mode == CLI::AppFormatMode::Sub) return make_expanded(app);
    return make_usage(app, std::move(name)) + make_description(app) + make_positionals(app) +
           make_groups(app, mode) + make_subcommands(app, mode) + "\n" + make_footer(app);
  }
};

// Usage-first help for `app` and its subcommands, every option's default shown (the value its
// variable holds when this is called: call it after the options are added).
inline void PrepareHelp(CLI::App& app) {
  app.formatter(std::make_shared<UsageFirstFormatter>());
  for (CLI::Option* option : app.get_options()) option->capture_default_str();
  for (CLI::App* sub : app.get_subcommands({})) PrepareHelp(*sub);
}

// Parses a program's command line the way every Tessera binary does: --version prints
// `version_line` (core/version.h VersionLine), help is usage-first (PrepareHelp), and a bad flag
// prints "<program>: <FlagErrorMessage with a guess>" and the help on stderr. nullopt: parsed, go
// on; else the exit code (0 after --help or --version, 2 for a bad flag). Call it after every
// option and subcommand is added.
inline std::optional<int> ParseCommandLine(CLI::App& app, int argc, char** argv,
                                           const char* program, const std::string& version_line) {
  app.set_version_flag("--version", version_line);
  PrepareHelp(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: %s\n\n%s", program, FlagErrorMessage(e, app).c_str(),
                 app.help().c_str());
    return 2;
  }
  return std::nullopt;
}

}  // namespace tessera
