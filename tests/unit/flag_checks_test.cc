// Command-line helpers (core/flag_checks.h): range checks worded as sentences, the flag a
// mistyped one was meant to be, and help that starts with the usage and shows every default.
#include "core/flag_checks.h"

#include <algorithm>

#include <gtest/gtest.h>

namespace tessera::testing {
namespace {

struct Flags {
  int steps = 200;
  int batch = 4;
  std::string host = "127.0.0.1";
};

void AddFlags(CLI::App& app, Flags& flags) {
  app.add_option("--steps", flags.steps, "Training steps")->check(AtLeast(0));
  app.add_option("--batch", flags.batch, "Rows per step")->check(AtLeast(1));
  CLI::App* start = app.add_subcommand("start", "Start something");
  start->add_option("--host", flags.host, "Address to listen on");
}

// The message a parse of `args` fails with (empty when it succeeds).
std::string ParseError(std::vector<std::string> args) {
  CLI::App app{"test program"};
  Flags flags;
  AddFlags(app, flags);
  std::reverse(args.begin(), args.end());  // CLI11 takes a vector in reverse order
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return FlagErrorMessage(e, app);
  }
  return "";
}

TEST(FlagChecksTest, ARangeCheckReadsAsASentence) {
  EXPECT_EQ(ParseError({"--batch", "0"}), "--batch must be at least 1, got 0");
  EXPECT_EQ(ParseError({"--steps", "5"}), "");
}

TEST(FlagChecksTest, AMistypedFlagGetsTheOneItWasLikelyMeantToBe) {
  EXPECT_EQ(ParseError({"--step", "3"}),
            "The following arguments were not expected: 3 --step (did you mean --steps?)");
  EXPECT_NE(ParseError({"--btach=2"}).find("(did you mean --batch?)"), std::string::npos);
  // A subcommand's flags are candidates too.
  EXPECT_NE(ParseError({"start", "--hots", "x"}).find("did you mean --host?"), std::string::npos);
  // Nothing close: no guess.
  const std::string far = ParseError({"--completely-different"});
  EXPECT_NE(far.find("not expected: --completely-different"), std::string::npos) << far;
  EXPECT_EQ(far.find("did you mean"), std::string::npos) << far;
  CLI::App app;
  Flags flags;
  AddFlags(app, flags);
  EXPECT_EQ(ClosestFlag(app, "--stesp"), "--steps");
  EXPECT_EQ(ClosestFlag(app, "--x"), "");
}

TEST(FlagChecksTest, HelpStartsWithTheUsageAndShowsEveryDefault) {
  CLI::App app{"What the program does."};
  app.footer("Settings: FOOTER");
  Flags flags;
  AddFlags(app, flags);
  flags.steps = 300;  // the value when PrepareHelp runs is the default shown
  PrepareHelp(app);
  const std::string help = app.help();
  EXPECT_EQ(help.rfind("Usage:", 0), 0u) << help;
  EXPECT_LT(help.find("What the program does."), help.find("--steps")) << help;
  EXPECT_NE(help.find("=300"), std::string::npos) << help;
  EXPECT_NE(help.find("=4"), std::string::npos) << help;
  EXPECT_GT(help.find("Settings: FOOTER"), help.find("--batch")) << help;
  CLI::App* start = app.get_subcommand("start");
  EXPECT_NE(start->help().find("=127.0.0.1"), std::string::npos) << start->help();
}

}  // namespace
}  // namespace tessera::testing
