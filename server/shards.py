"""The close sharded over torch.distributed (``[coordinator] shards``; docs/architecture.md,
"The sharded close").

With ``shards = N`` the coordinator starts N shard processes
(``python -m matformer.server.shards``), which join it in one Gloo process group (the
coordinator is rank 0 and holds no part: a close's wall time is its slowest shard's, not
that of a shard that also answers members' calls). Each shard
owns a contiguous part of the parameters, in the model's order and balanced by size: its
part of the master, of the broadcast's residual, of the outer momentum and of the round
policy's buffers. The root keeps membership, rounds and the wire. For a close it hands each
shard the results for its parameters; each closes its part with the same arithmetic as one
process (a close is parameter by parameter, so the bits are the same), says which of its
weights the step would make not finite, and digests its regions for the round's hashes,
which the root combines (``combine_digests``).

A close is two-phase, as the round it belongs to: the new part is held beside the old until
the root commits the round, or drops it when the round fails; a shard that exits mid-close
fails the round (``ShardLost``) with nothing committed, and the run resumes exactly after a
restart. A checkpoint's weights and outer state are written by the shards side by side, one
file each (Hugging Face's ``model-0000i-of-0000N.safetensors`` with its index, and
``matformer_outer_state-0000i-of-0000N.safetensors``), and read back on any shard count.

    group = ShardGroup.start(shapes, count=2, tied=True)
    master = group.adopt(master, carried)    # a ShardedMaster: the root's view of the weights
    new, steps, carried, broken = close_master(policy, rule, master, by_name, carried)
    group.settle(new, commit=True)           # or commit=False: the round failed
    group.stop()
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import logging
import math
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor

from matformer.modeling.checkpoint.files import (
    INDEX_NAME,
    part_file,
    read_names,
    tensor_bytes,
    write_index,
)
from matformer.modeling.checkpoint.slicing import slice_state
from matformer.modeling.compression import Region, RoundUpdate, SparseResult, Step, UpdateConfig
from matformer.modeling.compression.hashing import combine_digests, region_digests, tier_hashes
from matformer.modeling.compression.validation import all_finite
from matformer.modeling.errors import MatformerError
from matformer.server.outer_state import carried_bytes, load_carried, save_carried
from matformer.server.processes import die_with_parent
from matformer.server.update_steps import Carried

TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
START_S = 120.0  # how long the root waits for its shard processes to join
# How long a shard waits in one collective: a shard waits for the next command for as long
# as a round lasts, so it is long; a shard that dies is seen at once (its sockets close).
IDLE_TIMEOUT = datetime.timedelta(days=30)
# test hook: "exit-in-close:K" makes a shard process exit during its K-th close (from 1),
# after computing its part and before answering, as a machine lost mid-close would
FAULT_ENV = "MATFORMER_SHARD_FAULT"
# the commands that hand each shard arguments of its own
SCATTERED = ("adopt", "close", "load", "apply")

log = logging.getLogger("matformer.server")


class ShardLost(MatformerError):
    """A shard process exited or stopped answering: the round being closed is not
    committed, and no other can close until the server restarts (the run resumes from its
    last checkpoint and logged rounds)."""


def partition(shapes: Mapping[str, Sequence[int]], count: int, *, tied: bool
              ) -> list[list[str]]:
    """The canonical names each of ``count`` shards owns: contiguous runs of the model's
    order, each about a ``count``-th of the values (a tensor goes to the shard its middle
    falls in). A tied head goes with the embedding it is."""
    names = [n for n in shapes if not (tied and n == TIED_HEAD)]
    if count > len(names):
        raise ValueError(f"[coordinator] shards = {count}, but the model has only {len(names)} "
                         "parameters to share out; use at most that many shards.")
    sizes = [math.prod(shapes[n]) for n in names]
    total, done = sum(sizes), 0
    parts: list[list[str]] = [[] for _ in range(count)]
    for name, size in zip(names, sizes, strict=True):
        parts[min(count - 1, int((done + size / 2) * count / total))].append(name)
        done += size
    if tied and TIED_HEAD in shapes:
        next(p for p in parts if EMBEDDING in p).append(TIED_HEAD)
    return parts


def split_carried(carried: Carried, names: Sequence[str]) -> Carried:
    """The part of ``carried`` that belongs to ``names``."""
    keep = set(names)
    return Carried(residual={n: t for n, t in carried.residual.items() if n in keep},
                   momentum={n: t for n, t in carried.momentum.items() if n in keep},
                   buffers={kind: {n: t for n, t in by_name.items() if n in keep}
                            for kind, by_name in carried.buffers.items()})


@dataclass(slots=True)
class ShardPart:
    """What one shard process holds and does: its part of the weights and carried state, by
    version (the committed one, a close's pending one, and any a checkpoint being written
    still reads)."""

    index: int
    count: int
    tied: bool = False  # this part holds the embedding and the head that is it
    versions: dict[int, tuple[dict[str, Tensor], Carried]] = field(default_factory=dict)
    closes: int = 0  # closes computed (the fault hook counts them)

    def handle(self, op: str, common: dict[str, Any], own: Any) -> Any:
        return getattr(self, f"op_{op}")(**common, **(own or {}))

    def _version(self, version: int) -> tuple[dict[str, Tensor], Carried]:
        try:
            return self.versions[version]
        except KeyError:
            raise ValueError(f"shard {self.index} no longer holds version {version} of its "
                             "weights (a stale view of the master)") from None

    def op_adopt(self, version: int, tied: bool, master: dict[str, Tensor], carried: Carried
                 ) -> dict[str, tuple[str, tuple[int, ...]]]:
        self.tied = tied and EMBEDDING in master
        self.versions = {version: (master, carried)}
        return {n: (str(t.dtype), tuple(t.shape)) for n, t in master.items()}

    def op_load(self, version: int, tied: bool, folder: str, broadcast: Any,
                names: list[str]) -> tuple[dict[str, tuple[str, tuple[int, ...]]], bool]:
        """This shard's part of the checkpoint in ``folder``, read alone: its layout, and
        whether the checkpoint holds outer state."""
        own = [n for n in names if not (tied and n == TIED_HEAD)]
        master = {n: t.float() if t.dtype != torch.float32 else t
                  for n, t in read_names(Path(folder), own).items()}
        if tied and TIED_HEAD in names:
            master[TIED_HEAD] = master[EMBEDDING]
        carried = load_carried(Path(folder), broadcast, names=set(names))
        layout = self.op_adopt(version, tied, master, carried or Carried())
        return layout, carried is not None

    def op_apply(self, base: int, version: int, update: UpdateConfig,
                 steps: dict[str, Step]) -> None:
        """A logged round applied from its steps alone: the carried state starts from zero
        (a resume does this for a round logged without its inputs)."""
        master = dict(self._version(base)[0])
        rule = update.build()
        for name, step in steps.items():
            master[name] = rule.apply(master[name], step)
        if self.tied and EMBEDDING in steps:
            master[TIED_HEAD] = master[EMBEDDING]
        self.versions[version] = (master, Carried())

    def op_close(self, base: int, version: int, update: UpdateConfig, policy: Any,
                 by_name: dict[str, list[SparseResult]]) -> tuple[dict[str, Step], list[str], int]:
        master, carried = self._version(base)
        new, steps, carried = policy.close(update.build(), master, by_name, carried)
        if self.tied and EMBEDDING in new:
            new[TIED_HEAD] = new[EMBEDDING]
        broken = [n for n in by_name if not all_finite(new[n])]
        self.versions[version] = (new, carried)
        self.closes += 1
        _fault("exit-in-close", self.closes)
        return steps, broken, carried_bytes(carried)

    def op_keep(self, versions: list[int]) -> None:
        self.versions = {v: held for v, held in self.versions.items() if v in versions}

    def op_digests(self, version: int, regions: Mapping[int, Mapping[str, Region]]
                   ) -> dict[tuple[str, Region], bytes]:
        return region_digests(self._version(version)[0], regions)

    def op_write_weights(self, version: int, folder: str, widths: list[int] | None = None
                         ) -> tuple[str, list[str], int]:
        """This shard's weights (cut to FFN ``widths`` per layer: its part of a tier slice)
        as ``model-<i>-of-<n>.safetensors`` in ``folder``; a tied head is stored once, as its
        embedding. Returns the file, the names in it and their bytes."""
        state = {n: t for n, t in self._version(version)[0].items()
                 if not (self.tied and n == TIED_HEAD)}
        if widths is not None:
            state = slice_state(state, widths)
        state = {n: t.contiguous() for n, t in state.items()}
        file = part_file(self.index + 1, self.count)
        save_file(state, str(Path(folder) / file), metadata={"format": "pt"})
        return file, list(state), sum(tensor_bytes(t) for t in state.values())

    def op_write_carried(self, version: int, folder: str) -> None:
        save_carried(Path(folder), self._version(version)[1], part=(self.index, self.count))

    def op_fetch(self, version: int, names: list[str]) -> dict[str, Tensor]:
        master = self._version(version)[0]
        return {n: master[n] for n in names if n in master}


def _fault(kind: str, count: int) -> None:
    """The test hook ``FAULT_ENV``: exit at once, as a process killed there would."""
    wanted = os.environ.get(FAULT_ENV, "")
    if wanted == f"{kind}:{count}":
        os._exit(17)


class ShardGroup:
    """The root's side of the shards: their processes, the process group (rank 0, which
    holds no part), and which version of the weights is committed. One command at a time: a
    close, a checkpoint being written and a read of the master take turns."""

    def __init__(self, parts: list[list[str]], tied: bool,
                 processes: list[subprocess.Popen]) -> None:
        self.parts, self.tied, self.processes = parts, tied, processes
        self.owner = {name: i for i, part in enumerate(parts) for name in part}
        self.layout: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.committed = 0  # the version the run's master is
        self.carried_bytes = 0
        self._next = 1
        self._held: Counter[int] = Counter()  # versions a checkpoint being written reads
        self._lock = threading.Lock()
        self.lost: str | None = None  # why the group can no longer close, once it cannot

    @classmethod
    def start(cls, shapes: Mapping[str, Sequence[int]], count: int, *, tied: bool,
              threads: int | None = None, host: str = "", port: int = 0,
              wait_s: float = START_S) -> ShardGroup:
        """Start ``count`` shard processes on this machine and join them; shard i is rank
        i + 1 of the group, this process rank 0. ``threads``: torch threads each shard
        process computes with (default: this process's, shared out). With ``host``, start
        none: listen on ``host:port`` and wait up to ``wait_s`` for ``count`` shards started
        elsewhere (``matformer shard``, on other machines sharing the run directory)."""
        parts = partition(shapes, count, tied=tied)
        store = dist.TCPStore(host or "127.0.0.1", port if host else 0, count + 1,
                              is_master=True, timeout=datetime.timedelta(seconds=wait_s),
                              wait_for_workers=False)
        threads = threads or max(1, torch.get_num_threads() // count)
        processes = [] if host else [subprocess.Popen(
            [sys.executable, "-m", "matformer.server.shards", "--rank", str(rank),
             "--count", str(count), "--port", str(store.port), "--threads", str(threads)])
            for rank in range(1, count + 1)]
        if host:
            log.info("waiting up to %.0f s for %d shards to join at %s:%d: on each machine "
                     "run matformer shard --coordinator %s:%d --rank R --count %d (R = 1..%d)",
                     wait_s, count, host, store.port, host, store.port, count, count)
        try:
            _wait_ready(store, processes, count, wait_s)
            dist.init_process_group("gloo", store=store, rank=0, world_size=count + 1,
                                    timeout=IDLE_TIMEOUT)
        except BaseException:
            for process in processes:
                process.kill()
            raise
        log.info("closing rounds over %d shards (processes %s), %d torch threads each",
                 count, ", ".join(str(p.pid) for p in processes), threads)
        return cls(parts, tied, processes)

    @property
    def count(self) -> int:
        return len(self.parts)

    # -- commands -----------------------------------------------------------------------

    def _call(self, op: str, common: dict[str, Any], own: list[Any] | None = None) -> list[Any]:
        """Run ``op`` on every shard (``own[i]``: shard i's own arguments) and return their
        answers, in shard order. A shard that raised raises here; one that is gone raises
        ShardLost, and so does every later call."""
        with self._lock:
            if self.lost is not None:
                raise ShardLost(self.lost)
            own = own or [None] * self.count
            try:
                dist.broadcast_object_list([(op, common)], src=0)
                if op == "stop":
                    return []
                if op in SCATTERED:
                    received: list[Any] = [None]
                    dist.scatter_object_list(received, [None, *own], src=0)
                answers: list[Any] = [None] * (self.count + 1)
                dist.gather_object(("ok", None), answers, dst=0)
            except RuntimeError as err:
                self.lost = self._why_lost(op, err)
                log.error("%s", self.lost)
                raise ShardLost(self.lost) from err
        answers = answers[1:]  # the root's own
        for status, value in answers:
            if status == "error":
                raise value
        return [value for _, value in answers]

    def _why_lost(self, op: str, err: Exception) -> str:
        time.sleep(0.2)  # a process that closed its sockets is about to be reaped
        gone = [f"shard {rank} (pid {p.pid}, exit code {p.poll()})"
                for rank, p in enumerate(self.processes, start=1) if p.poll() is not None]
        who = ", ".join(gone) if gone else "a shard process"
        return (f"{who} left the close's process group during '{op}' ({str(err)[:200]}); "
                "the round was not committed. Restart the server: the run resumes from its "
                "last checkpoint and logged rounds.")

    def adopt(self, master: dict[str, Tensor], carried: Carried) -> ShardedMaster:
        """Hand each shard its part of ``master`` and ``carried``, which are emptied: the
        root keeps only its own part. Returns the view of the weights now committed."""
        version = self._take_version()
        own = [{"master": {n: master[n] for n in part}, "carried": split_carried(carried, part)}
               for part in self.parts]
        self.carried_bytes = carried_bytes(carried)
        master.clear()
        carried.residual, carried.momentum, carried.buffers = {}, {}, {}
        layouts = self._call("adopt", {"version": version, "tied": self.tied}, own)
        self.layout = {n: layout for part in layouts for n, layout in part.items()}
        del own
        _release_freed()  # what the others' parts took here goes back to the system
        self.committed = version
        return ShardedMaster(self, version)

    def load(self, folder: Path, broadcast: Any) -> tuple[ShardedMaster, bool]:
        """Each shard reads its part of the checkpoint in ``folder`` (written by any shard
        count, or by one process): the view of those weights, committed, and whether the
        checkpoint holds outer state."""
        version = self._take_version()
        answers = self._call("load", {"version": version, "tied": self.tied,
                                      "folder": str(folder), "broadcast": broadcast},
                             [{"names": part} for part in self.parts])
        self.layout = {n: layout for part, _ in answers for n, layout in part.items()}
        self.committed = version
        self.carried_bytes = 0
        return ShardedMaster(self, version), all(found for _, found in answers)

    def apply(self, master: ShardedMaster, update: UpdateConfig, steps: Mapping[str, Step]
              ) -> ShardedMaster:
        """Each shard applies its parameters' ``steps`` to ``master``: the new view,
        committed (its carried state starts from zero)."""
        version = self._take_version()
        own: list[dict[str, Any]] = [{"steps": {}} for _ in self.parts]
        for name, step in steps.items():
            own[self.owner[name]]["steps"][name] = step
        self._call("apply", {"base": master.version, "version": version, "update": update}, own)
        new = ShardedMaster(self, version)
        self.settle(new, commit=True)
        self.carried_bytes = 0
        return new

    def close(self, master: ShardedMaster, policy: Any, update: UpdateConfig,
              by_name: Mapping[str, Sequence[SparseResult]]
              ) -> tuple[ShardedMaster, dict[str, Step], list[str]]:
        """Each shard closes its part of the round from ``master``: the new (pending) view,
        every name's step, and the names the step would make not finite."""
        version = self._take_version()
        own = [{"by_name": {}} for _ in self.parts]
        for name, results in by_name.items():
            own[self.owner[name]]["by_name"][name] = list(results)
        answers = self._call("close", {"base": master.version, "version": version,
                                       "update": update, "policy": policy}, own)
        steps = {name: step for part, _, _ in answers for name, step in part.items()}
        self.carried_bytes = sum(size for _, _, size in answers)
        return ShardedMaster(self, version), steps, [n for _, broken, _ in answers
                                                     for n in broken]

    def settle(self, master: ShardedMaster, *, commit: bool) -> None:
        """Commit ``master`` as the run's weights, or drop it (the round failed)."""
        if commit:
            self.committed = master.version
        keep = sorted({self.committed, *self._held})
        # only memory is freed here: a shard lost now fails the next command instead
        with contextlib.suppress(ShardLost):
            self._call("keep", {"versions": keep})

    def hashes(self, master: ShardedMaster, regions: Mapping[int, Mapping[str, Region]]
               ) -> dict[int, str]:
        digests = {}
        for part in self._call("digests", {"version": master.version, "regions": regions}):
            digests.update(part)
        return combine_digests(self.layout, regions, digests)

    def write(self, master: ShardedMaster, folder: Path, widths: list[int] | None = None
              ) -> list[str]:
        """Each shard writes its weights (cut to ``widths``: a tier slice, as
        ``export_tiers``' ``slice_writer``) into ``folder``, the root their index: the
        files, index first."""
        answers = self._call("write_weights", {"version": master.version, "folder": str(folder),
                                               "widths": widths})
        write_index(folder, {n: file for file, names, _ in answers for n in names},
                    sum(b for _, _, b in answers))
        return [INDEX_NAME, *(file for file, _, _ in answers)]

    def write_carried(self, master: ShardedMaster, folder: Path) -> None:
        self._call("write_carried", {"version": master.version, "folder": str(folder)})

    def fetch(self, master: ShardedMaster, names: Sequence[str]) -> dict[str, Tensor]:
        fetched: dict[str, Tensor] = {}
        for part in self._call("fetch", {"version": master.version, "names": list(names)}):
            fetched.update(part)
        return fetched

    def pin(self, master: ShardedMaster) -> Callable[[], None]:
        """Keep ``master``'s version on the shards until the returned release is called
        (a checkpoint being written reads it while the next round closes)."""
        with self._lock:
            self._held[master.version] += 1

        def release() -> None:
            with self._lock:
                self._held[master.version] -= 1
                if self._held[master.version] <= 0:
                    del self._held[master.version]
        return release

    def _take_version(self) -> int:
        version, self._next = self._next, self._next + 1
        return version

    def stop(self) -> None:
        """Stop the shard processes and leave the process group."""
        if self.lost is None:
            with contextlib.suppress(ShardLost, RuntimeError):
                self._call("stop", {})
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def _release_freed() -> None:
    """glibc keeps freed heap for reuse; hand it back (a master's worth, after the adopt)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _wait_ready(store: dist.TCPStore, processes: list[subprocess.Popen], count: int,
                wait_s: float) -> None:
    """Until every shard has said it is ready in ``store``; a process of ours that exits
    first, or ``wait_s`` without all of them, is an error that says which."""
    keys = [f"ready/{rank}" for rank in range(1, count + 1)]
    deadline = time.monotonic() + wait_s
    while not store.check(keys):
        for rank, process in enumerate(processes, start=1):
            if process.poll() is not None:
                raise ShardLost(f"shard process {rank} exited with code {process.returncode} "
                                "before joining the close; its error is above.")
        if time.monotonic() > deadline:
            missing = [k.split("/")[1] for k in keys if not store.check([k])]
            raise ShardLost(f"shard(s) {', '.join(missing)} of {count} did not join within "
                            f"{wait_s:.0f} s; start them (matformer shard), or is the machine "
                            "overloaded?")
        time.sleep(0.05)


@dataclass(frozen=True, eq=False)
class ShardedMaster(Mapping[str, Tensor]):
    """The root's view of one version of the weights, which the shards hold: its names and
    layout are local; reading a tensor fetches it from its shard (for a status page or a
    test; the close, the hashes and the checkpoints never gather the weights)."""

    group: ShardGroup
    version: int

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.group.owner:
            raise KeyError(name)
        return self.group.fetch(self, [name])[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.group.layout)

    def __contains__(self, name: object) -> bool:
        return name in self.group.layout

    def items(self):  # type: ignore[override]  # one fetch, not one per name
        return self.gather().items()

    def values(self):  # type: ignore[override]
        return self.gather().values()

    def __len__(self) -> int:
        return len(self.group.layout)

    def gather(self) -> dict[str, Tensor]:
        """Every tensor, fetched from the shards at once."""
        return self.group.fetch(self, list(self.group.layout))

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * _ITEMSIZE[dtype]
                   for dtype, shape in self.group.layout.values())


_ITEMSIZE = {str(d): torch.empty((), dtype=d).element_size()
             for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


# -- one home for what differs between a master in this process and a sharded one ----------

def close_master(policy: Any, update: UpdateConfig, master: Mapping[str, Tensor],
                 by_name: Mapping[str, Sequence[SparseResult]], carried: Carried,
                 tied: Callable[[dict[str, Tensor]], dict[str, Tensor]]
                 ) -> tuple[Mapping[str, Tensor], dict[str, Step], Carried, list[str]]:
    """A round's close of ``master`` (here, or on its shards): the new master, the steps,
    the carried state (held by the shards when sharded) and the names the update would make
    not finite."""
    if isinstance(master, ShardedMaster):
        new, steps, broken = master.group.close(master, policy, update, by_name)
        return new, steps, carried, broken
    new, steps, carried = policy.close(update.build(), master, by_name, carried)
    new = tied(new)
    return new, steps, carried, [n for n, t in new.items() if not all_finite(t)]


def apply_round(entry: RoundUpdate, master: Mapping[str, Tensor],
                tied: Callable[[dict[str, Tensor]], dict[str, Tensor]]) -> Mapping[str, Tensor]:
    """``master`` after a logged round's steps (here, or on its shards, committed there)."""
    if isinstance(master, ShardedMaster):
        return master.group.apply(master, entry.update, entry.steps)
    return tied(entry.apply(master))


def hashes_of(master: Mapping[str, Tensor], regions: Mapping[int, Mapping[str, Region]]
              ) -> dict[int, str]:
    """Each tier's weight hash of ``master``, wherever its tensors are."""
    if isinstance(master, ShardedMaster):
        return master.group.hashes(master, regions)
    return tier_hashes(master, regions)


def state_bytes(master: Mapping[str, Tensor], carried: Carried) -> tuple[int, int]:
    """Bytes of the weights, and of the carried state (the shards' when sharded)."""
    if isinstance(master, ShardedMaster):
        return master.nbytes, master.group.carried_bytes
    return sum(tensor_bytes(t) for t in master.values()), carried_bytes(carried)


def settle(master: Mapping[str, Tensor], *, commit: bool) -> None:
    """A close's new master committed, or dropped (nothing to do for one in this process)."""
    if isinstance(master, ShardedMaster):
        master.group.settle(master, commit=commit)


def pin(master: Mapping[str, Tensor]) -> Callable[[], None]:
    """Keep ``master`` readable until the returned release is called."""
    if isinstance(master, ShardedMaster):
        return master.group.pin(master)
    return lambda: None


# -- a shard process ----------------------------------------------------------------------

def serve(rank: int, count: int, host: str, port: int) -> None:
    """A shard process: join the root's group and run its commands until told to stop."""
    store = dist.TCPStore(host, port, count + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=START_S))
    store.set(f"ready/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=count + 1,
                            timeout=IDLE_TIMEOUT)
    part = ShardPart(rank - 1, count)
    while True:
        received: list[Any] = [None]
        dist.broadcast_object_list(received, src=0)
        op, common = received[0]
        if op == "stop":
            break
        own: list[Any] = [None]
        if op in SCATTERED:
            dist.scatter_object_list(own, None, src=0)
        try:
            answer = ("ok", part.handle(op, common, own[0]))
        except Exception as err:
            try:
                pickle.dumps(err)
            except Exception:
                err = RuntimeError(f"shard {rank}: {type(err).__name__}: {err}")
            answer = ("error", err)
        dist.gather_object(answer, None, dst=0)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """``matformer shard``: one shard of a coordinator's close. The coordinator starts its
    own on its machine; with ``[coordinator] shard_host`` it waits for them instead, started
    by hand (or by a scheduler) on machines that share the run directory."""
    parser = argparse.ArgumentParser(
        prog="matformer shard", description="one shard of a coordinator's close "
        "([coordinator] shards); the coordinator starts its own unless [coordinator] "
        "shard_host asks it to wait for shards started elsewhere")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="[coordinator] shard_host and shard_port of the run")
    parser.add_argument("--rank", type=int, required=True, help="this shard's number, 1..count")
    parser.add_argument("--count", type=int, required=True, help="[coordinator] shards")
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: every core of this machine)")
    args = parser.parse_args(argv)
    host, port = "127.0.0.1", args.port
    if args.coordinator is not None:
        host, _, given = args.coordinator.rpartition(":")
        if not host or not given.isdigit():
            parser.error(f"--coordinator {args.coordinator!r}: give HOST:PORT, as [coordinator] "
                         "shard_host and shard_port say")
        port = int(given)
    if port is None:
        parser.error("--coordinator HOST:PORT is required")
    if not 1 <= args.rank <= args.count:
        parser.error(f"--rank {args.rank}: give 1..{args.count} (--count)")
    if args.coordinator is None:  # started by the coordinator itself: it goes with it
        die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        serve(args.rank, args.count, host, port)
    except RuntimeError as err:  # the coordinator went, or never came
        print(f"matformer shard {args.rank}: the coordinator at {host}:{port} is gone ({err}); "
              "a restarted coordinator waits for the shards again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
