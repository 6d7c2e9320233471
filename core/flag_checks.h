// Range checks for numeric command-line flags (CLI11 validators), with messages a user reads as
// a sentence about the flag: "--batch must be at least 1, got 0" instead of CLI11's own
// "--batch: Value 0 not in range 2.22507e-308 to 1.79769e+308".
//
//   app.add_option("--batch", flags.batch, "Sequences per step")->check(tessera::AtLeast(1));
//   ...
//   } catch (const CLI::ParseError& e) {
//     std::fprintf(stderr, "%s: %s\n", program, tessera::FlagErrorMessage(e).c_str());
//
// Header-only, for the code that declares a program's flags (it links CLI11 itself; core does not);
// internal, not installed. The checks read a value as a number (integer or floating point), so one
// works for any numeric flag; a value that is not a number is left to CLI11's conversion, which
// names it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

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

}  // namespace tessera
