"""The package as pip builds it (the root pyproject.toml, scikit-build-core):
a wheel built from this tree holds the pure-Python modules, the binding
``tqdecode/_C.so`` and the vLLM plugin entry point, and once installed into
a directory of its own it decodes, in a fresh interpreter that does not see
python/, bit for bit as the package under test does. The wheel is built
without CUDA (the CPU ops are the same C++ reference either way), so the
check stays quick; it skips with a message where scikit-build-core, CMake or
Ninja is missing (scripts/python_env.sh installs scikit-build-core).
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile

try:
    import torch
except ImportError:
    raise unittest.SkipTest("torch is not installed: the PyTorch binding tests need it")

import tqdecode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def project_version():
    """The version CMakeLists.txt's project() sets: the library's, the binding's and the package's."""
    with open(os.path.join(ROOT, "CMakeLists.txt")) as cmake:
        return re.search(r"project\(tqdecode VERSION ([0-9.]+)", cmake.read()).group(1)


class VersionTest(unittest.TestCase):
    def test_the_binding_reports_the_projects_version(self):
        self.assertEqual(tqdecode.__version__, project_version())

# Runs in a fresh interpreter: one decode of a seeded problem on the CPU,
# saved with the path of the tqdecode it imported.
DECODE = """
import math, sys, torch, tqdecode
preset, head_dim, block_size, num_kv_heads, num_q_heads = "turboquant_4bit_nc", 128, 16, 2, 8
layout = tqdecode.cache_layout(preset, head_dim, block_size, num_kv_heads)
centroids, Pi, _ = tqdecode.make_model_constants(preset, head_dim, seed=3)
kv_cache = tqdecode.allocate_cache(24, block_size, num_kv_heads, head_dim, preset)
g = torch.Generator().manual_seed(11)
key, value = torch.randn(2, 24 * block_size, num_kv_heads, head_dim, generator=g).to(torch.bfloat16)
tqdecode.store(key, value, kv_cache, torch.arange(24 * block_size), Pi, centroids, preset)
query = torch.randn(2, num_q_heads, head_dim, generator=g).to(torch.bfloat16)
block_table = torch.stack([torch.arange(24, dtype=torch.int32), torch.arange(23, -1, -1, dtype=torch.int32)])
seq_lens = torch.tensor([300, 129], dtype=torch.int32)
out = tqdecode.turboquant_decode_attention(query, kv_cache, block_table, seq_lens, Pi, centroids,
                                           1 / math.sqrt(head_dim), **layout.decode_kwargs())
torch.save({"file": tqdecode.__file__, "out": out}, sys.argv[1])
"""


def run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-4000:]}"
                             f"\n{result.stderr[-4000:]}")
    return result


@unittest.skipUnless(importlib.util.find_spec("scikit_build_core"),
                     "scikit-build-core is not installed: pip cannot build the package here")
@unittest.skipUnless(shutil.which("cmake") and shutil.which("ninja"), "CMake or Ninja is not on PATH")
class WheelTest(unittest.TestCase):
    def test_wheel_holds_the_binding_and_decodes_like_this_package(self):
        with tempfile.TemporaryDirectory() as work:
            dist, site = os.path.join(work, "dist"), os.path.join(work, "site")
            run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--quiet", "-w", dist,
                 "-Ccmake.define.TQDECODE_CUDA=OFF", f"-Cbuild-dir={os.path.join(work, 'build')}", ROOT])
            wheels = os.listdir(dist)
            self.assertEqual(len(wheels), 1, wheels)
            self.assertTrue(wheels[0].startswith(f"tqdecode-{project_version()}-"), wheels[0])
            with zipfile.ZipFile(os.path.join(dist, wheels[0])) as wheel:
                names = set(wheel.namelist())
                for module in ("_C.so", "__init__.py", "_library.py", "hf_cache.py", "vllm_plugin.py"):
                    self.assertIn(f"tqdecode/{module}", names)
                entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
                self.assertIn("tqdecode = tqdecode.vllm_plugin:register", wheel.read(entry_points).decode())

            run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", site,
                 os.path.join(dist, wheels[0])])
            installed = self.decode(site, work)
            self.assertTrue(installed["file"].startswith(site), installed["file"])
            # The same problem through the package under test.
            under_test = self.decode(os.path.dirname(os.path.dirname(tqdecode.__file__)), work)
            self.assertEqual(os.path.dirname(under_test["file"]), os.path.dirname(tqdecode.__file__))
            self.assertFalse(bool(torch.isnan(under_test["out"]).any()))
            self.assertTrue(torch.equal(installed["out"], under_test["out"]))

    @staticmethod
    def decode(path, work):
        """DECODE in an interpreter whose tqdecode comes from `path`, without a GPU."""
        saved = os.path.join(work, "out.pt")
        run([sys.executable, "-c", DECODE, saved], cwd=work,
            env={**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""})
        return torch.load(saved)

if __name__ == "__main__":
    unittest.main()
