"""`matformer push` against a stand-in hub on 127.0.0.1: the one commit it makes (paths,
bytes, message, branch), what it refuses before a request leaves, and that what it pushed
loads per tier from the hub cache.

``StandInHub`` answers the calls huggingface_hub's ``create_repo``, ``create_branch`` and
``create_commit`` make (hf_api.py, _commit_api.py): ``POST /api/repos/create``, and under
``/api/models/ORG/NAME/``: ``branch/B``, ``preupload/REV`` and ``commit/REV`` (ndjson, each
file inline as base64). Its preupload answer asks for every file inline ("regular"), as the
hub does for small files, so no LFS transfer is needed. It checks the bearer token, answers
a missing repository or branch with the hub's error codes, keeps each branch's files and
records every request and commit.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
from support.models import edit_manifest, logits

from matformer.modeling.checkpoint import save_pretrained
from matformer.modeling.checkpoint.export import export_tiers
from matformer.modeling.checkpoint.loader import load_for_tier
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME
from matformer.modeling.errors import (
    AlreadySliced,
    CheckpointError,
    IncompleteTier,
    IntegrityError,
    ManifestError,
    ManifestMissing,
    PathEscapesRepository,
    PublishError,
)
from matformer.scripts.push import checked, push
from matformer.scripts.verbs import main

TOKEN = "hf_standin0123456789abcdefghijklmnop"
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
# what the manifest of the ``checkpoint`` fixture vouches for, and so all a push uploads
PUBLISHED = [
    "config.json", "model.safetensors",
    "tier1/config.json", "tier1/model.safetensors",
    "tier2/config.json", "tier2/model.safetensors",
    "mix-0-1/config.json", "mix-0-1/model.safetensors",
    "tokenizer.json", MANIFEST_NAME,
]
TIERS = "0, 1, 2, mix:0,1"


@dataclass(slots=True)
class Commit:
    repo: str
    revision: str
    summary: str
    description: str
    files: dict[str, bytes]  # path → the bytes sent inline
    other: list[dict]  # any other operation (an LFS file, a deletion): none expected
    oid: str


class StandInHub(ThreadingHTTPServer):
    """The hub calls a push makes, on 127.0.0.1; state kept in memory."""

    def __init__(self, token: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.token = token
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.repos: dict[str, dict] = {}  # repo id → {"private": bool, "branches": {…}}
        self.calls: list[str] = []  # "POST /api/…", in order
        self.authorizations: set[str | None] = set()
        self.commits: list[Commit] = []

    def add_repo(self, repo: str, private: bool = False) -> None:
        """A repository as the hub makes one: main holds .gitattributes."""
        self.repos[repo] = {"private": private,
                            "branches": {"main": {".gitattributes": GITATTRIBUTES}}}


class _Handler(BaseHTTPRequestHandler):
    server: StandInHub

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # a push needs no reads
        self.server.calls.append(f"GET {urlsplit(self.path).path}")
        self._answer(404, {"error": "not served by the stand-in"})

    def do_POST(self) -> None:
        hub, path = self.server, urlsplit(self.path).path
        hub.calls.append(f"POST {path}")
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        hub.authorizations.add(self.headers.get("Authorization"))
        if self.headers.get("Authorization") != f"Bearer {hub.token}":
            return self._answer(401, {"error": "Invalid credentials in Authorization header"},
                                message="Invalid credentials in Authorization header")
        if path == "/api/repos/create":
            return self._create(json.loads(body))
        parts = path.split("/")  # "", api, models, ORG, NAME, call, REV
        if len(parts) != 7 or parts[:3] != ["", "api", "models"]:
            return self._answer(404, {"error": "no such route"})
        repo, call, revision = f"{parts[3]}/{parts[4]}", parts[5], unquote(parts[6])
        if repo not in hub.repos:
            return self._answer(404, {"error": "Repository not found"}, code="RepoNotFound")
        branches = hub.repos[repo]["branches"]
        if call == "branch":
            if revision in branches:
                return self._answer(409, {"error": "Reference already exists"})
            branches[revision] = dict(branches["main"])
            return self._answer(200, {})
        if revision not in branches:
            return self._answer(404, {"error": "Invalid rev id"}, code="RevisionNotFound")
        if call == "preupload":
            return self._answer(200, {"files": [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                for f in json.loads(body)["files"]]})
        if call == "commit":
            return self._commit(repo, revision, body)
        return self._answer(404, {"error": "no such route"})

    def _create(self, payload: dict) -> None:
        repo = f"{payload.get('organization') or 'user'}/{payload['name']}"
        if repo in self.server.repos:
            return self._answer(409, {"error": "You already created this model repo"})
        private = payload.get("visibility") == "private" or payload.get("private") is True
        self.server.add_repo(repo, private)
        self._answer(200, {"url": f"{self.server.url}/{repo}"})

    def _commit(self, repo: str, revision: str, body: bytes) -> None:
        header, files, other = {}, {}, []
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                header = item["value"]
            elif item["key"] == "file" and item["value"]["encoding"] == "base64":
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            else:
                other.append(item)
        hub = self.server
        oid = hashlib.sha1(f"{repo}@{revision}#{len(hub.commits)}".encode()).hexdigest()
        hub.commits.append(Commit(repo, revision, header.get("summary", ""),
                                  header.get("description", ""), files, other, oid))
        hub.repos[repo]["branches"][revision].update(files)
        self._answer(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid,
                           "pullRequestUrl": None})

    def _answer(self, status: int, data: dict, *, code: str | None = None,
                message: str | None = None) -> None:
        content = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(content)))
        if code:
            self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        self.end_headers()
        self.wfile.write(content)


@pytest.fixture
def hub(monkeypatch):
    """The stand-in, where huggingface_hub sends its calls; HF_TOKEN holds its token."""
    hub = StandInHub(TOKEN)
    thread = threading.Thread(target=hub.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.url)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    # no user-agent telemetry: a recent huggingface_hub would first ask the endpoint for its list
    # of AI agent harnesses, a call no push needs
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY", True)
    yield hub
    hub.shutdown()
    hub.server_close()
    thread.join()


@pytest.fixture
def checkpoint(tmp_path, universal) -> Path:
    """A universal checkpoint with tiers 1, 2 and mix 0,1 exported, and what a run leaves
    beside it, which the manifest does not list."""
    source = save_pretrained(universal, tmp_path / "tiny")
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    export_tiers(source, [1, 2], [[0, 1]])
    (source / "notes.txt").write_text("loss went down")
    (source / "tier1" / "optimizer.pt").write_bytes(b"state")
    half_written = source / ".tier3.tmp-0badf00d"
    half_written.mkdir()
    (half_written / "model.safetensors").write_bytes(b"partial")
    return source


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``matformer push ARGV``: its exit status, stdout and stderr."""
    try:
        status = main(["push", *argv])
    except SystemExit as exited:
        status = exited.code
    said = capsys.readouterr()
    return status, said.out, said.err


def test_a_push_commits_the_manifests_files_once_and_nothing_else(checkpoint, hub, capsys):
    status, out, err = run([str(checkpoint), "org/tiny", "--create", "--private"], capsys)
    assert status == 0, err
    assert hub.calls == ["POST /api/repos/create", "POST /api/models/org/tiny/preupload/main",
                         "POST /api/models/org/tiny/commit/main"]
    assert hub.repos["org/tiny"]["private"]
    [commit] = hub.commits
    assert (commit.repo, commit.revision) == ("org/tiny", "main")
    assert sorted(commit.files) == sorted(PUBLISHED) and commit.other == []
    for path in PUBLISHED:
        assert commit.files[path] == (checkpoint / path).read_bytes(), path
    assert commit.summary == f"Matformer checkpoint, tiers {TIERS}"
    assert commit.description.startswith(f"Tiers {TIERS}: the files {MANIFEST_NAME} lists")
    assert hub.authorizations == {f"Bearer {TOKEN}"}
    assert TOKEN not in out + err
    assert out.splitlines()[-1] == (
        f"pushed {len(PUBLISHED)} files: {hub.url}/org/tiny/commit/{commit.oid}")


def test_what_was_pushed_loads_each_tier_from_the_hub_cache(checkpoint, hub, universal,
                                                             tmp_path, monkeypatch, capsys):
    assert run([str(checkpoint), "org/tiny", "--create"], capsys)[0] == 0
    # the repository's main branch as huggingface_hub caches a download of it
    cache = tmp_path / "hub-cache"
    root = cache / "models--org--tiny"
    oid = hub.commits[-1].oid
    for path, content in hub.repos["org/tiny"]["branches"]["main"].items():
        (root / "snapshots" / oid / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "snapshots" / oid / path).write_bytes(content)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(oid)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    for tier in (0, 1, 2, [0, 1]):
        model, resolved = load_for_tier("org/tiny", tier, "sliced", cache_dir=cache)
        assert resolved.used == ("universal" if tier == 0 else "sliced")
        torch.testing.assert_close(logits(model), logits(universal, tier))


def test_a_branch_is_made_once_and_the_message_kept(checkpoint, hub, capsys):
    hub.add_repo("org/tiny")
    for _ in range(2):  # the second push finds the branch there
        status, _, err = run([str(checkpoint), "org/tiny", "--revision", "v1",
                              "--message", "after 10k steps"], capsys)
        assert status == 0, err
    assert hub.calls == 2 * ["POST /api/models/org/tiny/branch/v1",
                             "POST /api/models/org/tiny/preupload/v1",
                             "POST /api/models/org/tiny/commit/v1"]
    assert [(c.revision, c.summary) for c in hub.commits] == 2 * [("v1", "after 10k steps")]
    assert hub.commits[0].description.startswith(f"Tiers {TIERS}:")
    assert sorted(hub.repos["org/tiny"]["branches"]["v1"]) == sorted(
        [*PUBLISHED, ".gitattributes"])
    assert list(hub.repos["org/tiny"]["branches"]["main"]) == [".gitattributes"]
    assert not hub.repos["org/tiny"]["private"]


def test_the_hubs_refusals_say_what_to_do(checkpoint, hub, monkeypatch, capsys):
    publication = checked(checkpoint)
    with pytest.raises(PublishError) as refused:
        push(publication, "org/tiny")
    assert str(refused.value) == (
        f"org/tiny is not on {hub.url} (or the token in $HF_TOKEN cannot see it); add "
        "--create to create it, or check the name and the token's access.")
    status, _, err = run([str(checkpoint), "org/tiny"], capsys)
    assert (status, err) == (2, f"matformer push: error: {refused.value}\n")

    monkeypatch.setenv("MY_TOKEN", "hf_expired0123456789abcdefghijklmn")
    hub.add_repo("org/tiny")
    status, out, err = run([str(checkpoint), "org/tiny", "--token-env", "MY_TOKEN"], capsys)
    assert status == 2 and err == (
        f"matformer push: error: {hub.url} refused the token in $MY_TOKEN (invalid or "
        "expired); make a write token at https://huggingface.co/settings/tokens and export it "
        "as MY_TOKEN.\n")
    assert "hf_expired" not in out + err and hub.commits == []


def test_no_request_leaves_without_a_token_or_with_a_token_on_the_command_line(
        checkpoint, hub, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    status, _, err = run([str(checkpoint), "org/tiny", "--create"], capsys)
    assert status == 2 and err == (
        "matformer push: error: $HF_TOKEN is not set: export HF_TOKEN=<a token with write "
        "access, from https://huggingface.co/settings/tokens>, or name the variable holding "
        "one with --token-env.\n")
    status, out, err = run([str(checkpoint), "org/tiny", "--token-env", TOKEN], capsys)
    assert status == 2 and "--token-env takes the name of an environment variable" in err
    assert TOKEN not in out + err
    status, _, err = run([str(checkpoint), "org/tiny", "--private"], capsys)
    assert status == 2 and "add --create, or drop --private" in err
    assert hub.calls == []


def _a_slice(source: Path) -> Path:
    return source / "tier1"


def _no_folder(source: Path) -> Path:
    return source / "nothing"


def _no_manifest(source: Path) -> Path:
    (source / MANIFEST_NAME).unlink()
    return source


def _a_missing_file(source: Path) -> Path:
    (source / "tier2" / "model.safetensors").unlink()
    return source


def _an_altered_file(source: Path) -> Path:
    (source / "tier1" / "model.safetensors").write_bytes(b"other weights")
    return source


def _a_file_outside(source: Path) -> Path:
    edit_manifest(source, lambda m: m["common_files"].append("../elsewhere/tokenizer.json"))
    return source


def _an_unhashed_file(source: Path) -> Path:
    edit_manifest(source, lambda m: m["sha256"].pop("tokenizer.json"))
    return source


def _a_stray_sha256(source: Path) -> Path:
    edit_manifest(source, lambda m: m["sha256"].update({"notes.txt": "0" * 64}))
    return source


REFUSALS = {  # the folder pushed, spoilt so → the error and what it says ({s}: the folder)
    "a slice": (_a_slice, AlreadySliced,
                "{s}/tier1 is the tier 1 slice of a checkpoint, not a universal one; push the "
                "universal checkpoint folder, which holds matformer_manifest.json and every "
                "slice: {s}."),
    "no folder": (_no_folder, CheckpointError,
                  "{s}/nothing is not a checkpoint folder (no config.json); give the universal "
                  "checkpoint folder that `matformer export` wrote the tiers into."),
    "no manifest": (_no_manifest, ManifestMissing,
                    "{s} has no matformer_manifest.json, so nothing says which files make its "
                    "tiers; run `matformer export --src {s} --tiers 1 2` (the tiers to "
                    "publish) first, then push again."),
    "a missing file": (_a_missing_file, IncompleteTier,
                       "matformer_manifest.json of {s} lists files that are not there: "
                       "tier2/model.safetensors; copy them back, or export the tiers again "
                       "(`matformer export`)."),
    "an altered file": (_an_altered_file, IntegrityError,
                        "tier1/model.safetensors in {s} differ from the sha256 in "
                        "matformer_manifest.json (changed since the export); export the tiers "
                        "again (`matformer export`), then push."),
    "a file outside": (_a_file_outside, PathEscapesRepository,
                       "matformer_manifest.json of {s} lists '../elsewhere/tokenizer.json', "
                       "which lies outside the folder; a pushed repository holds only the "
                       "checkpoint's folder, so export the tiers with `matformer export`, "
                       "which writes the slices inside it."),
    "an unhashed file": (_an_unhashed_file, ManifestError,
                         "matformer_manifest.json of {s} gives no sha256 for tokenizer.json, "
                         "so no client could check them; export the tiers again (`matformer "
                         "export` hashes every file)."),
    "a stray sha256": (_a_stray_sha256, ManifestError,
                       "matformer_manifest.json of {s} has a sha256 for files no entry lists "
                       "(notes.txt); export the tiers again (`matformer export`)."),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_checkpoint_that_does_not_verify_is_refused_before_any_request(checkpoint, hub,
                                                                          capsys, case):
    spoil, error, message = REFUSALS[case]
    source = spoil(checkpoint)
    expected = message.format(s=checkpoint)
    with pytest.raises(error) as refused:
        checked(source)
    assert type(refused.value) is error and str(refused.value) == expected
    status, out, err = run([str(source), "org/tiny", "--create"], capsys)
    assert (status, out, err) == (2, "", f"matformer push: error: {expected}\n")
    assert hub.calls == []
