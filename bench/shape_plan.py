"""The benchmark's shapes (bench/shapes.json) for the Python programs.

Parses and checks the shape list as tqdecode_bench does (bench_shapes.cpp),
draws the same sequence lengths (SplitMix64, tqdecode::Rng) and sizes one
instance and the instance counts with the same rules, for the compressed
cache (tq_plan) and for the bf16 baseline's contiguous K/V (bf16_plan).
Needs no torch and no GPU.
"""
import json
import math
from pathlib import Path

DEFAULT_SHAPES = Path(__file__).resolve().parent / "shapes.json"

LENGTHS_SEED = 0x6C656E67746873  # bench_shapes.hpp kLengthsSeed
MAX_SINGLE_STEP_LAYERS = 8
MIN_SINGLE_STEP_LAYERS = 2
SINGLE_STEP_BUDGET_BYTES = 16 << 30
BACK_TO_BACK_BYTES = 1 << 30
ENGINE_LAYERS = 16
GEMM_DIM = 8192  # the engine-like step's weights: [GEMM_DIM, GEMM_DIM] bf16 per layer

# preset: (key bits, value bits, fp8 keys)
PRESETS = {
    "turboquant_4bit_nc": (4, 4, False),
    "turboquant_k3v4_nc": (3, 4, False),
    "turboquant_3bit_nc": (3, 3, False),
    "turboquant_k8v4": (8, 4, True),
}
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128)
MAX_GROUP = 16
REQUESTS = ("automatic", "hopper", "cuda_generic", "cuda_generic_scalar", "hopper_warp_specialized")
DEFAULTS = {"lengths": "uniform", "max_model_len": None, "scores": "flat", "q_len": 1, "tp": None,
            "back_to_back": False, "engine": False, "requests": ["automatic"], "quick": False, "order": "blocks",
            "norm_correction": False}
REQUIRED = ("name", "preset", "B", "L", "Hq", "Hk", "D", "block_size")


class ShapeError(ValueError):
    pass


def _positive_int(shape, key, where):
    value = shape[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 30:
        raise ShapeError(f"{where}: \"{key}\" must be a positive integer, not {value!r}")
    return value


def check_shape(raw, where):
    """The shape with its defaults filled in; raises ShapeError naming the field."""
    if not isinstance(raw, dict):
        raise ShapeError(f"{where}: expected an object")
    unknown = set(raw) - set(REQUIRED) - set(DEFAULTS)
    if unknown:
        raise ShapeError(f"{where}: {', '.join(sorted(unknown))} is not a shape field")
    missing = [key for key in REQUIRED if key not in raw]
    if missing:
        raise ShapeError(f"{where}: {', '.join(missing)} is required")
    shape = {**DEFAULTS, **raw}
    where = f"{where} ({shape['name']})"
    for key in ("B", "L", "Hq", "Hk", "D", "block_size", "q_len"):
        _positive_int(shape, key, where)
    for key in ("max_model_len", "tp"):
        if shape[key] is not None:
            _positive_int(shape, key, where)
    if shape["preset"] not in PRESETS:
        raise ShapeError(f"{where}: preset {shape['preset']!r}; accepted: {', '.join(PRESETS)}")
    if shape["D"] not in HEAD_DIMS or shape["block_size"] not in BLOCK_SIZES:
        raise ShapeError(f"{where}: D must be one of {HEAD_DIMS} and block_size one of {BLOCK_SIZES}")
    if shape["Hq"] % shape["Hk"] or not 1 <= shape["Hq"] // shape["Hk"] <= MAX_GROUP:
        raise ShapeError(f"{where}: Hq / Hk must be a whole group of 1 to {MAX_GROUP}")
    if shape["lengths"] not in ("uniform", "ragged") or shape["scores"] not in ("flat", "peaked"):
        raise ShapeError(f"{where}: lengths must be uniform or ragged, scores flat or peaked")
    if shape["order"] not in ("blocks", "token_slots"):
        raise ShapeError(f"{where}: order must be blocks or token_slots")
    if shape["norm_correction"] and (shape["order"] != "token_slots" or PRESETS[shape["preset"]][2]):
        raise ShapeError(f"{where}: norm_correction needs order token_slots and MSE keys")
    for key in ("back_to_back", "engine", "quick", "norm_correction"):
        if not isinstance(shape[key], bool):
            raise ShapeError(f"{where}: \"{key}\" must be true or false")
    requests = shape["requests"]
    if not requests or requests[0] != "automatic" or any(r not in REQUESTS for r in requests):
        raise ShapeError(f"{where}: requests must start with \"automatic\"; accepted: {', '.join(REQUESTS)}")
    longest = max_possible_length(shape)
    if shape["max_model_len"] is not None and shape["max_model_len"] < longest:
        raise ShapeError(f"{where}: max_model_len {shape['max_model_len']} is below the longest sequence the lengths "
                         f"allow ({longest})")
    if shape["engine"] and shape["q_len"] > 1:
        raise ShapeError(f"{where}: \"engine\" needs q_len 1")
    return shape


def load_shapes(path=DEFAULT_SHAPES):
    data = json.loads(Path(path).read_text())
    items = data.get("shapes") if isinstance(data, dict) else None
    if not items:
        raise ShapeError(f"{path}: expected {{\"shapes\": [ ... ]}} with at least one shape")
    shapes = [check_shape(raw, f"{path}: shapes[{i}]") for i, raw in enumerate(items)]
    names = [s["name"] for s in shapes]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ShapeError(f"{path}: more than one shape named {', '.join(duplicated)}")
    return shapes


def select(shapes, quick=False, only=None):
    """--shapes (in the order given) and --quick (the shapes marked quick), as tqdecode_bench selects."""
    if only:
        by_name = {s["name"]: s for s in shapes}
        missing = [name for name in only if name not in by_name]
        if missing:
            raise ShapeError(f"--shapes: no shape named {', '.join(missing)}")
        shapes = [by_name[name] for name in only]
    if quick:
        shapes = [s for s in shapes if s["quick"]]
    if not shapes:
        raise ShapeError("no shape selected")
    return shapes


class SplitMix64:
    """tqdecode::Rng: the same draws in C++ and here."""
    MASK = (1 << 64) - 1

    def __init__(self, seed):
        self.state = seed & self.MASK

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)

    def below(self, n):
        return self.next_u64() % n


def max_possible_length(shape):
    return shape["L"] // 4 + 3 * shape["L"] // 2 if shape["lengths"] == "ragged" else shape["L"]


def sequence_lengths(shape):
    """All L (uniform), or L/4 + a draw from [0, 3L/2] per sequence (ragged): mean L."""
    if shape["lengths"] == "uniform":
        return [shape["L"]] * shape["B"]
    rng = SplitMix64(LENGTHS_SEED)
    span = 3 * shape["L"] // 2 + 1
    return [max(1, shape["L"] // 4 + rng.below(span)) for _ in range(shape["B"])]


def _instance_counts(shape, instance_bytes):
    layers = min(MAX_SINGLE_STEP_LAYERS, max(MIN_SINGLE_STEP_LAYERS, SINGLE_STEP_BUDGET_BYTES // instance_bytes))
    back_to_back = max(2, -(-BACK_TO_BACK_BYTES // instance_bytes)) if shape["back_to_back"] else 0
    engine_layers = ENGINE_LAYERS if shape["engine"] else 0
    return {"layers": layers, "back_to_back_instances": back_to_back, "engine_layers": engine_layers,
            "instances": max(layers, back_to_back, engine_layers)}


def bytes_per_token_head(preset, head_dim):
    key_bits, value_bits, key_fp8 = PRESETS[preset]
    fields = 2 if key_fp8 else 3
    return -(-head_dim * key_bits // 8) + -(-head_dim * value_bits // 8) + 2 * fields


def tq_plan(shape):
    """tqdecode_bench's plan_instances: sizes of one instance and the instance counts."""
    lengths = sequence_lengths(shape)
    bs = shape["block_size"]
    key_bits, _, key_fp8 = PRESETS[shape["preset"]]
    per_token_head = bytes_per_token_head(shape["preset"], shape["D"])
    blocks = sum(-(-n // bs) for n in lengths)
    width = -(-(shape["max_model_len"] or max(lengths)) // bs)
    query_rows = shape["B"] * shape["q_len"]
    query = query_rows * shape["Hq"] * shape["D"]
    constants = 0 if key_fp8 else shape["D"] ** 2 + (1 << key_bits)
    cache_bytes = sum(lengths) * shape["Hk"] * per_token_head
    instance_bytes = (blocks * bs * shape["Hk"] * per_token_head + 2 * query * 2 + shape["B"] * width * 4
                      + shape["B"] * 4 + constants * 4)
    if shape["q_len"] > 1:  # the rows form's block table and lengths (a row per token)
        instance_bytes += query_rows * width * 4 + query_rows * 4
    return {"tokens": sum(lengths), "max_len": max(lengths), "table_width": width, "blocks": blocks,
            "cache_bytes": cache_bytes, "bytes": cache_bytes + 2 * query * 2, "instance_bytes": instance_bytes,
            **_instance_counts(shape, instance_bytes)}


def bf16_key(shape):
    """The logical bf16 problem: shapes that differ only in cache format, table width or scores share it."""
    return (shape["B"], shape["L"], shape["Hq"], shape["Hk"], shape["D"], shape["lengths"], shape["q_len"])


def bf16_plan(shape):
    """bf16 K/V of the same logical problem (contiguous, no pages): bytes and instance counts."""
    lengths = sequence_lengths(shape)
    query = shape["B"] * shape["q_len"] * shape["Hq"] * shape["D"]
    kv = 2 * sum(lengths) * shape["Hk"] * shape["D"] * 2
    total = kv + 2 * query * 2
    return {"tokens": sum(lengths), "max_len": max(lengths), "bytes": total, "instance_bytes": total,
            **_instance_counts(shape, total)}


def gemm_weight_bytes():
    return GEMM_DIM * GEMM_DIM * 2


def single_step_replays(layers, minimum=30):
    """Whole cycles of the layers, at least `minimum` replays (tqdecode_bench's time_single_steps)."""
    return math.ceil(minimum / layers) * layers
