// tqdecode_bench --self-check: the input generators checked on the CPU.
#pragma once

namespace tqbench {

/// Builds small instances with the same element functions the fill kernels
/// use (bench_inputs.hpp) and checks, against the library's CPU reference:
/// the ragged lengths and block tables pass validate_decode_host_contents;
/// every planted token scores its target for the group's first query head;
/// the reference decode is finite. Prints the score statistics that
/// bench_inputs.hpp quotes. Returns 0 when every check passes.
int run_self_check();

}  // namespace tqbench
