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

/// Throws Error unless `ok`.
inline void require(bool ok, std::string_view argument, const std::string& message) {
  if (!ok) fail(argument, message);
}

}  // namespace tqdecode
