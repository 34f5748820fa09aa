"""Tensor-parallel decode: python/examples/tp_decode.py under torchrun with
two CPU processes (gloo), the CPU op on each rank.

Written with unittest so that pytest and `python3 -m unittest` both run it.
Skipped, with a message, when torch is missing or has no torch.distributed
with gloo. Needs the binding built (-DTQDECODE_PYTHON=ON); see
python/run_tests.sh. The 2-GPU form of the same script (NCCL, CUDA graphs):
python/README.md, "Tensor parallelism".
"""

import os
import pathlib
import subprocess
import sys
import unittest

try:
    import torch
    import torch.distributed as dist
except ImportError:
    raise unittest.SkipTest("torch is not installed: the tensor-parallel decode test needs it")

if not (dist.is_available() and dist.is_gloo_available()):
    raise unittest.SkipTest("this torch has no torch.distributed with gloo: the tensor-parallel decode test skipped")

import tqdecode  # noqa: F401  an ImportError here means the binding is not built: a failure, not a skip

PYTHON_DIR = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = PYTHON_DIR / "examples" / "tp_decode.py"


def run_two_ranks(*options):
    """(exit code, output) of the script on 2 CPU ranks. --standalone lets the
    rendezvous take a free port."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PYTHON_DIR), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
               "--device", "cpu", *options]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    print(done.stdout)
    return done.returncode, done.stdout


class TensorParallelDecodeTest(unittest.TestCase):
    def test_two_cpu_ranks_match_single_process_decodes(self):
        code, output = run_two_ranks()
        self.assertEqual(code, 0, output)
        self.assertIn("all checks passed", output)
        lines = [line for line in output.splitlines() if line.startswith(("PASS", "FAIL"))]
        self.assertEqual(len(lines), 4, output)  # (a) per rank, (b) all heads, (b) exact attention
        self.assertTrue(all(line.startswith("PASS") for line in lines), output)
        for rank in range(2):
            self.assertIn(f"(a) rank {rank} (kv heads [{4 * rank}, {4 * rank + 4})) == the shard decoded alone: "
                          f"0 of", output)
            self.assertRegex(output, rf"rank {rank}: cpu, kv heads .* decode [0-9.]+ us \(median of")

    def test_a_changed_output_bit_fails_the_bitwise_check(self):
        code, output = run_two_ranks("--corrupt-rank", "1", "--batch", "1", "--context", "40")
        self.assertNotEqual(code, 0, output)
        self.assertIn("PASS  (a) rank 0", output)
        self.assertIn("FAIL  (a) rank 1 (kv heads [4, 8)) == the shard decoded alone: 1 of", output)
        self.assertIn("a check failed", output)


if __name__ == "__main__":
    unittest.main(verbosity=2)
