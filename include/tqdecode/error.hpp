// The one error type of the library. Every argument check throws it with a
// message that names the argument, the value seen and what is accepted, and
// throws before anything is written.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace tqdecode {

class Error : public std::invalid_argument {
 public:
  Error(std::string argument, const std::string& message)
      : std::invalid_argument("tqdecode: " + argument + ": " + message),
        argument_(std::move(argument)) {}

  /// Name of the offending argument, e.g. "block_size" or "seq_lens[3]".
  const std::string& argument() const noexcept { return argument_; }

 private:
  std::string argument_;
};

/// A CUDA runtime failure (launch error, out of memory, device fault).
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Throws Error for `argument` with `message`.
[[noreturn]] void fail(std::string_view argument, const std::string& message);

}  // namespace tqdecode

/// Throws tqdecode::Error for `argument` unless `condition`. A macro so the
/// message is built only on failure: argument checks run on every decode
/// call, and building their messages eagerly cost a dozen string
/// allocations per call.
#define TQ_REQUIRE(condition, argument, message)                        \
  do {                                                                  \
    if (!(condition)) ::tqdecode::fail((argument), (message));          \
  } while (false)
