"""Standalone training: `matformer-client train` without a server, also `matformer-train`.

It reads its sequences from an MDAT container (by default the Python standard library's
docstrings, built on first use with no download), in token-budget batches split into
microbatches. It trains every requested tier of one set of weights, shows its progress and the
loss per tier as it goes, then evaluates each tier on held-out sequences. Everything a run
writes is in one folder, ``--out``:

    OUT/   config.json, model.safetensors, tokenizer.json, tokenizer_config.json (the final
           model: transformers' AutoTokenizer and pipeline open OUT alone), metrics.json,
           matformer_data.json (what it trained on, for matformer-eval), and later the tier
           slices matformer-export-tiers cuts (OUT/tier1/, ...)
    OUT/checkpoints/step-N/   what --resume goes on from (--save-every)
    OUT/tensorboard/          the training curves (--track tensorboard)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from matformer.client import run_checkpoints, train_config
from matformer.client.batch_log import PlanRecorder, longest_line
from matformer.client.epochs import Epochs
from matformer.client.step_batches import StepBatches
from matformer.client.step_progress import StepProgress
from matformer.modeling import ModelConfig, build_model
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner
from matformer.modeling.checkpoint import save_pretrained
from matformer.modeling.checkpoint.loader import load_for_tier
from matformer.modeling.commands import command_parser
from matformer.modeling.devices import Precision, compile_model, resolve_device
from matformer.modeling.distributed import DataParallel
from matformer.modeling.errors import BatchDoesNotFit, ConfigError, MatformerError
from matformer.modeling.mdat import (
    Mdat,
    SaettaReader,
    SequenceReader,
    build_default_mdat,
    default_data_path,
)
from matformer.modeling.mdat.catalogue import CATALOGUE_NAME
from matformer.modeling.mdat.checkpoint_tokenizer import (
    SPECIAL_ID_NAMES,
    check_special_ids,
    special_id_conflicts,
    special_ids,
    tokenizer_files,
)
from matformer.modeling.mdat.trained_on import TrainedOn
from matformer.modeling.optim import OptimizerConfig
from matformer.modeling.run_order import RunOrder
from matformer.modeling.settings import add_flags
from matformer.modeling.threads import use_threads
from matformer.modeling.tracking import NoTracker, open_tracker
from matformer.modeling.training import (
    StepOptions,
    TierSchedule,
    held_out_loss,
    target_tokens,
    train_step_on_examples,
)

# A model that learns visibly in a minute on two CPU cores.
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, max_position_embeddings=512)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser("matformer-train", __doc__.split("\n")[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The standalone training options (shared by `matformer-train` and `matformer-client`):
    a flag for each key of train.toml (`client.train_config`), section by section."""
    parser.add_argument("--set", action="append", default=None, metavar="SECTION.KEY=VALUE",
                        help="override a key of the train.toml (repeatable)")
    parser.add_argument("--resume", type=Path, default=None,
                        help="go on from OUT/checkpoints/step-N, as if never stopped (into "
                             "OUT)")
    for name, section in train_config.SECTIONS.items():
        add_flags(parser.add_argument_group(f"[{name}]", section.__doc__), section)


def open_data(args: argparse.Namespace) -> Mdat:
    """The container ``--data`` names, or the default one, built (or finished) on first use."""
    if args.data is not None:
        if args.documents is not None:
            raise ConfigError("--documents limits the default container; with --data, train "
                              "on a view of that container instead (--view).")
        return Mdat.open(args.data)
    path = default_data_path(args.documents)
    if not (path / CATALOGUE_NAME).is_file():  # said only when it takes a while
        print(f"matformer-train: building the stdlib docstrings MDAT at {path} (once)")
    return build_default_mdat(path, limit=args.documents)


def open_order(mdat: Mdat, args: argparse.Namespace, config: ModelConfig
               ) -> tuple[SequenceReader | SaettaReader, RunOrder]:
    """The run's sequences and their order: the view's, shuffled with the run's seed, or
    (``--saetta``) the same ones from an export of them, whose ids are that order already."""
    if args.saetta is None:
        return RunOrder.open(mdat, args.strategy, args.seq_len, args.view, args.seed, config)
    reader = mdat.saetta(args.saetta, args.strategy, args.seq_len, args.view, args.seed)
    return reader, RunOrder.of(np.arange(len(reader)), reader.lengths(), config, args.seed)


CPU = torch.device("cpu")  # where the data workers read to


def sequences(reader: SequenceReader | SaettaReader, ids: np.ndarray, device: torch.device
              ) -> list[torch.Tensor]:
    return [torch.from_numpy(reader[int(i)].astype(np.int64)).to(device) for i in ids]


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv), "matformer-train")


class Stopped(KeyboardInterrupt):
    """Training stopped by Ctrl-C; ``checkpoint``: the newest one to resume from, if any."""

    def __init__(self, checkpoint: Path | None) -> None:
        super().__init__()
        self.checkpoint = checkpoint


def run(args: argparse.Namespace, program: str) -> None:
    """``train`` for a command line: a named error becomes one line and exit code 2; Ctrl-C
    one line with the command that resumes, and exit code 130."""
    try:
        train(args)
    except MatformerError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except Stopped as stop:
        if stop.checkpoint is None:
            hint = ("no checkpoint was written to resume from (--save-every N writes one "
                    "every N steps)")
        else:
            command = shlex.join([program, *_without_resume(sys.argv[1:]), "--resume",
                                  str(stop.checkpoint)])
            hint = f"resume with:\n  {command}"
        print(f"{program}: stopped (Ctrl-C); {hint}", file=sys.stderr)
        raise SystemExit(130) from None


def _without_resume(argv: list[str]) -> list[str]:
    """``argv`` less any --resume and its value."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return kept


def train(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Run the training ``args`` describe; returns the metrics it also writes (rank 0)."""
    args = train_config.apply(args)
    args.out = run_checkpoints.run_folder(args.out, args.resume)
    device = resolve_device(args.device)
    parallel = DataParallel.from_environment(device, sharded=args.fsdp)
    try:
        metrics = _train(args, parallel.device if parallel else device, parallel)
    except KeyboardInterrupt:
        raise Stopped(run_checkpoints.latest(args.out)) from None
    if parallel is not None:
        parallel.close()
    return metrics


def starting_point(init: str | None, architecture_named: bool) -> torch.nn.Module | None:
    """The model ``--init`` names, loaded whole (its own architecture), or None."""
    if init is None:
        return None
    if architecture_named:
        raise ConfigError("--init takes the architecture of its checkpoint; leave out --config "
                          "and train.toml's [model].")
    return load_for_tier(init, 0, "universal")[0]


def _train(args: argparse.Namespace, device: torch.device, parallel: DataParallel | None
           ) -> dict[str, dict[str, float]]:
    leader = parallel is None or parallel.leader
    say = print if leader else (lambda *_, **__: None)
    threads = use_threads(args.threads)
    fields = getattr(args, "model_fields", None)  # train.toml's [model]
    named = fields is not None or bool(args.config) or args.init is not None
    start = starting_point(args.init, fields is not None or bool(args.config))
    if start is not None:
        config = start.config
    elif fields is not None:
        config = ModelConfig(**fields)
    else:
        config = ModelConfig.from_json(args.config) if args.config else ModelConfig(**TINY)
    tiers = [int(t) for t in args.tiers.split(",")]
    schedule = TierSchedule(tiers=tiers, mode=args.tier_mode, seed=args.seed,
                            mixes=args.tier_mixes)
    schedule.check(config)
    if args.seq_len > config.max_position_embeddings:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the model's "
                          f"max_position_embeddings {config.max_position_embeddings}; lower "
                          "--seq-len or give a model config with more positions.")
    if args.fsdp and (args.optimizer == "muon" or args.precision == "fp16"):
        raise ConfigError("--fsdp trains with adam or adamw in fp32 or bf16; muon and fp16's "
                          "loss scale need whole gradients on every rank.")
    options = StepOptions(precision=Precision(args.precision, device), data_parallel=parallel,
                          seed=args.seed)

    if parallel is not None and not leader:
        parallel.barrier()  # rank 0 builds the default container and the shuffle first
    with open_data(args) as mdat:
        reader, order = open_order(mdat, args, config)
        lengths = reader.lengths()
        if parallel is not None and leader:
            parallel.barrier()
        strategy = mdat.strategy(args.strategy)
        fitted = strategy.fit_vocabulary(config, named=named)
        if fitted.vocab_size != config.vocab_size:
            say(f"matformer-train: the model's vocabulary is strategy {args.strategy!r}'s, "
                f"{fitted.vocab_size:,} ids")
        data_ids, where = special_ids(mdat.path, strategy), f"{mdat.path} ({args.strategy!r})"
        if start is not None:  # its embeddings learned its own ids: they must be the data's
            check_special_ids({name: getattr(fitted, name) for name in SPECIAL_ID_NAMES},
                              data_ids, where)
            config = fitted
        else:  # a new model takes the data's ids; a config that named others hears of it
            if named and (conflicts := special_id_conflicts(
                    {name: getattr(fitted, name) for name in SPECIAL_ID_NAMES}, data_ids)):
                say(f"matformer-train: training with the special ids of {where}'s tokenizer, "
                    f"not the config's: {conflicts}")
            config = dataclasses.replace(fitted, **{
                name: index for name, index in data_ids.items()
                if index is not None or not named})
        files = {**tokenizer_files(mdat.path, strategy,
                                   max_length=config.max_position_embeddings),
                 **TrainedOn(str(mdat.path.resolve()), args.strategy, args.view, args.seq_len,
                             args.seed).files()}
        torch.manual_seed(args.seed)
        model = (start if start is not None else build_model(config)).to(device)
        if parallel is not None:
            parallel.broadcast_parameters(model)
        if order.candidates < len(reader):
            say(f"matformer-train: left out {len(reader) - order.candidates:,} sequences of "
                f"fewer than {target_tokens(config)} tokens: they carry no target")
        epochs = Epochs(order, lengths, args)
        total = epochs.steps()
        eval_examples = sequences(reader, order.evaluated(  # never trained; rank 0's
            lengths, sequences=args.eval_sequences if args.eval and leader else 0,
            tokens=total * args.batch_tokens), device)
        world = parallel.world_size if parallel else 1
        say(f"matformer-train: {sum(p.numel() for p in model.parameters()):,} parameters on "
            f"{device} ({args.precision}{', compiled' if args.compile else ''}, "
            f"{threads.describe()}"
            f"{f', {world} data-parallel ranks' if parallel else ''}); {len(order.training):,} "
            f"training sequences of up to {args.seq_len} tokens, {len(epochs.epoch(0)[1])} "
            f"{args.batching} batches of <= {args.batch_tokens} tokens an epoch, {total} steps; "
            f"tiers {tiers} ({args.tier_mode})")
        runner = (PlanRecorder if args.debug else MicrobatchRunner)(model, AdaptiveLimitsConfig(
            max_tokens=args.microbatch_tokens, max_examples=args.microbatch_examples,
            pad_to_multiple_of=args.pad_to_multiple_of).build())
        batches = StepBatches(epochs, lengths, lambda ids: sequences(reader, ids, CPU),
                              workers=args.num_workers, parallel=parallel)

        def evaluate(whole: torch.nn.Module) -> dict[str, float]:
            if not eval_examples:  # --no-eval
                return {}
            say(f"matformer-train: evaluating the held-out loss of tiers {tiers} on "
                f"{len(eval_examples):,} sequences...")
            return held_out_loss(whole, eval_examples, tiers,
                                 batch_tokens=args.eval_microbatch_tokens or args.microbatch_tokens,
                                 max_examples=args.microbatch_examples,
                                 precision=options.precision, seed=args.seed)

        saved = run_checkpoints.Saved(args.resume, args) if args.resume else None
        initial = evaluate(model) if leader and saved is None else {}
        if saved is not None:
            saved.load_weights(model)  # whole, before any sharding
        if args.fsdp:
            parallel.shard(model)
        if args.compile:
            compile_model(model)
        optimizer = OptimizerConfig(
            name=args.optimizer, lr=args.lr,
            final_lr=args.lr / 10 if args.final_lr is None else args.final_lr,
            weight_decay=args.weight_decay, schedule=args.schedule,
            warmup_steps=min(20, total) if args.warmup_steps is None else args.warmup_steps,
            hold_steps=args.hold_steps, total_steps=total,
        ).build(model)
        history, tokens_seen, first = [], 0, 0
        if saved is not None:
            saved.load_optimizer(optimizer, options.precision)
            first, history, tokens_seen = saved.trainer["step"], saved.trainer["history"], \
                saved.trainer["tokens_seen"]
            initial = saved.trainer["initial"]
            say(f"matformer-train: resuming from {args.resume} after step {first}")
            moved = run_checkpoints.set_aside_later(args.out, first) if leader else None
            if moved is not None:
                say(f"matformer-train: {', '.join(moved[1])} of the run this one replaces "
                    f"moved to {moved[0]} (kept, never pruned)")
            if saved.extended:  # a longer run: the schedule spans the new length from here
                if first > total:
                    raise ConfigError(f"--resume {args.resume} is at step {first}, past the "
                                      f"{total} steps asked now; a run can only be lengthened.")
                optimizer.scale_lr(optimizer.scale)  # the new schedule's lr at this step
                say(f"matformer-train: the run, saved with {saved.length}, goes on to "
                    f"{total} steps; its schedule spans the new length")
        tracker = NoTracker() if not leader else open_tracker(
            args.track, args.out / "tensorboard",
            project=args.project, name=args.out.name,
            config={k: str(v) for k, v in vars(args).items()})
        if args.resume is None:
            tracker.log(0, {f"held_out/tier_{t}": loss for t, loss in initial.items()})

        def checkpoint(done: int) -> Path | None:
            return run_checkpoints.save(args.out, done, model, optimizer, options.precision, {
                "history": history, "tokens_seen": tokens_seen, "initial": initial,
                "settings": run_checkpoints.settings(args)}, args.keep_last,
                sharded=parallel if args.fsdp else None, files=files)

        started, before = time.perf_counter(), tokens_seen  # this process's rate
        progress = StepProgress(total, first, args.log_every, say,
                                bar=leader and sys.stderr.isatty())
        upcoming = batches.steps(first, total, device)  # read ahead by --num-workers threads
        for step in range(first, total):
            ids, rows, examples = next(upcoming)
            lr, stats, rng = optimizer.lr, {}, torch.get_rng_state()
            try:
                losses = train_step_on_examples(
                    runner, optimizer, examples, schedule, step,
                    max_grad_norm=args.grad_clip or None, rows=rows, options=options, stats=stats)
            except BatchDoesNotFit as error:
                if args.fsdp:  # a fixed plan: its error names --microbatch-tokens
                    raise
                torch.set_rng_state(rng)  # the run as the step found it, saved as it was
                done = run_checkpoints.folder(args.out) / f"step-{step}"
                saved = (done if done.is_dir() else checkpoint(step)) if leader else None
                raise run_checkpoints.OutOfMemoryStop(step, total, args, saved) from error
            if args.debug and not args.fsdp:  # --fsdp's plan is fixed, made outside the runner
                say(f"matformer-train: {runner.plan_line(step + 1, total)}")
            if args.log_longest_every and (step + 1) % args.log_longest_every == 0:
                say(f"matformer-train: {longest_line(step + 1, total, lengths[ids])}")
            tokens_seen += sum(len(e) for e in examples) * len(losses)
            history.append({"step": step, "lr": lr, "loss": losses})
            rate = (tokens_seen - before) / (time.perf_counter() - started)
            tracker.log(step + 1, {**{f"loss/tier_{t}": v for t, v in losses.items()},
                                   "lr": lr, "tokens_per_second": rate, **stats})
            progress.update(step + 1, losses, lr, rate)
            if (leader or args.fsdp) and args.save_every and (step + 1) % args.save_every == 0:
                checkpoint(step + 1)
        upcoming.close()
        progress.close()
        seconds = time.perf_counter() - started
        if args.fsdp:  # the whole weights, gathered from every rank's shards
            full = parallel.full_state(model)
            model = build_model(config)
            model.load_state_dict(full)
        if not leader:
            return {}
        final = evaluate(model.to(device))
        tracker.log(total, {f"held_out/tier_{t}": loss for t, loss in final.items()})
        tracker.close()
    for tier in [t for t in final if t in initial]:  # none under --no-eval
        print(f"held-out loss tier {tier}: {initial[tier]:.3f} -> {final[tier]:.3f}")

    save_pretrained(model, args.out, files=files)
    metrics = {"initial": initial, "final": final, "history": history,
               "world_size": world, "device": str(device), "precision": args.precision,
               "compile": args.compile, "batching": args.batching, "fsdp": args.fsdp,
               "threads": threads.count,
               "tokens_per_second": round((tokens_seen - before) / seconds, 1)}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"wrote the model to {args.out}/ (config.json, model.safetensors, "
          f"{', '.join(sorted(files))}, metrics.json)")
    return metrics


if __name__ == "__main__":
    main()
