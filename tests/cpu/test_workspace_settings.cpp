// DecodeWorkspace settings on the host: the device-side check and
// programmatic launch switches and their environment variables, the empty
// check report before any device decode, and max_batch with its environment
// variable. Nothing here touches a GPU.
#include <gtest/gtest.h>

#include <utility>

#include "expect_error.hpp"
#include "scoped_variable.hpp"
#include "tqdecode/decode.hpp"

namespace tqdecode::test {
namespace {

constexpr const char* kDeviceChecks = "TQDECODE_DEVICE_CHECKS";
constexpr const char* kMaxBatch = "TQDECODE_MAX_BATCH";
constexpr const char* kProgrammaticLaunch = "TQDECODE_PROGRAMMATIC_LAUNCH";

TEST(WorkspaceSettings, DeviceChecksAreOffByDefault) {
  const ScopedVariable unset(kDeviceChecks, nullptr);
  EXPECT_FALSE(DecodeWorkspace().device_checks());
}

TEST(WorkspaceSettings, DeviceChecksFollowTheEnvironmentVariable) {
  for (const auto& [text, expected] : {std::pair{"1", true}, std::pair{"0", false}, std::pair{"", false}}) {
    const ScopedVariable set(kDeviceChecks, text);
    EXPECT_EQ(DecodeWorkspace().device_checks(), expected) << "TQDECODE_DEVICE_CHECKS='" << text << "'";
  }
}

TEST(WorkspaceSettings, BadDeviceChecksVariableNamesIt) {
  for (const char* text : {"yes", "2", " 1", "on", "true"}) {
    const ScopedVariable set(kDeviceChecks, text);
    SCOPED_TRACE(text);
    expect_error_naming(kDeviceChecks, [] { DecodeWorkspace workspace; });
  }
}

TEST(WorkspaceSettings, SetDeviceChecksOverridesTheEnvironment) {
  const ScopedVariable set(kDeviceChecks, "1");
  DecodeWorkspace workspace;
  ASSERT_TRUE(workspace.device_checks());
  workspace.set_device_checks(false);
  EXPECT_FALSE(workspace.device_checks());
  workspace.set_device_checks(true);
  EXPECT_TRUE(workspace.device_checks());
}

TEST(WorkspaceSettings, ProgrammaticLaunchIsOnByDefaultAndFollowsTheEnvironmentVariable) {
  {
    const ScopedVariable unset(kProgrammaticLaunch, nullptr);
    EXPECT_TRUE(DecodeWorkspace().programmatic_launch());
  }
  for (const auto& [text, expected] : {std::pair{"1", true}, std::pair{"0", false}, std::pair{"", true}}) {
    const ScopedVariable set(kProgrammaticLaunch, text);
    EXPECT_EQ(DecodeWorkspace().programmatic_launch(), expected) << "TQDECODE_PROGRAMMATIC_LAUNCH='" << text << "'";
  }
  for (const char* text : {"off", "2", "0 ", "false"}) {
    const ScopedVariable set(kProgrammaticLaunch, text);
    SCOPED_TRACE(text);
    expect_error_naming(kProgrammaticLaunch, [] { DecodeWorkspace workspace; });
  }
}

TEST(WorkspaceSettings, SetProgrammaticLaunchOverridesTheEnvironment) {
  const ScopedVariable set(kProgrammaticLaunch, "0");
  DecodeWorkspace workspace;
  ASSERT_FALSE(workspace.programmatic_launch());
  workspace.set_programmatic_launch(true);
  EXPECT_TRUE(workspace.programmatic_launch());
  workspace.set_programmatic_launch(false);
  EXPECT_FALSE(workspace.programmatic_launch());
}

// No decode has run on a device, so there is nothing to read and no CUDA
// call is made (this runs on machines without a GPU).
TEST(WorkspaceSettings, CheckReportIsEmptyBeforeAnyDeviceDecode) {
  DecodeWorkspace workspace;
  workspace.set_device_checks(true);
  const DeviceCheckReport report = workspace.device_check_report();
  EXPECT_EQ(report.checked_calls, 0);
  EXPECT_EQ(report.failed_sequences, 0);
  EXPECT_EQ(report.bad_seq_lens, 0);
  EXPECT_EQ(report.bad_block_entries, 0);
  EXPECT_EQ(report.first_bad_seq_len.sequence, -1);
  EXPECT_EQ(report.first_bad_block_entry.sequence, -1);
  EXPECT_EQ(report.first_failed_sequence(), -1);
}

TEST(WorkspaceSettings, FirstFailedSequenceIsTheLowestOfBothKinds) {
  DeviceCheckReport report;
  report.first_bad_seq_len = {5, -3};
  EXPECT_EQ(report.first_failed_sequence(), 5);
  report.first_bad_block_entry = {2, 1, 999};
  EXPECT_EQ(report.first_failed_sequence(), 2);
  report.first_bad_seq_len = {};
  EXPECT_EQ(report.first_failed_sequence(), 2);
}

// docs/LAUNCHER.md: the caller's value, with an environment override, default 512.
TEST(WorkspaceSettings, MaxBatchFromTheArgumentWithTheEnvironmentOverriding) {
  {
    const ScopedVariable unset(kMaxBatch, nullptr);
    EXPECT_EQ(DecodeWorkspace().max_batch(), 512);
    EXPECT_EQ(DecodeWorkspace(24).max_batch(), 24);
    expect_error_naming("max_batch", [] { DecodeWorkspace workspace(-1); });
    expect_error_naming("max_batch", [] { DecodeWorkspace workspace((1 << 20) + 1); });
  }
  {
    const ScopedVariable set(kMaxBatch, "96");
    EXPECT_EQ(DecodeWorkspace().max_batch(), 96);
    EXPECT_EQ(DecodeWorkspace(24).max_batch(), 96);  // the environment overrides the argument
  }
  for (const char* text : {"0", "-4", "12x", "2000000"}) {
    const ScopedVariable set(kMaxBatch, text);
    SCOPED_TRACE(text);
    expect_error_naming(kMaxBatch, [] { DecodeWorkspace workspace; });
  }
}

}  // namespace
}  // namespace tqdecode::test
