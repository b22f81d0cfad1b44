"""A `datasets` source: a folder written by ``save_to_disk``, or a hub dataset id in the cache.

A folder is read by `saved_datasets` (pyarrow alone, memory-mapped Arrow, a batch of rows at
a time). A hub id is looked up in the huggingface_hub cache only (``HF_HUB_CACHE``),
so it reads the same with ``HF_HUB_OFFLINE=1``: ``datasets.load_dataset`` does not read that
cache offline, and a download started by an import could be the whole repository, every
config and split. The snapshot's Parquet files of the chosen config and split, found by
`datasets`' own rules (README ``configs``, ``data/train-*`` names), are read by
`tables.parquet_source`, and only if they lie inside the snapshot: a card is the repository
author's text, and its ``data_files`` must not reach the user's other files (an absolute
path, ``..``, a URL, a link leaving the repository's cache folder). No dataset script runs.
The catalogue's source names the folder, or the id at its commit, with config and split, so
that a resume from other data is refused.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path, PurePosixPath

from matformer.modeling.errors import (
    SourceNotFound,
    SourceOutsideDataset,
    SplitError,
    UnreadableSource,
    did_you_mean,
)
from matformer.modeling.mdat.saved_datasets import SavedDataset, saved_splits
from matformer.modeling.mdat.tables import (
    TableSource,
    optional_module,
    parquet_source,
    pyarrow_module,
    read_limit,
)


def hf_dataset_source(dataset: str | os.PathLike[str], text_field: str, *, split: str | None,
                      config: str | None, revision: str | None,
                      limit: int | None = None) -> TableSource:
    """The rows of a ``save_to_disk`` folder, or of a hub dataset id found in the cache;
    ``limit``: the read limit (default `tables.read_limit`)."""
    from matformer.modeling.checkpoint.repository import is_repo_id

    limit = read_limit() if limit is None else limit
    if is_repo_id(str(dataset)):
        return _hub_source(str(dataset), text_field, split, config, revision, limit)
    pyarrow_module("a dataset saved with save_to_disk")
    folder = Path(dataset).expanduser().resolve()
    if not folder.is_dir():
        raise SourceNotFound(f"{folder} is no folder, and {str(dataset)!r} no hub dataset id "
                             "(org/name); check the path.")
    if config is not None or revision is not None:
        raise SplitError(f"{folder} is a folder: config and revision (--hf-config, "
                         "--revision) only choose within a hub dataset.")
    return _saved_source(folder, text_field, split, limit)


def _choose(splits: Collection[str], split: str | None, where: str) -> str:
    if split in splits:
        return split
    listed = ", ".join(splits)
    if split is None:
        raise SplitError(f"{where} holds the splits {listed}; choose one with split= (--split).")
    raise SplitError(f"{where} has no split {split!r}; {did_you_mean(split, splits)}choose one "
                     f"of {listed} (--split).")


def _saved_source(folder: Path, text_field: str, split: str | None,
                  limit: int) -> TableSource:
    splits = saved_splits(folder)
    if splits is not None:
        split = _choose(splits, split, str(folder))
        return SavedDataset.open(folder / split).source(
            text_field, f"{folder} split {split}", limit=limit)
    dataset = SavedDataset.open(folder)
    if split is not None and split != dataset.split:
        named = f" (split {dataset.split})" if dataset.split else ""
        raise SplitError(f"{folder} holds one dataset{named}, not a DatasetDict of splits; "
                         f"leave out split {split!r} (--split).")
    return dataset.source(text_field, str(folder), limit=limit)


def _hub_source(repo_id: str, text_field: str, split: str | None, config: str | None,
                revision: str | None, limit: int) -> TableSource:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    datasets = optional_module("datasets", "a hub dataset")
    at = f"{repo_id}@{revision or 'main'}"
    try:
        snapshot = Path(os.path.abspath(snapshot_download(
            repo_id, repo_type="dataset", revision=revision, local_files_only=True)))
    except (HFValidationError, LocalEntryNotFoundError) as err:
        raise SourceNotFound(
            f"{repo_id} is no folder, and hub dataset {at} is not in the cache "
            f"{constants.HF_HUB_CACHE}; download the split's files first (`hf download "
            f"{repo_id} --repo-type dataset --include 'data/{split or 'train'}-*'`) or point "
            "HF_HUB_CACHE at the cache holding it."
        ) from err
    _check_card(snapshot, at)
    try:
        builder = datasets.load_dataset_builder(str(snapshot), name=config)
    except FileNotFoundError as err:
        raise SourceNotFound(f"hub dataset {at} ({snapshot}) holds no data files; download "
                             "them first.") from err
    except ValueError as err:  # no config, or an unknown one, chosen among several
        raise SplitError(f"hub dataset {at}: {' '.join(str(err).split())} (--hf-config)") \
            from err
    where = f"hub dataset {at} config {builder.config.name}"
    files = {str(name): paths for name, paths in (builder.config.data_files or {}).items()}
    split = _choose(list(files), split, where)
    if builder.name != "parquet":
        raise UnreadableSource(
            f"{where} holds {builder.name} files, not Parquet; download the hub's Parquet "
            "conversion (`hf download ... --revision refs/convert/parquet`) and import it with "
            "--revision refs/convert/parquet, or import JSON Lines files with --jsonl."
        )
    return parquet_source([_in_snapshot(file, snapshot, where) for file in files[split]],
                          text_field, f"hub dataset {repo_id}@{snapshot.name} config "
                          f"{builder.config.name} split {split}", limit=limit)


def _check_card(snapshot: Path, at: str) -> None:
    """Refuse a snapshot that would have `datasets` run code, or look outside it: a loading
    script, or a card whose ``configs`` name data files or folders elsewhere."""
    script = snapshot / f"{snapshot.name}.py"  # what `datasets` < 4 would import and run
    if script.exists():
        raise UnreadableSource(f"hub dataset {at} is a loading script ({script.name}), which "
                               "Matformer never runs; import its Parquet conversion "
                               "(--revision refs/convert/parquet).")
    card = snapshot / "README.md"
    if not card.is_file():
        return
    import yaml
    from huggingface_hub.repocard import metadata_load

    try:
        configs = (metadata_load(card) or {}).get("configs")
    except (ValueError, yaml.YAMLError) as err:
        raise UnreadableSource(f"hub dataset {at}: the metadata of its card {card} is not "
                               f"valid YAML ({' '.join(str(err).split())}).") from err
    for entry in configs if isinstance(configs, list) else []:
        named = _card_paths(entry) if isinstance(entry, dict) else []
        for path in named:
            if "://" in path or path.startswith(("/", "~")) or ".." in PurePosixPath(path).parts:
                raise SourceOutsideDataset(
                    f"hub dataset {at}: its card (README.md) points config "
                    f"{entry.get('config_name', 'default')} at {path}, outside its snapshot "
                    f"{snapshot}; nothing was read. Hub imports read only the dataset's own "
                    "files."
                )


def _card_paths(config: dict) -> list[str]:
    """What a card's config names as data: its ``data_dir``, and each ``data_files`` path or
    pattern (a string, a list, a list of ``{split, path}``, or ``{split: paths}``)."""
    files = config.get("data_files", [])
    entries = list(files.values()) if isinstance(files, dict) else \
        files if isinstance(files, list) else [files]
    paths = [config.get("data_dir")]
    for entry in entries:
        path = entry.get("path") if isinstance(entry, dict) else entry
        paths.extend(path if isinstance(path, list) else [path])
    return [path for path in paths if isinstance(path, str)]


def _in_snapshot(file: str, snapshot: Path, where: str) -> Path:
    """``file`` if it lies in ``snapshot``, and resolves inside its repository's cache folder
    (a snapshot's files are links into the same folder's ``blobs``)."""
    path = Path(os.path.abspath(file))
    repository = snapshot.parent.parent.resolve()
    if not (path.is_relative_to(snapshot) and path.resolve().is_relative_to(repository)):
        raise SourceOutsideDataset(
            f"{where}: its data file {file} lies outside the snapshot {snapshot} (resolved: "
            f"{path.resolve()}); nothing was read. Hub imports read only the dataset's own "
            "files."
        )
    return path
