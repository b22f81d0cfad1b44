"""`matformer push`: publish a universal checkpoint, its tier slices and its manifest to a
Hugging Face hub repository, in one commit.

    matformer push runs/my-model org/my-model --create
    matformer push runs/my-model org/my-model --revision v2 --message "after 10k steps"

What goes up is what ``matformer_manifest.json`` vouches for: the files each of its tier and
Mix'n'Match entries lists, its common files (tokenizer, generation config, code) and the
manifest itself, at the same paths; nothing else of the folder (logs, optimizer state, a
half-written slice). A client then fetches only its tier: ``load_for_tier("org/my-model", 2)``.
The token is read from the environment (``HF_TOKEN``, or the variable ``--token-env``
names), never from the command line, and never printed.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from matformer.modeling.checkpoint.files import CONFIG_NAME, read_json
from matformer.modeling.checkpoint.hf_config import from_config_dict
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME, Manifest, sha256_of
from matformer.modeling.checkpoint.repository import normalize
from matformer.modeling.commands import command_parser, version
from matformer.modeling.errors import (
    AlreadySliced,
    CheckpointError,
    IncompleteTier,
    IntegrityError,
    ManifestError,
    ManifestMissing,
    MatformerError,
    PathEscapesRepository,
    PublishError,
)
from matformer.modeling.matformer import tier_label

PROG = "matformer push"
TOKENS_PAGE = "https://huggingface.co/settings/tokens"


@dataclass(frozen=True, slots=True)
class Publication:
    """The checked files of a universal checkpoint, as they will lie in the repository."""

    source: Path
    tiers: list[str]  # the labels of the tiers the manifest lists: "0", "1", "mix:0,1"
    files: dict[str, Path]  # repository path → local file; the manifest comes last


def checked(source: str | Path) -> Publication:
    """The files to publish from ``source``, every one checked. In the order a folder meets
    them:

    1. it is a folder with a ``config.json`` (CheckpointError);
    2. that config is a universal model, not a slice (AlreadySliced);
    3. it holds ``matformer_manifest.json`` (ManifestMissing: run ``matformer export``);
    4. the manifest reads as schema v1 (ManifestError, ManifestVersionError);
    5. every path it lists stays inside the folder, links included (PathEscapesRepository);
    6. every listed file is there (IncompleteTier);
    7. every listed file has a sha256, and every sha256 names a listed file (ManifestError),
       so a client can check all it downloads;
    8. every file matches its sha256 (IntegrityError).
    """
    source = Path(source).expanduser().resolve()
    if not (source / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"{source} is not a checkpoint folder (no {CONFIG_NAME}); give the universal "
            "checkpoint folder that `matformer export` wrote the tiers into.")
    stored = from_config_dict(read_json(source / CONFIG_NAME)).stored_tiers()
    if any(stored):
        label = tier_label(stored[0] if len(set(stored)) == 1 else stored)
        parent = f": {source.parent}" if (source.parent / MANIFEST_NAME).is_file() else ""
        raise AlreadySliced(
            f"{source} is the tier {label} slice of a checkpoint, not a universal one; push "
            f"the universal checkpoint folder, which holds {MANIFEST_NAME} and every "
            f"slice{parent}.")
    manifest_path = source / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ManifestMissing(
            f"{source} has no {MANIFEST_NAME}, so nothing says which files make its tiers; "
            f"run `matformer export --src {source} --tiers 1 2` (the tiers to publish) "
            "first, then push again.")
    manifest = Manifest.from_dict(read_json(manifest_path), str(manifest_path))

    files: dict[str, Path] = {}
    for name in [*(f for entry in manifest.tiers for f in entry.files),
                 *manifest.common_files]:
        local = (source / name).resolve()
        if not local.is_relative_to(source):
            raise PathEscapesRepository(
                f"{MANIFEST_NAME} of {source} lists {name!r}, which lies outside the folder; "
                "a pushed repository holds only the checkpoint's folder, so export the "
                "tiers with `matformer export`, which writes the slices inside it.")
        files.setdefault(normalize(name), local)
    missing = [path for path, local in files.items() if not local.is_file()]
    if missing:
        raise IncompleteTier(
            f"{MANIFEST_NAME} of {source} lists files that are not there: "
            f"{', '.join(missing)}; copy them back, or export the tiers again "
            "(`matformer export`).")
    digests = {normalize(name): digest for name, digest in manifest.sha256.items()}
    unhashed = [path for path in files if path not in digests]
    if unhashed:
        raise ManifestError(
            f"{MANIFEST_NAME} of {source} gives no sha256 for {', '.join(unhashed)}, so no "
            "client could check them; export the tiers again (`matformer export` hashes "
            "every file).")
    unlisted = [path for path in digests if path not in files]
    if unlisted:
        raise ManifestError(
            f"{MANIFEST_NAME} of {source} has a sha256 for files no entry lists "
            f"({', '.join(unlisted)}); export the tiers again (`matformer export`).")
    altered = [path for path, local in files.items() if sha256_of(local) != digests[path]]
    if altered:
        raise IntegrityError(
            f"{', '.join(altered)} in {source} differ from the sha256 in {MANIFEST_NAME} "
            "(changed since the export); export the tiers again (`matformer export`), then "
            "push.")
    files[MANIFEST_NAME] = manifest_path
    return Publication(source=source, tiers=manifest.available_tiers(), files=files)


def read_token(name: str) -> str:
    """The hub token in the environment variable ``name``."""
    token = os.environ.get(name, "").strip()
    if not token:
        raise PublishError(
            f"${name} is not set: export {name}=<a token with write access, from "
            f"{TOKENS_PAGE}>, or name the variable holding one with --token-env.")
    return token


def push(publication: Publication, repo_id: str, *, token_env: str = "HF_TOKEN",
         revision: str | None = None, create: bool = False, private: bool = False,
         message: str | None = None) -> str:
    """Commit ``publication`` to the model repository ``repo_id`` in one commit and return
    the commit's URL. ``create`` makes the repository first if it is missing (``private``
    then hides it; an existing one keeps its visibility); a ``revision`` other than main
    is a branch, made from main if missing. The hub is huggingface_hub's endpoint
    (``HF_ENDPOINT`` moves it)."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    api = HfApi(token=read_token(token_env))
    tiers = ", ".join(publication.tiers)
    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(local))
                  for path, local in publication.files.items()]
    try:
        if create:
            api.create_repo(repo_id, private=private or None, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(
            repo_id, operations, revision=revision,
            commit_message=message or f"Matformer checkpoint, tiers {tiers}",
            commit_description=(f"Tiers {tiers}: the files {MANIFEST_NAME} lists for them, "
                                f"their common files and the manifest (matformer "
                                f"{version()})."))
    except (HfHubHTTPError, HFValidationError) as err:
        raise PublishError(_explained(err, repo_id, revision, token_env, api.endpoint)) from err
    return info.commit_url


def _explained(err: Exception, repo_id: str, revision: str | None, token_env: str,
               endpoint: str) -> str:
    """What the hub's refusal means for this push, and what to do."""
    from huggingface_hub.errors import (
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, HFValidationError):
        return f"{repo_id!r} is not a hub repository id ({err}); give it as ORG/NAME."
    if isinstance(err, RevisionNotFoundError):
        return (f"{repo_id} has no branch {revision!r} to commit to; give --revision a branch "
                "name (a tag or a commit takes no commits).")
    status = err.response.status_code
    if status == 401 and not isinstance(err, RepositoryNotFoundError):
        return (f"{endpoint} refused the token in ${token_env} (invalid or expired); make a "
                f"write token at {TOKENS_PAGE} and export it as {token_env}.")
    if isinstance(err, RepositoryNotFoundError):
        return (f"{repo_id} is not on {endpoint} (or the token in ${token_env} cannot see it); "
                "add --create to create it, or check the name and the token's access.")
    if status == 403:
        return (f"the token in ${token_env} may not write to {repo_id}; use one with write "
                f"access to it ({TOKENS_PAGE}).")
    return f"{endpoint} refused the push to {repo_id}: {err}"


def fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, metavar="SRC",
                        help="universal checkpoint folder, its tiers exported (matformer export)")
    parser.add_argument("repo_id", metavar="REPO_ID", help="hub model repository, ORG/NAME")
    parser.add_argument("--revision", metavar="BRANCH", default=None,
                        help="branch to commit to, made from main if missing (default: main)")
    parser.add_argument("--private", action="store_true",
                        help="make the repository that --create makes private")
    parser.add_argument("--message", default=None,
                        help="the commit's summary (default: one naming the tiers)")
    parser.add_argument("--create", action="store_true",
                        help="create the repository if it does not exist")
    parser.add_argument("--token-env", metavar="NAME", default="HF_TOKEN",
                        help="environment variable holding a token with write access")
    args = parser.parse_args(argv)
    if args.private and not args.create:
        fail("--private sets the visibility of the repository --create makes (an existing one "
             "keeps its own); add --create, or drop --private")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.token_env) or (
            args.token_env.startswith("hf_") and len(args.token_env) >= 30):
        fail("--token-env takes the name of an environment variable holding the token, not "
             "a token; export the token (export HF_TOKEN=...) and keep it off command lines")
    try:
        read_token(args.token_env)  # before hashing a large checkpoint
        publication = checked(args.source)
        print(f"pushing tiers {', '.join(publication.tiers)} of {publication.source} to "
              f"{args.repo_id} ({args.revision or 'main'}):")
        for path in publication.files:
            print(f"  {path}")
        url = push(publication, args.repo_id, token_env=args.token_env,
                   revision=args.revision, create=args.create, private=args.private,
                   message=args.message)
    except MatformerError as err:
        fail(str(err))
    print(f"pushed {len(publication.files)} files: {url}")


if __name__ == "__main__":
    main()
