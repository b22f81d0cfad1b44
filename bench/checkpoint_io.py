"""Checkpoint I/O: what a client downloads and how fast checkpoints save and load.

1. Save/load throughput (MB/s) of ``save_pretrained`` / ``load_pretrained`` against plain
   ``safetensors.torch.save_file`` / ``load_file`` of the same tensors, as ratios (> 1: ours
   is faster). Our save adds config.json, fsync and an atomic rename. Both loads end with a
   freshly built model holding the tensors (plain: build + ``load_state_dict(load_file())``,
   which draws every initial weight and copies the file's over it; ours builds on the meta
   device and takes the memory-mapped tensors, with the canonical-name mapping and shape
   checks). Each save goes to a new path.
2. Per tier, ``sliced`` against ``universal``: bytes the loader fetches and time to a ready
   model (sha256 checks included). Files come from a local folder, so "bytes" is exactly
   what a hub client would download.
3. With transformers installed, the same checkpoint opened by transformers against
   ``load_pretrained``: the Llama shape with ``LlamaForCausalLM``, and the same sizes with
   LayerNorm and GELU (not Llama-shaped, so saved with its code) with
   ``AutoModelForCausalLM(trust_remote_code=True)``, which builds our model and fills it
   through transformers' loader. ``ours/transformers`` is our time over theirs: < 1, ours
   is faster (issue 33's target for the Llama shape: at most 1.2).

    python bench/checkpoint_io.py                 # 64M-parameter Llama shape
    python bench/checkpoint_io.py --hidden-size 768 --layers 12 --heads 12 --kv-heads 12 \
        --intermediate-size 3072                  # 134M parameters
    python bench/checkpoint_io.py --smoke         # a 0.2M-parameter model, once each: it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from harness import parse
from safetensors.torch import load_file, save_file

from matformer.modeling import AutoregressiveModel, LayerConfig, ModelConfig, canonical_state_dict
from matformer.modeling.checkpoint import load_pretrained, save_pretrained
from matformer.modeling.checkpoint.export import export_tiers
from matformer.modeling.checkpoint.loader import load_for_tier

MB = 1e6
SMOKE = dict(vocab_size=512, hidden_size=64, layers=2, heads=4, kv_heads=2,
             intermediate_size=256, repeats=1)


def timed(action: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(first: Callable[[], object], second: Callable[[], object], repeats: int
                ) -> tuple[float, float]:
    """Median seconds of each action, run alternately (A B B A A B ...)."""
    times: tuple[list[float], list[float]] = ([], [])
    for round_ in range(repeats):
        order = (0, 1) if round_ % 2 == 0 else (1, 0)
        for which in order:
            action = (first, second)[which]
            start = time.perf_counter()
            action()
            times[which].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--tiers", default="1,2,3")
    parser.add_argument("--repeats", type=int, default=6)
    args = parse(parser, SMOKE)

    config = ModelConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
    )
    model = AutoregressiveModel(config)
    state = {k: v.contiguous() for k, v in canonical_state_dict(model).items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters, {size / MB:.0f} MB fp32")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        written: list[Path] = []

        def plain_save() -> None:
            written.append(root / f"plain{len(written)}.safetensors")
            save_file(state, written[-1])

        def ours_save() -> None:
            written.append(root / f"ours{len(written)}")
            save_pretrained(model, written[-1])

        def plain_load() -> None:
            # the same end state as ours: a built model holding the tensors
            fresh_model = AutoregressiveModel(config)
            fresh_model.load_state_dict(load_file(root / "plain0.safetensors"), strict=False)

        # alternate the two so disk write-back from one save slows both alike
        save_plain, save_ours = interleaved(plain_save, ours_save, args.repeats)
        ours = next(path for path in written if path.is_dir())
        load_plain, load_ours = interleaved(plain_load, lambda: load_pretrained(ours),
                                            args.repeats)
        print(f"\n{'operation':<10}{'plain MB/s':>12}{'ours MB/s':>11}{'ours/plain':>12}")
        for name, a, b in (("save", save_plain, save_ours), ("load", load_plain, load_ours)):
            print(f"{name:<10}{size / MB / a:>12,.0f}{size / MB / b:>11,.0f}{a / b:>12.2f}")

        tiers = [int(t) for t in args.tiers.split(",")]
        export_tiers(ours, tiers)
        print(f"\n{'tier':<6}{'strategy':<11}{'fetched MB':>11}{'of universal':>14}"
              f"{'load s':>9}{'sliced/universal time':>23}")
        for tier in tiers:
            row = {}
            for strategy in ("universal", "sliced"):
                seconds = timed(lambda s=strategy, t=tier: load_for_tier(ours, t, s),
                                args.repeats)
                _, resolved = load_for_tier(ours, tier, strategy)
                fetched = sum((ours.parent / f).stat().st_size for f in resolved.files)
                row[strategy] = (fetched, seconds)
            full_bytes, full_s = row["universal"]
            for strategy, (fetched, seconds) in row.items():
                ratio = f"{seconds / full_s:.2f}" if strategy == "sliced" else ""
                print(f"{tier:<6}{strategy:<11}{fetched / MB:>11.1f}"
                      f"{fetched / full_bytes:>13.0%} {seconds:>9.2f}{ratio:>23}")
        if importlib.util.find_spec("transformers") is not None:
            _transformers_loads(config, ours, root, args.repeats)
    print(f"\n(torch {torch.__version__}, {torch.get_num_threads()} threads; files on local disk)")


def _transformers_loads(config: ModelConfig, llama: Path, root: Path, repeats: int) -> None:
    """Time to a ready model: transformers against ``load_pretrained``, same files."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("matformer").setLevel(logging.ERROR)
    other = dataclasses.replace(config, default_layer=LayerConfig(
        normalization="layernorm", ffn_activation="gelu"))
    custom = root / "layernorm_gelu"
    save_pretrained(AutoregressiveModel(other), custom)
    contenders = (
        ("llama", llama, lambda: LlamaForCausalLM.from_pretrained(llama)),
        ("layernorm+gelu (code)", custom,
         lambda: AutoModelForCausalLM.from_pretrained(custom, trust_remote_code=True)),
    )
    print(f"\n{'shape':<24}{'transformers s':>15}{'ours s':>9}{'ours/transformers':>19}")
    for name, folder, theirs in contenders:
        theirs()  # once untimed: transformers imports and caches the checkpoint's code
        hf_s, ours_s = interleaved(theirs, lambda f=folder: load_pretrained(f), repeats)
        print(f"{name:<24}{hf_s:>15.3f}{ours_s:>9.3f}{ours_s / hf_s:>19.2f}")


if __name__ == "__main__":
    main()
