#include "workspace_defaults.hpp"

#include <cstdlib>
#include <string>

#include "tqdecode/error.hpp"

namespace tqdecode {

namespace {

constexpr int kDefaultMaxBatch = 512;

}  // namespace

int resolve_max_batch(int requested) {
  TQ_REQUIRE(requested >= 0 && requested <= kMaxBatchLimit, "max_batch",
             std::to_string(requested) + " is out of range; accepted: 0 (default) or 1 to " +
                 std::to_string(kMaxBatchLimit));
  // docs/LAUNCHER.md: the caller's value, with an environment override, default 512.
  const char* text = std::getenv("TQDECODE_MAX_BATCH");
  if (text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    TQ_REQUIRE(*end == '\0' && value >= 1 && value <= kMaxBatchLimit, "TQDECODE_MAX_BATCH",
               "'" + std::string(text) + "' is not an integer in 1.." + std::to_string(kMaxBatchLimit));
    return static_cast<int>(value);
  }
  return requested > 0 ? requested : kDefaultMaxBatch;
}

bool switch_from_environment(const char* variable, bool unset_value) {
  const char* text = std::getenv(variable);
  if (text == nullptr || *text == '\0') return unset_value;
  const std::string value(text);
  TQ_REQUIRE(value == "0" || value == "1", variable,
             "'" + value + "' is not a setting; accepted: 1 (on), 0 (off), empty or unset (" +
                 (unset_value ? "on" : "off") + ")");
  return value == "1";
}

}  // namespace tqdecode
