// Checks that a Chrome/Perfetto trace (client/trace.h) has the schema viewers need: every event
// an object with the required keys of the right types, names non-empty, durations >= 0.
#pragma once

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace tessera::testing {

// One event's keys and types (fatal failures return from here, not from the caller).
inline void ExpectChromeTraceEvent(const nlohmann::json& event) {
  SCOPED_TRACE(event.dump());
  ASSERT_TRUE(event.is_object());
  ASSERT_TRUE(event.contains("ph") && event["ph"].is_string());
  ASSERT_TRUE(event.contains("name") && event["name"].is_string());
  EXPECT_FALSE(event["name"].get<std::string>().empty());
  ASSERT_TRUE(event.contains("pid") && event["pid"].is_number_integer());
  ASSERT_TRUE(event.contains("tid") && event["tid"].is_number_integer());
  const std::string ph = event["ph"];
  if (ph == "M") {
    EXPECT_TRUE(event["name"] == "process_name" || event["name"] == "thread_name");
    ASSERT_TRUE(event.contains("args") && event["args"].is_object());
    ASSERT_TRUE(event["args"].contains("name") && event["args"]["name"].is_string());
    EXPECT_FALSE(event["args"]["name"].get<std::string>().empty());
  } else {
    ASSERT_EQ(ph, "X");
    ASSERT_TRUE(event.contains("cat") && event["cat"].is_string());
    EXPECT_FALSE(event["cat"].get<std::string>().empty());
    ASSERT_TRUE(event.contains("ts") && event["ts"].is_number());
    ASSERT_TRUE(event.contains("dur") && event["dur"].is_number());
    EXPECT_GE(event["dur"].get<double>(), 0);
    ASSERT_TRUE(event.contains("args") && event["args"].is_object());
    const nlohmann::json& args = event["args"];
    EXPECT_TRUE(args.contains("layer") && args["layer"].is_string());
    EXPECT_TRUE(args.contains("op") && args["op"].is_string());
    EXPECT_TRUE(args.contains("bytes") && args["bytes"].is_number_integer());
    EXPECT_TRUE(args.contains("instance") && args["instance"].is_number_integer());
  }
}

// Parses `text` and checks the schema (gtest failures name the event); returns the parsed
// trace (null when it does not parse).
inline nlohmann::json ExpectChromeTraceSchema(const std::string& text) {
  nlohmann::json trace = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(trace.is_discarded()) << "the trace is not JSON:\n" << text.substr(0, 500);
  if (trace.is_discarded()) return nullptr;
  EXPECT_TRUE(trace.is_object());
  EXPECT_EQ(trace.value("displayTimeUnit", ""), "ms");
  EXPECT_TRUE(trace.contains("traceEvents") && trace["traceEvents"].is_array());
  if (!trace.contains("traceEvents") || !trace["traceEvents"].is_array()) return nullptr;
  for (const nlohmann::json& event : trace["traceEvents"]) ExpectChromeTraceEvent(event);
  return trace;
}

}  // namespace tessera::testing
