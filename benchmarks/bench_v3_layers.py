"""DeepSeek-V3 at its real widths, a few layers, block-fp8 against bf16 on one GPU.

Writes a random-weight checkpoint of DeepSeek-V3's shapes (hidden 7168, 128 heads,
q_lora 1536, L 512, R 64, 256 routed experts of 2048, top 8 of 8 groups (4 kept), one
shared expert, vocabulary 129280), every layer an MoE layer, once with its linear
weights in block fp8 (128 x 128 blocks, as DeepSeek ships them) and once in bf16,
drawn on the GPU. For each it loads the checkpoint with `LLM` (CUDA graphs) twice:
with all `--layers` layers and with one (the same files; layers past
num_hidden_layers are not read), and reports the load time, the weights' GiB
(`LLM.memory`), and decode step times at batch 1, 32 and 128. A layer's time is the
difference of the two models' step times divided by the layers between them, so that
the embedding, the LM head and sampling drop out; likewise a layer's weight GiB.

    python -m benchmarks.bench_v3_layers --layers 3 --out v3_layers.json

The checkpoints are written to `--dir` (default: a temporary directory on the local
disk) one at a time and deleted after use: the bf16 one of 3 layers takes ~72 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import time_steps
from pagedmla import LLM
from pagedmla.models.tiny import tiny_config, write_tiny_checkpoint

BATCHES = (1, 32, 128)


def v3_config(layers: int) -> dict:
    """DeepSeek-V3's config.json fields at `layers` layers, all of them MoE layers."""
    config = tiny_config()
    config.update(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=layers, first_k_dense_replace=0,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 40.0,
                      "original_max_position_embeddings": 4096, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    )
    return config


def _one_layer_view(directory: Path, root: Path) -> Path:
    """A directory with `directory`'s files and a config of one layer."""
    view = root / "one_layer"
    view.mkdir()
    for file in directory.iterdir():
        if file.name != "config.json":
            os.symlink(file, view / file.name)
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (view / "config.json").write_text(json.dumps(config))
    return view


def measure(path: Path, args: argparse.Namespace) -> dict:
    """Load `path` and time decode steps at each batch size."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm = LLM(str(path), dtype=torch.bfloat16, device="cuda", block_size=64,
              num_kv_blocks=args.kv_blocks, max_num_seqs=max(BATCHES),
              max_num_batched_tokens=16384, kv_cache_dtype=args.kv_cache_dtype)
    wall = time.perf_counter() - start
    row = {"weight_gib": llm.memory.weight_gib, "load_s": llm.memory.load_seconds,
           "startup_s": wall, "step_ms": {}}
    for batch in BATCHES:
        row["step_ms"][batch] = time_steps(llm, batch, args.prompt_len, args.steps)["step_ms"]
    llm.close()
    del llm
    torch.cuda.empty_cache()
    return row


def run(fp8: bool, args: argparse.Namespace, root: Path) -> dict:
    """Write the checkpoint, measure its full and one-layer models, delete it."""
    directory = root / ("fp8" if fp8 else "bf16")
    start = time.perf_counter()
    write_tiny_checkpoint(directory, fp8=fp8, config=v3_config(args.layers),
                          dtype=torch.bfloat16, device="cuda")
    torch.cuda.empty_cache()
    written = time.perf_counter() - start
    full = measure(directory, args)
    one = measure(_one_layer_view(directory, root), args)
    shutil.rmtree(root / "one_layer")
    shutil.rmtree(directory)
    between = args.layers - 1
    per_layer = {b: (full["step_ms"][b] - one["step_ms"][b]) / between for b in BATCHES}
    return {"write_s": written, "full": full, "one_layer": one,
            "layer_weight_gib": (full["weight_gib"] - one["weight_gib"]) / between,
            "layer_step_ms": per_layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kv-blocks", type=int, default=4096)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--formats", default="fp8,bf16")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written")
    parser.add_argument("--out", default="v3_layers.json")
    args = parser.parse_args()
    if args.layers < 2:
        parser.error("--layers must be at least 2 (a layer is the difference of two models)")
    results = {"gpu": torch.cuda.get_device_name(), "args": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for name in args.formats.split(","):
            results["runs"][name] = run(name == "fp8", args, Path(root))
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print(f"\nDeepSeek-V3 widths, {args.layers} MoE layers, context ~{args.prompt_len}, "
          f"CUDA graphs, {results['gpu']}")
    print("| weights | load s | weights GiB | GiB / layer | "
          + " | ".join(f"ms / layer @{b}" for b in BATCHES) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(BATCHES))
    for name, r in results["runs"].items():
        steps = " | ".join(f"{r['layer_step_ms'][b]:.3f}" for b in BATCHES)
        print(f"| {name} | {r['full']['load_s']:.1f} | {r['full']['weight_gib']:.2f} | "
              f"{r['layer_weight_gib']:.3f} | {steps} |")


if __name__ == "__main__":
    main()
