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

bool device_checks_from_environment() {
  const char* text = std::getenv("TQDECODE_DEVICE_CHECKS");
  if (text == nullptr) return false;
  const std::string value(text);
  TQ_REQUIRE(value.empty() || value == "0" || value == "1", "TQDECODE_DEVICE_CHECKS",
             "'" + value + "' is not a setting; accepted: 1 (on), 0 or unset (off)");
  return value == "1";
}

}  // namespace tqdecode
