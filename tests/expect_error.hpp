// Test helper: a call must throw tqdecode::Error naming `argument`.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "tqdecode/error.hpp"

namespace tqdecode::test {

template <typename Call>
void expect_error_naming(const std::string& argument, Call&& call) {
  try {
    call();
    ADD_FAILURE() << "no error, expected one naming " << argument;
  } catch (const tqdecode::Error& error) {
    EXPECT_EQ(error.argument(), argument) << error.what();
  }
}

}  // namespace tqdecode::test
