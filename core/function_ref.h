// FunctionRef: a non-owning reference to a callable, for parameters called during the call only.
//
// std::function owns a copy of its callable and allocates on the heap for anything larger than
// two pointers (a lambda capturing three references already does), which a per-task hot path
// pays on every call. A FunctionRef holds a pointer to the caller's callable and a pointer to
// one function that invokes it: no allocation, no copy.
//
// REQUIRES: the referenced callable outlives every call through the reference. Pass a lambda
// to a FunctionRef parameter; never keep a FunctionRef made from a temporary.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace tessera {

template <typename Signature>
class FunctionRef;

template <typename R, typename... Args>
class FunctionRef<R(Args...)> {
 public:
  // Implicit: a FunctionRef parameter takes a lambda as it is. The constraint keeps FunctionRef
  // itself out, so copies use the copy constructor (the analysis does not read `requires`).
  template <typename F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> &&
           std::is_invocable_r_v<R, F&, Args...>)
      // NOLINTNEXTLINE(google-explicit-constructor,bugprone-forwarding-reference-overload)
      FunctionRef(F&& callable)
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(callable)))),
        invoke_([](void* object, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(object))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return invoke_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*invoke_)(void*, Args...);
};

}  // namespace tessera
