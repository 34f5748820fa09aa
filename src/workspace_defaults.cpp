#include "workspace_defaults.hpp"

#include <cstdlib>
#include <string>

#include "tqdecode/error.hpp"

namespace tqdecode {

namespace {

constexpr int kDefaultMaxBatch = 512;

}  // namespace

int resolve_max_batch(int requested) {
  TQ_REQUIRE(requested >= 0, "max_batch", std::to_string(requested) + " is negative; accepted: 0 (default) or >= 1");
  if (requested > 0) return requested;
  const char* text = std::getenv("TQDECODE_MAX_BATCH");
  if (text == nullptr || *text == '\0') return kDefaultMaxBatch;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  TQ_REQUIRE(*end == '\0' && value >= 1 && value <= (1 << 20), "TQDECODE_MAX_BATCH",
             "'" + std::string(text) + "' is not an integer in 1..1048576");
  return static_cast<int>(value);
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
