"""`matformer-mdat`: create, fill, pretokenize, view, shuffle, export and prune MDAT containers.

Every subcommand takes the container's folder first. Errors print one line and exit with 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

from matformer.modeling import trust
from matformer.modeling.commands import DefaultsShown, command_parser
from matformer.modeling.errors import MatformerError, MdatCorrupt
from matformer.modeling.mdat import (
    Mdat,
    PretokProgress,
    SubmdatInfo,
    build_default_mdat,
    export_saetta,
)
from matformer.modeling.mdat.tables import READ_LIMIT_ENV, READ_LIMIT_MIB
from matformer.modeling.mdat.views import Quota
from matformer.modeling.tokenizers import DEFAULT_SPECIAL_TOKENS, train_tokenizer

Command = Callable[[argparse.Namespace], None]
METADATA_SAMPLE = 100  # documents whose metadata fields `info` lists


def _open(args: argparse.Namespace) -> Mdat:
    return Mdat.open(args.path, trust_remote_code=args.trust_remote_code)


def _create(args: argparse.Namespace) -> None:
    with Mdat.create(args.path, extended=args.extended,
                     trust_remote_code=args.trust_remote_code) as mdat:
        print(f"created {mdat.path} (up to {mdat.max_submdats} submdats)")


def _add(args: argparse.Namespace) -> None:
    options = dict(compress=args.compress, skip_bad=args.skip_bad, progress=True)
    with _open(args) as mdat:
        if args.jsonl:
            info = mdat.add_jsonl(args.name, args.jsonl, text_field=args.text_field, **options)
        elif args.pairs:
            info = mdat.add_pairs(args.name, args.pairs, prompt_field=args.prompt_field,
                                  response_field=args.response_field,
                                  messages_field=args.messages_field, **options)
        elif args.json:
            info = mdat.add_json(args.name, args.json, text_field=args.text_field, **options)
        elif args.parquet:
            info = mdat.add_parquet(args.name, args.parquet, text_field=args.text_field,
                                    **options)
        elif args.hf_dataset:
            info = mdat.add_hf_dataset(args.name, args.hf_dataset, split=args.split,
                                       config=args.hf_config, revision=args.revision,
                                       text_field=args.text_field, **options)
        else:
            info = mdat.add_folder(args.name, args.folder, pattern=args.pattern, **options)
    print(f"{info.name}: {info.documents} documents, {info.raw_bytes:,} bytes of text "
          f"({info.stored_bytes:,} stored); skipped {_skipped(info)}")


def _skipped(info: SubmdatInfo) -> str:
    return (f"{info.skipped_empty} empty, {info.skipped_invalid} invalid, "
            f"{info.skipped_not_utf8} not UTF-8")


def _info(args: argparse.Namespace) -> None:
    with _open(args) as mdat:
        print(f"{mdat.path} (up to {mdat.max_submdats} submdats)")
        print("submdats:")
        for info in mdat.submdats():
            status = "complete" if info.complete else f"importing ({info.records_read} read)"
            print(f"  {info.id:>3} {info.name}: {info.documents} documents, "
                  f"{info.raw_bytes:,} bytes of text, {info.stored_bytes:,} stored "
                  f"({info.compression}), {status}; skipped {_skipped(info)}")
            if info.complete:
                print(f"      metadata: {_metadata_fields(mdat, info.name)}")
        print("strategies:")
        for strategy in mdat.strategies():
            print(f"  {strategy.name}: {strategy.tokenizer_type} tokenizer (vocab "
                  f"{strategy.vocab_size}), {strategy.splitter_class}, chunk_size "
                  f"{strategy.chunk_size}")
            names = {info.id: info.name for info in mdat.submdats()}
            for progress in mdat.pretok_status(strategy.name):
                print(f"    {names[progress.submdat_id]}: {_progress(progress)}")
            for view in mdat.views():
                for progress in mdat.view_pretok_status(strategy.name, view.name):
                    print(f"    {names[progress.submdat_id]} for view {view.name} (its own "
                          f"files): {_progress(progress)}")
        print("views:")
        for view in mdat.views():
            print(f"  {view.name} (seed {view.seed}): {json.dumps(view.quotas)} → "
                  f"{json.dumps(view.documents)} documents")
        print("shuffles:")
        for shuffle in mdat.shuffles():
            print(f"  {shuffle.name}: {shuffle.sequences} sequences, fingerprint "
                  f"{shuffle.fingerprint}")


def _metadata_fields(mdat: Mdat, submdat: str) -> str:
    try:
        with closing(mdat.submdat(submdat)) as documents:
            fields = documents.metadata_fields(METADATA_SAMPLE)
    except MdatCorrupt as err:  # info still lists the rest of a damaged container
        return f"unreadable ({err})"
    return f"{', '.join(fields) or 'none'} (fields of the first {METADATA_SAMPLE} documents)"


def _progress(progress: PretokProgress) -> str:
    state = "complete" if progress.complete else "not complete"
    return (f"{state}, {progress.documents} documents, {progress.tokens:,} tokens, "
            f"{progress.chunks} chunks")


def _strategy(args: argparse.Namespace) -> None:
    with _open(args) as mdat:
        strategy = mdat.add_strategy(args.file)
    print(f"strategy {strategy.name}: {json.dumps(strategy.to_dict())}")


def _pretokenize(args: argparse.Namespace) -> None:
    with _open(args) as mdat:
        if args.view is None:
            status = mdat.pretokenize(args.strategy, submdats=args.submdat,
                                      processes=args.processes, progress=True)
            print(f"{args.strategy}: {sum(progress.tokens for progress in status):,} tokens")
            return
        own = mdat.pretokenize_view(args.strategy, args.view, processes=args.processes,
                                    progress=True)
        names = {info.id: info.name for info in mdat.submdats()}
    shown = ", ".join(f"{names[p.submdat_id]} {p.tokens:,} tokens" for p in own) or "nothing"
    print(f"{args.strategy}, view {args.view}: its own files hold {shown}; it reads its other "
          "submdats from their whole pretokenization")


def _quota(text: str) -> tuple[str, Quota]:
    submdat, _, value = text.partition("=")
    for kind in (int, float):
        try:
            return submdat, kind(value)
        except ValueError:
            pass
    return submdat, value


def _view(args: argparse.Namespace) -> None:
    with _open(args) as mdat:
        view = mdat.create_view(args.name, dict(args.quotas), seed=args.seed)
    print(f"view {view.name}: {json.dumps(view.documents)} documents")


def _shuffle(args: argparse.Namespace) -> None:
    with _open(args) as mdat:
        order = mdat.shuffle(args.view, args.strategy, args.max_seq_len, args.seed)
        fingerprint = mdat.fingerprint(args.strategy, args.max_seq_len, args.view)
    print(f"shuffled {len(order)} sequences (fingerprint {fingerprint})")


def _export_saetta(args: argparse.Namespace) -> None:
    with _open(args) as mdat:
        order = mdat.shuffle(args.view, args.strategy, args.max_seq_len, args.seed)
        reader = mdat.sequences(args.strategy, args.max_seq_len, args.view)
        out = export_saetta(reader, order, args.out, seed=args.seed, progress=True)
    print(f"wrote {out} ({len(order)} sequences)")


def _remove(args: argparse.Namespace) -> None:
    with _open(args) as mdat:
        if args.kind == "submdat":
            mdat.remove_submdat(args.name)
        else:
            mdat.remove_view(args.name)
    print(f"removed {args.kind} {args.name}")


def _train_tokenizer(args: argparse.Namespace) -> None:
    with _open(args) as mdat:
        out = train_tokenizer(mdat.submdat(args.submdat), args.out, vocab_size=args.vocab_size,
                              special_tokens=args.special_tokens)
    print(f"wrote {out}")


def _default(args: argparse.Namespace) -> None:
    with build_default_mdat(args.path, args.limit, processes=args.processes,
                            progress=True) as mdat:
        info = mdat.submdats()[0]
    print(f"{mdat.path}: {info.documents} documents of stdlib docstrings, pretokenized")


def _sequence_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--strategy", required=True)
    sub.add_argument("--max-seq-len", type=int, required=True)
    sub.add_argument("--view", default=None, help="default: every document")
    sub.add_argument("--seed", type=int, default=0, help="the shuffle's seed")


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("matformer-mdat", __doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run: Command, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help,
                                  formatter_class=DefaultsShown)
        sub.add_argument("path", type=Path, help="the container folder")
        trust.add_option(sub)
        sub.set_defaults(run=run)
        return sub

    sub = command("create", _create, "create an empty container")
    sub.add_argument("--extended", action="store_true", help="allow 65,535 submdats, not 255")
    sub = command("add", _add, "import a JSONL file, a JSON array, a folder of text files, "
                  "Parquet files or a datasets dataset as a submdat")
    sub.add_argument("name", help="the new submdat's name")
    source = sub.add_mutually_exclusive_group(required=True)
    source.add_argument("--jsonl", type=Path, help="one JSON object per line")
    source.add_argument("--pairs", type=Path, metavar="FILE",
                        help="instruction data: JSON Lines of prompt/response pairs or chat "
                        "messages, one conversation per line (pretokenize it with splitter "
                        "\"conversation\")")
    source.add_argument("--json", type=Path, metavar="FILE",
                        help="a JSON array of objects, one document per element")
    source.add_argument("--folder", type=Path, help="one document per text file")
    source.add_argument("--parquet", type=Path, nargs="+", metavar="FILE",
                        help="Parquet files, one document per row; the other columns are its "
                        "metadata")
    source.add_argument("--hf-dataset", metavar="PATH_OR_ID",
                        help="a folder written by datasets' save_to_disk, or a hub dataset id "
                        "(org/name) in the huggingface_hub cache (HF_HUB_CACHE; never "
                        "downloaded)")
    sub.add_argument("--text-field", default="text",
                     help="JSON field or table column holding the text; the others are metadata")
    sub.add_argument("--prompt-field", default="prompt", help="--pairs: the prompt's field")
    sub.add_argument("--response-field", default="response",
                     help="--pairs: the response's field")
    sub.add_argument("--messages-field", default="messages",
                     help="--pairs: the field of a list of chat messages (used where a line "
                     "has it)")
    sub.add_argument("--pattern", default="**/*.txt", help="files of --folder to import")
    sub.add_argument("--split", help="--hf-dataset: the split (of a DatasetDict or hub id)")
    sub.add_argument("--hf-config", help="--hf-dataset: the hub dataset's config")
    sub.add_argument("--revision", help="--hf-dataset: the hub branch or commit (default main)")
    sub.add_argument("--compress", action="store_true", help="zstd-compress the texts")
    sub.epilog = (f"Imports read at most {READ_LIMIT_MIB} MiB of text at once: a larger Parquet "
                  "page or text, or a file decoding to that much more than it declares (a "
                  f"decompression bomb), is refused; {READ_LIMIT_ENV}=N sets the limit to N MiB.")
    sub.add_argument("--skip-bad", action="store_true",
                     help="skip and count invalid, empty or non-UTF-8 records instead of "
                     "stopping")
    command("info", _info, "list submdats (and their metadata fields), strategies, "
            "pretokenization, views and shuffles")
    sub = command("strategy", _strategy, "check and add a pretokenization strategy")
    sub.add_argument("file", type=Path, help="the strategy's JSON file")
    sub = command("pretokenize", _pretokenize, "pretokenize submdats, or only a view's "
                  "documents, with a strategy (resumes)")
    sub.add_argument("strategy")
    sub.add_argument("--processes", type=int, default=1)
    only = sub.add_mutually_exclusive_group()
    only.add_argument("--submdat", action="append", help="only these submdats (repeatable)")
    only.add_argument("--view", help="only the documents this view chooses, into its own files "
                      "(submdats pretokenized whole already are read from there)")
    sub = command("view", _view, "create a named view from per-submdat quotas")
    sub.add_argument("name")
    sub.add_argument("quotas", nargs="+", type=_quota, metavar="SUBMDAT=QUOTA",
                     help="a document count (1000), a fraction (0.1) or a size (500M, 2G)")
    sub.add_argument("--seed", type=int, default=0)
    _sequence_options(command("shuffle", _shuffle, "write a permutation of a view's sequence ids"))
    sub = command("export-saetta", _export_saetta, "write a shuffled view as a flat saetta folder")
    sub.add_argument("out", type=Path, help="the saetta folder to write")
    _sequence_options(sub)
    sub = command("remove", _remove, "remove a submdat (complete or interrupted) or a view, "
                  "with what was derived from it")
    sub.add_argument("kind", choices=["submdat", "view"])
    sub.add_argument("name")
    sub = command("train-tokenizer", _train_tokenizer, "train a byte-level BPE tokenizer.json")
    sub.add_argument("submdat")
    sub.add_argument("out", type=Path)
    sub.add_argument("--vocab-size", type=int, required=True)
    sub.add_argument("--special-tokens", nargs="*", default=list(DEFAULT_SPECIAL_TOKENS))
    sub = command("default", _default, "build the stdlib-docstrings container (bytes128)")
    sub.add_argument("--limit", type=int, default=None, help="at most this many documents")
    sub.add_argument("--processes", type=int, default=1)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "add" and not args.hf_dataset:
        stray = [flag for flag in ("split", "hf_config", "revision") if getattr(args, flag)]
        if stray:
            parser.error(f"--{stray[0].replace('_', '-')} goes with --hf-dataset only")
    try:
        args.run(args)
    except (MatformerError, OSError) as err:
        parser.exit(2, f"matformer-mdat: error: {' '.join(str(err).split())}\n")


if __name__ == "__main__":
    main()
