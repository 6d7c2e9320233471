// Status and Result<T>: Tessera's one error vocabulary.
//
// Every fallible function returns a Status (no value) or a Result<T> (a value or a Status).
// Codes are grouped by what the caller should do about them:
//
//   kInvalidArgument    the request is wrong (bad shape, bad flag, bad file); fix the input.
//   kNotFound           a named thing (op, object, file, worker) does not exist.
//   kAlreadyExists      a named thing was registered twice.
//   kUnavailable        a peer or resource is down or disconnected; retrying may succeed.
//   kResourceExhausted  out of memory or capacity; back off, or plan with less.
//   kInfeasible         can never succeed as asked (a plan that cannot fit); never retry.
//   kTimedOut           a deadline passed.
//   kCancelled          the operation was cancelled by its owner.
//   kDataLoss           stored data is truncated or corrupt.
//   kInternal           a bug or an unexpected failure of a library call.
//
// Exceptions never cross a module or thread boundary: code that calls a throwing library
// catches at the call site and converts to a Status. Broken invariants (bugs) are not Statuses:
// TESSERA_CHECK aborts with file:line and a message.
//
// Thread safety: Status and Result are values; distinct objects may be used from any thread.
#pragma once

#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace tessera {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kAlreadyExists,
  kUnavailable,
  kResourceExhausted,
  kInfeasible,
  kTimedOut,
  kCancelled,
  kDataLoss,
  kInternal,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "InvalidArgument: <message>", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>"; OK stays OK. Used to add the
  // caller's knowledge (which task, which file) as an error travels up.
  Status WithContext(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Constructors named after codes, with fmt-style formatting:
//   return InvalidArgument("layer {} expects {} channels", name, c);
#define TESSERA_DEFINE_STATUS_FACTORY(Name)                                               \
  template <typename... Args>                                                             \
  Status Name(fmt::format_string<Args...> format, Args&&... args) {                       \
    return Status(StatusCode::k##Name, fmt::format(format, std::forward<Args>(args)...)); \
  }
TESSERA_DEFINE_STATUS_FACTORY(InvalidArgument)
TESSERA_DEFINE_STATUS_FACTORY(NotFound)
TESSERA_DEFINE_STATUS_FACTORY(AlreadyExists)
TESSERA_DEFINE_STATUS_FACTORY(Unavailable)
TESSERA_DEFINE_STATUS_FACTORY(ResourceExhausted)
TESSERA_DEFINE_STATUS_FACTORY(Infeasible)
TESSERA_DEFINE_STATUS_FACTORY(TimedOut)
TESSERA_DEFINE_STATUS_FACTORY(Cancelled)
TESSERA_DEFINE_STATUS_FACTORY(DataLoss)
TESSERA_DEFINE_STATUS_FACTORY(Internal)
#undef TESSERA_DEFINE_STATUS_FACTORY

// Result<T>: a T or a non-OK Status. Built on std::variant so copy/move follow T's.
template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<T, Status>, "use Status directly");

 public:
  Result(T value) : state_(std::in_place_index<0>, std::move(value)) {}        // NOLINT: implicit
  Result(Status status) : state_(std::in_place_index<1>, std::move(status)) {  // NOLINT
    if (std::get<1>(state_).ok()) {
      state_.template emplace<1>(StatusCode::kInternal, "Result constructed from an OK Status");
    }
  }

  bool ok() const { return state_.index() == 0; }
  // OK when a value is held.
  Status status() const { return ok() ? Status() : std::get<1>(state_); }

  // REQUIRES: ok(). Accessing the value of an error aborts with the error's message.
  T& value() & {
    CheckHasValue();
    return std::get<0>(state_);
  }
  const T& value() const& {
    CheckHasValue();
    return std::get<0>(state_);
  }
  T&& value() && {
    CheckHasValue();
    return std::get<0>(std::move(state_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void CheckHasValue() const;
  std::variant<T, Status> state_;
};

namespace detail {
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const std::string& message);
}  // namespace detail

template <typename T>
void Result<T>::CheckHasValue() const {
  if (!ok()) {
    detail::CheckFailed(__FILE__, __LINE__, "Result::ok()", std::get<1>(state_).ToString());
  }
}

}  // namespace tessera

// Aborts with file:line when an invariant is broken. For bugs only; never for bad input.
#define TESSERA_CHECK(condition, ...)                                \
  do {                                                               \
    if (!(condition)) [[unlikely]] {                                 \
      ::tessera::detail::CheckFailed(__FILE__, __LINE__, #condition, \
                                     ::fmt::format("" __VA_ARGS__)); \
    }                                                                \
  } while (0)

#define TESSERA_CONCAT_INNER(a, b) a##b
#define TESSERA_CONCAT(a, b) TESSERA_CONCAT_INNER(a, b)

// NOLINTBEGIN(bugprone-macro-parentheses): `status` and `result` are names being declared and
// `lhs` a declaration (`auto x`), which parentheses would break.

// Returns the Status from the enclosing function when `expr` (a Status) is not OK.
#define TESSERA_RETURN_IF_ERROR(expr) \
  TESSERA_RETURN_IF_ERROR_IMPL(TESSERA_CONCAT(tessera_status_, __COUNTER__), expr)
#define TESSERA_RETURN_IF_ERROR_IMPL(status, expr) \
  do {                                             \
    ::tessera::Status status = (expr);             \
    if (!status.ok()) [[unlikely]]                 \
      return status;                               \
  } while (0)

// `TESSERA_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from a Result or returns its error.
#define TESSERA_ASSIGN_OR_RETURN(lhs, expr) \
  TESSERA_ASSIGN_OR_RETURN_IMPL(TESSERA_CONCAT(tessera_result_, __COUNTER__), lhs, expr)
#define TESSERA_ASSIGN_OR_RETURN_IMPL(result, lhs, expr) \
  auto result = (expr);                                  \
  if (!result.ok()) [[unlikely]]                         \
    return result.status();                              \
  lhs = std::move(result).value()
// NOLINTEND(bugprone-macro-parentheses)
