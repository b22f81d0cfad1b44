"""A `datasets` source: a folder written by ``save_to_disk``, or a hub dataset id in the cache.

A folder is opened with ``datasets.load_from_disk`` (memory-mapped Arrow, read in batches of
the text column). A hub id is looked up in the huggingface_hub cache only (``HF_HUB_CACHE``),
so it reads the same with ``HF_HUB_OFFLINE=1``: ``datasets.load_dataset`` does not read that
cache offline, and a download started by an import could be the whole repository, every
config and split. The snapshot's Parquet files of the chosen config and split, found by
`datasets`' own rules (README ``configs``, ``data/train-*`` names), are read by
`tables.parquet_source`. The catalogue's source names the folder, or the id at its commit,
with config and split, so that a resume from other data is refused.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

from modeling.errors import SourceNotFound, SplitError, UnreadableSource, did_you_mean
from modeling.mdat.tables import (
    ROWS_PER_READ,
    TableSource,
    check_column,
    optional_module,
    parquet_source,
    table_records,
)


def hf_dataset_source(dataset: str | os.PathLike[str], text_field: str, *, split: str | None,
                      config: str | None, revision: str | None) -> TableSource:
    """The rows of a ``save_to_disk`` folder, or of a hub dataset id found in the cache."""
    from modeling.checkpoint.repository import is_repo_id

    if is_repo_id(str(dataset)):
        return _hub_source(str(dataset), text_field, split, config, revision)
    folder = Path(dataset).expanduser().resolve()
    if not folder.is_dir():
        raise SourceNotFound(f"{folder} is no folder, and {str(dataset)!r} no hub dataset id "
                             "(org/name); check the path.")
    if config is not None or revision is not None:
        raise SplitError(f"{folder} is a folder: config and revision (--hf-config, "
                         "--revision) only choose within a hub dataset.")
    return _saved_source(folder, text_field, split)


def _choose(splits: Collection[str], split: str | None, where: str) -> str:
    if split in splits:
        return split
    listed = ", ".join(splits)
    if split is None:
        raise SplitError(f"{where} holds the splits {listed}; choose one with split= (--split).")
    raise SplitError(f"{where} has no split {split!r}; {did_you_mean(split, splits)}choose one "
                     f"of {listed} (--split).")


def _saved_source(folder: Path, text_field: str, split: str | None) -> TableSource:
    datasets = optional_module("datasets", "a dataset saved with save_to_disk")
    try:
        loaded = datasets.load_from_disk(str(folder))
    except FileNotFoundError as err:
        raise UnreadableSource(
            f"{folder} is not a folder written by save_to_disk ({err}); give Parquet files "
            "with --parquet, or a hub dataset id."
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        split = _choose(list(loaded), split, str(folder))
        chosen, description = loaded[split], f"{folder} split {split}"
    elif split is not None and split != loaded.split:
        named = f" (split {loaded.split})" if loaded.split else ""
        raise SplitError(f"{folder} holds one dataset{named}, not a DatasetDict of splits; "
                         f"leave out split {split!r} (--split).")
    else:
        chosen, description = loaded, str(folder)
    check_column(chosen.column_names, text_field, description)
    batches = chosen.select_columns([text_field]).with_format("arrow").iter(ROWS_PER_READ)
    return TableSource(description, table_records(batches, text_field, description))


def _hub_source(repo_id: str, text_field: str, split: str | None, config: str | None,
                revision: str | None) -> TableSource:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    at = f"{repo_id}@{revision or 'main'}"
    try:
        snapshot = Path(snapshot_download(repo_id, repo_type="dataset", revision=revision,
                                          local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError) as err:
        raise SourceNotFound(
            f"{repo_id} is no folder, and hub dataset {at} is not in the cache "
            f"{constants.HF_HUB_CACHE}; download the split's files first (`hf download "
            f"{repo_id} --repo-type dataset --include 'data/{split or 'train'}-*'`) or point "
            "HF_HUB_CACHE at the cache holding it."
        ) from err
    datasets = optional_module("datasets", "a hub dataset")
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
    return parquet_source(files[split], text_field,
                          f"hub dataset {repo_id}@{snapshot.name} config "
                          f"{builder.config.name} split {split}")
