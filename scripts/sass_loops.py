#!/usr/bin/env python3
"""Static instruction counts of the kernels' loops, from their SASS.

Disassembles the library's CUDA objects (cuobjdump -sass) for one
architecture and prints, per kernel (demangled, filtered by --filter), its
registers, stack bytes (spills), its instruction count and its largest
loops: every backward branch closes a loop from its target to the branch;
a loop's count is the instructions between the two, the instruction classes
say what it spends them on. By default only innermost loops are shown (a
kernel's main loop over its tiles is usually its largest; a loop body may
hold several tiles where the compiler unrolled them); --all-loops adds the
loops around them, each counting the inner ones' instructions once. No GPU
is needed: the counts
are of the code, not of its execution (which instructions a run issues per
tile is the profiler's business: scripts/profile.sh).

    python3 scripts/sass_loops.py --filter 'warp_specialized' --loops 3
    python3 scripts/sass_loops.py --objects build/CMakeFiles/tqdecode.dir/src/cuda/tensor_core/instances/mse4_d128.cu.o

cuobjdump comes with the CUDA toolkit; where the toolkit has none, the
PyPI wheel nvidia-cuda-cuobjdump has it (pass --cuobjdump PATH).
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

FUNCTION = re.compile(r"^\s*Function : (\S+)")
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA(?:\.\S+)?\s+(?:\S+,\s*)?0x([0-9a-f]+)")
RESOURCES = re.compile(r"Function (\S+):\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")

# The classes a decode loop's instructions fall into, by opcode without its
# modifiers (IMAD.WIDE is IMAD); the uniform datapath's opcodes (UIADD3,
# ULOP3, ...) count with their vector twins.
CLASSES = {
    "tensor core": "HMMA HGMMA WARPGROUP",
    "shared load": "LDS LDSM",
    "shared store": "STS",
    "local (spills)": "LDL STL",
    "global / bulk": "LDG STG LDGSTS LDGDEPBAR BLKCP TMALDG ACQBULK ATOMG RED",
    "barrier / sync": "BAR SYNCS DEPBAR WARPSYNC MEMBAR FENCE ERRBAR CGAERRBAR CCTL ENDCOLLECTIVE ELECT",
    "byte permute": "PRMT",
    "logic / shift": "LOP3 SHF BFE BFI SGXT FLO POPC BMSK BREV",
    "fp16 math": "HADD2 HMUL2 HFMA2 HMNMX2 HSETP2 HSET2",
    "fp32 math": "FADD FMUL FFMA FMNMX FSETP FSEL FSET FCHK MUFU",
    "fp64 math": "DADD DMUL DFMA DSETP",
    "conversion": "F2F F2I I2F F2FP I2FP F2IP",
    "integer": "IADD3 IMAD ISETP LEA IMNMX IABS VIADD VIMNMX VIADDMNMX ISCADD",
    "move / select": "MOV MOVM SEL SHFL P2R R2P R2UR S2R S2UR CS2R VOTE VOTEU PLOP3 LDC LDCU",
    "branch": "BRA BSSY BSYNC EXIT PREEXIT RET CALL YIELD BREAK NANOSLEEP",
}
CLASS_OF = {op: name for name, ops in CLASSES.items() for op in ops.split()}


def opcode(text):
    """The opcode of an instruction's text without its predicate (@P0, @!UP1) and modifiers."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def instruction_class(op):
    if op not in CLASS_OF and op.startswith("U"):
        op = op[1:]
    return CLASS_OF.get(op, "other")


def parse_sass(text):
    """{mangled function: [(address, opcode, text)]} of cuobjdump -sass output (NOPs left out)."""
    functions = {}
    current = None
    for line in text.splitlines():
        match = FUNCTION.match(line)
        if match:
            current = functions.setdefault(match.group(1), [])
            continue
        match = INSTRUCTION.match(line)
        if match and current is not None:
            op = opcode(match.group(2))
            if op != "NOP":
                current.append((int(match.group(1), 16), op, match.group(2)))
    return functions


def loops(instructions):
    """Each backward branch's loop: (first address, branch address, instructions, innermost), largest first.

    Loops sharing a first address (a loop with a second back edge) are one.
    A loop is innermost when no other loop lies inside it; a kernel's main
    loop over its tiles is usually its largest innermost loop (its rare
    paths, such as a rescale, are forward branches inside it)."""
    spans = {}
    for address, op, text in instructions:
        target = BRANCH_TARGET.search(text) if op == "BRA" else None
        if target and int(target.group(1), 16) < address:  # not forward, nor the padding's branch to itself
            start = int(target.group(1), 16)
            spans[start] = max(spans.get(start, address), address)
    found = []
    for start, end in spans.items():
        inner = any(start <= s and e <= end and (s, e) != (start, end) for s, e in spans.items())
        body = [i for i in instructions if start <= i[0] <= end]
        found.append((start, end, body, not inner))
    found.sort(key=lambda loop: -len(loop[2]))
    return found


def demangle(names):
    if not names or shutil.which("c++filt") is None:
        return {name: name for name in names}
    result = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return dict(zip(names, result.stdout.splitlines()))


def shorten(name):
    """A demangled kernel name without its namespaces and parameter list."""
    name = re.sub(r"\(anonymous namespace\)::|tqdecode::|cuda::|tensor_core::|specialized::", "", name)
    depth, end = 0, len(name)
    for i, ch in enumerate(name):  # the parameter list starts at the first '(' outside the template arguments
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            end = i
            break
    return name[:end]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", nargs="*", help="CUDA object files (default: the library's in --build)")
    parser.add_argument("--build", default="build", help="build directory (default: build)")
    parser.add_argument("--arch", default="sm_90a", help="architecture of the SASS to count (default: sm_90a)")
    parser.add_argument("--filter", default="", help="regular expression on the demangled kernel name")
    parser.add_argument("--loops", type=int, default=2, help="largest loops to show per kernel (default: 2)")
    parser.add_argument("--all-loops", action="store_true", help="outer loops too (default: innermost loops only)")
    parser.add_argument("--cuobjdump", default=None, help="cuobjdump to use (default: PATH, then /usr/local/cuda/bin)")
    args = parser.parse_args()

    cuobjdump = args.cuobjdump or shutil.which("cuobjdump")
    if cuobjdump is None and os.path.exists("/usr/local/cuda/bin/cuobjdump"):
        cuobjdump = "/usr/local/cuda/bin/cuobjdump"
    if cuobjdump is None:
        sys.exit("sass_loops.py: no cuobjdump on PATH or in /usr/local/cuda/bin; pass --cuobjdump PATH")
    objects = args.objects or sorted(glob.glob(os.path.join(args.build, "CMakeFiles/tqdecode.dir/**/*.cu.o"),
                                               recursive=True))
    if not objects:
        sys.exit(f"sass_loops.py: no CUDA objects under {args.build}; build the library first or pass --objects")

    pattern = re.compile(args.filter)
    for path in objects:
        sass = subprocess.run([cuobjdump, "-sass", "-arch", args.arch, path], capture_output=True, text=True)
        if sass.returncode != 0:
            continue  # no code for this architecture in the object
        usage = subprocess.run([cuobjdump, "-res-usage", "-arch", args.arch, path], capture_output=True, text=True)
        resources = {m.group(1): m.groups()[1:] for m in RESOURCES.finditer(usage.stdout)}
        functions = parse_sass(sass.stdout)
        names = demangle(list(functions))
        for mangled, instructions in functions.items():
            name = shorten(names[mangled])
            if not pattern.search(name):
                continue
            registers, stack, _shared, _local = resources.get(mangled, ("?", "?", "?", "?"))
            print(f"{name}  [{os.path.basename(path)}]")
            print(f"  {len(instructions)} instructions, {registers} registers, {stack} bytes of stack (spills, local arrays)")
            shown = [loop for loop in loops(instructions) if args.all_loops or loop[3]]
            for start, end, body, innermost in shown[:args.loops]:
                classes = collections.Counter(instruction_class(op) for _, op, _ in body)
                spread = ", ".join(f"{name} {count}" for name, count in classes.most_common())
                kind = "innermost loop" if innermost else "loop"
                print(f"  {kind} 0x{start:x}-0x{end:x}: {len(body)} instructions ({spread})")


if __name__ == "__main__":
    main()
