"""One command that proves every CUDA path on a GPU machine and leaves its figures behind.

A GPU reaches this project now and then, for minutes. This script is what to run the moment
one does: each step below runs as a process of its own, under its own time cap and the
whole run's ``--time-limit``; whatever a step measured is written to ``gpu_check.json`` (and
a table to ``gpu_check.md``, every step's output to ``gpu_check.log``) as soon as it ends,
so a run stopped at its limit keeps what it had.

    install      the project and liger-kernel, from ``--wheels DIR`` where the machine
                 reaches no registry (``--fetch-wheels DIR`` fills it beforehand, elsewhere);
                 flash-attn only as a prebuilt wheel, else torch's own flash SDPA backend
    environment  the device, torch, CUDA, what installed
    cuda_tests   every test marked ``cuda`` (pytest -m cuda): tier slicing, Mix'n'Match,
                 packed against padded, the attention kernels, bf16 and fp16 steps,
                 torch.compile, Liger's kernels against torch's
    train_*      the training step at a ~125M and a ~1.1B Llama shape under bf16 autocast:
                 each tier's tokens/s, MFU and memory (bench/tier_throughput.py), and tier 0
                 beside transformers' LlamaForCausalLM in the same process
                 (bench/train_step_vs_hf.py)
    close_apply  the coordinator's close and a member's apply of one update at 162M, on the
                 device and on the CPU, hashes compared (bench/device_round.py)
    testnet      a three-member ``matformer testnet`` with its clients on ``--device cuda``
    nccl         data parallel over NCCL where the machine has 2+ GPUs, else skipped

    python bench/gpu_check.py --out $OUT --time-limit 460   # on the GPU machine
    python bench/gpu_check.py --dry-run                      # anywhere: the steps, as run
    python bench/gpu_check.py --fetch-wheels .whl            # with registries, beforehand

It imports nothing of the project itself, so that it runs before the project is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
DEFAULT_LIMIT_S = 460.0  # under the eight minutes the check promises, with room to stop
MIN_STEP_S = 20.0  # a step that would get less than this is not started
LOG_TAIL = 4000  # characters of a step's output kept in the JSON
FLASH_WHEEL_S = 60.0  # flash-attn is used only if a prebuilt wheel installs within this
# What the CUDA image a lent GPU machine runs already holds (torch, the scientific stack);
# --fetch-wheels fetches the project's other dependencies. Where the image lacks one, the
# install step says which.
ON_THE_IMAGE = {"torch", "numpy", "safetensors", "huggingface-hub", "tqdm", "tensorboard",
                "tokenizers"}

# name → benchmark shape flags: Llama-like, bf16 autocast, 16k tokens a step
SHAPES = {
    "125m": dict(vocab_size=32000, hidden_size=768, layers=12, heads=12, kv_heads=12,
                 intermediate_size=3072, seq_len=1024, batch_size=16),
    "1b": dict(vocab_size=32000, hidden_size=2048, layers=16, heads=32, kv_heads=8,
               intermediate_size=8192, seq_len=2048, batch_size=8),
}
TIMING = ["--steps", "6", "--repeats", "2", "--warmup", "2"]
# the steps after install and environment, in the order they run: 125m first (fast, most
# paths), then what only a GPU can say about the round, then the largest shape, whose model
# builds take longest
STEPS = ("cuda_tests", "train_125m_tiers", "train_125m_hf", "close_apply", "testnet",
         "train_1b_tiers", "train_1b_hf", "nccl")
TESTNET_ROUNDS = 30
TESTNET_DOCUMENTS = 3000


@dataclass(frozen=True)
class Machine:
    """What this machine offers the check (read without importing the project)."""

    python: str
    torch: str | None
    cuda: str | None  # torch's CUDA version; None for a CPU build
    gpus: int
    names: list[str]
    memory_gib: list[float]

    @classmethod
    def read(cls) -> Machine:
        try:
            import torch
        except ImportError:
            return cls(sys.version.split()[0], None, None, 0, [], [])
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        props = [torch.cuda.get_device_properties(i) for i in range(gpus)]
        return cls(sys.version.split()[0], torch.__version__, torch.version.cuda, gpus,
                   [p.name for p in props], [round(p.total_memory / 2**30, 1) for p in props])


@dataclass
class Step:
    name: str
    what: str  # one line: what it proves
    cap_s: float  # its own limit; the run's limit may cut it shorter
    command: list[str] | None = None  # a process; None: ``action`` runs in this process
    action: Callable[[Step, float], dict[str, Any]] | None = None
    skip: str | None = None  # why it does not run on this machine
    outputs: dict[str, Path] = field(default_factory=dict)  # what its figures come from
    # its figures and headline, from its outputs and what it printed
    read: Callable[[Step, str], dict[str, Any]] | None = None


class Check:
    """The run: steps in order, each result written out as soon as it is known."""

    def __init__(self, args: argparse.Namespace, machine: Machine, scratch: Path) -> None:
        self.args = args
        self.machine = machine
        self.scratch = scratch
        self.out: Path = args.out
        self.started = time.monotonic()
        self.results: dict[str, dict[str, Any]] = {}
        self.log = self.out / "gpu_check.log"

    def remaining(self) -> float:
        return self.args.time_limit - (time.monotonic() - self.started)

    def run(self, steps: list[Step]) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")
        for step in steps:
            self.results[step.name] = self._run(step)
            self._write()
            result = self.results[step.name]
            print(f"[gpu_check] {step.name}: {result['status']} in {result['seconds']:.0f} s"
                  f"{': ' + result['headline'] if result.get('headline') else ''}", flush=True)
        self._write()
        print(table(self.results))
        print(f"\nwrote {self.out / 'gpu_check.json'}, gpu_check.md and gpu_check.log")
        return 0 if all(r["status"] in ("passed", "skipped") for r in self.results.values()) \
            else 1

    def _run(self, step: Step) -> dict[str, Any]:
        if step.skip:
            return {"status": "skipped", "reason": step.skip, "seconds": 0.0}
        budget = min(step.cap_s, self.remaining())
        if budget < MIN_STEP_S:
            return {"status": "not run", "reason": f"the run's --time-limit "
                    f"{self.args.time_limit:g} s left {max(budget, 0):.0f} s", "seconds": 0.0}
        start = time.monotonic()
        printed = ""
        if step.action is not None:
            try:
                result = step.action(step, budget)
            except Exception as error:  # reported as the step's failure; the run goes on
                result = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
        else:
            result, printed = self._process(step, budget)
        result["seconds"] = round(time.monotonic() - start, 1)
        if step.read is not None and result["status"] != "timed out":
            try:
                result |= step.read(step, printed)
            except Exception as error:  # the step ran; only its headline is lost
                result.setdefault("error", f"its figures could not be read: "
                                           f"{type(error).__name__}: {error}")
        return result

    def _process(self, step: Step, budget: float) -> tuple[dict[str, Any], str]:
        """``step.command`` in a session of its own, killed with everything it started once
        ``budget`` seconds pass; its output goes to the log and its tail to the JSON. Returns
        the result and the output."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "a") as log:
            log.write(f"\n===== {step.name}: {' '.join(step.command)}\n")
            log.flush()
            process = subprocess.Popen(step.command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True)
            try:
                output, _ = process.communicate(timeout=budget)
                status = "passed" if process.returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                output, _ = process.communicate()
                status = "timed out"
            log.write(output)
        return {"status": status, "returncode": process.returncode, "command": step.command,
                "log_tail": output[-LOG_TAIL:]}, output

    def _write(self) -> None:
        document = {
            "machine": vars(self.machine),
            "time_limit_s": self.args.time_limit,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "steps": self.results,
        }
        _atomic(self.out / "gpu_check.json", json.dumps(document, indent=1) + "\n")
        _atomic(self.out / "gpu_check.md", table(self.results) + "\n")


def _atomic(path: Path, text: str) -> None:
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| step | status | s | result |", "| --- | --- | ---: | --- |"]
    for name, r in results.items():
        said = r.get("headline") or r.get("reason") or r.get("error") or ""
        rows.append(f"| {name} | {r['status']} | {r['seconds']:.0f} | {said} |")
    return "\n".join(rows)


# -- the steps -------------------------------------------------------------------------------

def plan(args: argparse.Namespace, machine: Machine, scratch: Path) -> list[Step]:
    python = sys.executable
    no_gpu = None if machine.gpus else (
        f"torch {machine.torch} sees no CUDA device" if machine.torch else "torch is missing")
    steps = [
        Step("install", "the project, liger-kernel and (a prebuilt wheel only) flash-attn",
             cap_s=150, action=lambda step, budget: install(args, machine, budget)),
        Step("environment", "device, torch, CUDA and kernels installed", cap_s=60,
             action=lambda step, budget: environment(machine)),
        Step("cuda_tests", "every test marked cuda", cap_s=180, skip=no_gpu,
             command=[python, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p",
                      "no:cacheprovider", f"--junitxml={scratch / 'cuda_tests.xml'}",
                      *marked_test_files()],
             outputs={"junit": scratch / "cuda_tests.xml"}, read=read_junit),
    ]
    for shape, flags in SHAPES.items():
        shape_args = [f"--{key.replace('_', '-')}={value}" for key, value in flags.items()]
        steps.append(Step(
            f"train_{shape}_tiers", f"tiers 0, 1, 2 at {shape}: tokens/s, MFU, memory",
            cap_s=150, skip=no_gpu,
            command=[python, str(BENCH / "tier_throughput.py"), *shape_args, *TIMING,
                     "--device=cuda", "--precision=bf16", "--tiers=0,1,2",
                     f"--json={scratch / f'tiers_{shape}.json'}"],
            outputs={"json": scratch / f"tiers_{shape}.json"}, read=read_tiers))
        steps.append(Step(
            f"train_{shape}_hf", f"tier 0 at {shape} beside transformers' Llama",
            cap_s=150, skip=no_gpu,
            command=[python, str(BENCH / "train_step_vs_hf.py"), *shape_args, *TIMING,
                     "--device=cuda", "--precision=bf16",
                     f"--json={scratch / f'hf_{shape}.json'}"],
            outputs={"json": scratch / f"hf_{shape}.json"}, read=read_hf))
    close = Step("close_apply", "a close and an apply at 162M, device against cpu",
                 cap_s=150, skip=no_gpu,
                 command=[python, str(BENCH / "device_round.py"), "--device=cuda",
                          f"--json={scratch / 'device_round.json'}"],
                 outputs={"json": scratch / "device_round.json"}, read=read_round)
    testnet = Step("testnet", "three members training on cuda against a coordinator",
                   cap_s=180, skip=no_gpu,
                   command=[python, "-m", "matformer.local_testnet.main", "--num-clients=3",
                            "--tiers=0,1,2", "--device=cuda", f"--rounds={TESTNET_ROUNDS}",
                            f"--documents={TESTNET_DOCUMENTS}",
                            f"--run-dir={scratch / 'testnet'}"],
                   outputs={"summary": scratch / "testnet" / "summary.json"},
                   read=read_testnet)
    nccl = Step("nccl", "two NCCL ranks give the one-GPU gradient", cap_s=120,
                skip=no_gpu or (None if machine.gpus >= 2 else
                                f"this machine has {machine.gpus} GPU; NCCL data parallel "
                                "needs 2"),
                command=[python, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p",
                         "no:cacheprovider", f"--junitxml={scratch / 'nccl.xml'}",
                         str(REPO / "tests" / "test_data_parallel.py")],
                outputs={"junit": scratch / "nccl.xml"}, read=read_junit)
    by_name = {s.name: s for s in [*steps, close, testnet, nccl]}
    order = ["install", "environment", *STEPS]
    for name in set(STEPS) - set(args.only or STEPS):  # a rerun of the steps a run left
        by_name[name].skip = by_name[name].skip or "not in --only"
    return [by_name[name] for name in order]


def marked_test_files() -> list[str]:
    """The test files that hold a test marked ``cuda``: only they are collected, so that the
    check needs none of the other tests' tools (a browser, nginx, TLS certificates)."""
    return sorted(str(path) for path in (REPO / "tests").glob("test_*.py")
                  if "mark.cuda" in path.read_text())


def install(args: argparse.Namespace, machine: Machine, budget: float) -> dict[str, Any]:
    """What the steps need, from ``--wheels`` when given (no registry), else the registries;
    already there, nothing is installed. flash-attn is only taken as a prebuilt wheel."""
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    source = ["--no-index", f"--find-links={args.wheels}"] if args.wheels else []
    commands = [[*pip, *source, "--no-build-isolation", "-e", str(REPO)]]
    if machine.gpus:  # Triton kernels and a CUDA extension: nothing a CPU machine can use
        commands += [[*pip, *source, "liger-kernel"],
                     [*pip, *source, "--only-binary=:all:", "flash-attn"]]
    if args.dry_run:
        return {"status": "planned", "commands": [" ".join(c) for c in commands]}
    done: dict[str, Any] = {"status": "passed", "commands": {}}
    deadline = time.monotonic() + budget
    for command in commands:
        package = command[-1] if command[-1] != str(REPO) else "matformer"
        if _importable(package.replace("-", "_")):
            done["commands"][package] = "already installed"
            continue
        limit = min(deadline - time.monotonic(),
                    FLASH_WHEEL_S if package == "flash-attn" else budget)
        try:
            ran = subprocess.run(command, capture_output=True, text=True, timeout=limit)
            said = "installed" if ran.returncode == 0 else (
                f"failed: {(ran.stderr or ran.stdout).strip().splitlines()[-1:]}")
        except subprocess.TimeoutExpired:
            said = f"gave up after {limit:.0f} s"
        if package == "matformer" and said != "installed":
            said = _from_its_wheel(pip, source, args.wheels, said)
            if not said.startswith("installed"):
                done["status"] = "failed"
        done["commands"][package] = said
    if machine.gpus and not done["commands"]["flash-attn"].startswith(("installed", "already")):
        done["flash_attn"] = ("no prebuilt flash-attn wheel installed; attn_impl 'flash' "
                              "falls back to sdpa, and the tests check torch's own flash "
                              "SDPA backend")
    done["headline"] = ", ".join(f"{k}: {v}" for k, v in done["commands"].items())
    return done


def _from_its_wheel(pip: list[str], source: list[str], wheels: Path | None, failed: str
                    ) -> str:
    """The project from the wheel --fetch-wheels built of it, where the editable install
    failed (a build backend the machine lacks); what happened, in words."""
    built = sorted(wheels.glob("matformer-*.whl")) if wheels else []
    if not built:
        return failed
    ran = subprocess.run([*pip, *source, str(built[-1])], capture_output=True, text=True)
    if ran.returncode != 0:
        return f"{failed}; from {built[-1].name} too: {ran.stderr.strip().splitlines()[-1:]}"
    return f"installed from {built[-1].name} (the editable install {failed})"


def _importable(module: str) -> bool:
    """Whether ``module`` imports (matformer: from this checkout, with what it needs)."""
    probe = f"import {module}"
    if module == "matformer":
        probe = ("import matformer.local_testnet.main, matformer.server.main, pathlib; "
                 f"assert pathlib.Path(matformer.__file__).is_relative_to({str(REPO)!r})")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def environment(machine: Machine) -> dict[str, Any]:
    versions = {}
    for module in ("matformer", "transformers", "liger_kernel", "flash_attn", "triton"):
        ran = subprocess.run([sys.executable, "-c", f"import importlib.metadata as m, {module}; "
                              f"print(getattr({module}, '__version__', None) or "
                              f"m.version('{module.replace('_', '-')}'))"],
                             capture_output=True, text=True)
        versions[module] = ran.stdout.strip() if ran.returncode == 0 else None
    where = ", ".join(f"{n} ({g:g} GiB)" for n, g in zip(machine.names, machine.memory_gib,
                                                          strict=True)) or "no GPU"
    return {"status": "passed", "versions": versions,
            "headline": f"{where}; torch {machine.torch}, CUDA {machine.cuda}; "
                        + ", ".join(f"{k} {v or 'missing'}" for k, v in versions.items())}


# -- reading what the steps wrote ------------------------------------------------------------

def read_junit(step: Step, printed: str) -> dict[str, Any]:
    root = ElementTree.parse(step.outputs["junit"]).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures, skips = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            problem = case.find("failure") if case.find("failure") is not None \
                else case.find("error")
            failures.append({"test": name, "message": (problem.get("message") or "")[:500]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skips.append({"test": name, "reason": case.find("skipped").get("message")})
        else:
            counts["passed"] += 1
    return {"tests": counts, "failures": failures, "skips": skips,
            "headline": ", ".join(f"{n} {k}" for k, n in counts.items())}


def read_tiers(step: Step, printed: str) -> dict[str, Any]:
    figures = json.loads(step.outputs["json"].read_text())
    said = "; ".join(
        f"t{tier} {t['tokens_per_s']:,.0f} tok/s"
        + (f" MFU {t['mfu']:.1%}" if t["mfu"] is not None else "")
        + f" step {t['step_peak_bytes'] / 2**30:.1f} GiB"
        for tier, t in figures["tiers"].items())
    peak = figures.get("device_peak_bytes")
    return {"figures": figures,
            "headline": said + (f"; device peak {peak / 2**30:.1f} GiB" if peak else "")}


def read_hf(step: Step, printed: str) -> dict[str, Any]:
    figures = json.loads(step.outputs["json"].read_text())
    models = figures["models"]
    mfu = {name: m["mfu"] for name, m in models.items()}
    return {"figures": figures, "headline": (
        f"ours {models['ours']['tokens_per_s']:,.0f} tok/s, hf "
        f"{models['hf']['tokens_per_s']:,.0f}: ours/hf {figures['throughput_ours_over_hf']:.2f}"
        + (f"; MFU ours {mfu['ours']:.1%}, hf {mfu['hf']:.1%}" if mfu["ours"] else ""))}


def read_round(step: Step, printed: str) -> dict[str, Any]:
    f = json.loads(step.outputs["json"].read_text())
    said = []
    for what in ("close", "apply"):
        if f"device_{what}_s" in f:
            said.append(f"{what} cpu {f[f'cpu_{what}_s']:.2f} s, device "
                        f"{f[f'device_{what}_s']:.2f} s, hash {f[f'{what}_hash']}")
        else:
            said.append(f"{what} failed on the device")
    failed = any(f"device_{w}_error" in f or f.get(f"{w}_hash") != "equal"
                 for w in ("close", "apply"))
    return {"figures": f, "headline": "; ".join(said),
            **({"status": "failed"} if failed else {})}


def read_testnet(step: Step, printed: str) -> dict[str, Any]:
    """The run's tiers and costs from its summary.json, and whether any member's replica
    ever left the coordinator's bits on the GPU (the member says so and reloads)."""
    summary = json.loads(step.outputs["summary"].read_text())
    kept = {key: summary.get(key) for key in ("rounds", "tokens", "wall_s", "tiers", "clients")}
    diverged = printed.count("differs from the coordinator's")
    tiers = "; ".join(f"tier {t['tier']} {_loss(t['held_out_initial'])} → "
                      f"{_loss(t['held_out_final'])}" for t in summary.get("tiers", []))
    return {"summary": kept, "hash_mismatches": diverged,
            "headline": f"{summary.get('rounds')} rounds in {summary.get('wall_s')} s; "
                        f"held-out {tiers}; replica hash mismatches: {diverged}",
            **({"status": "failed"} if diverged else {})}


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


# -- wheels for a machine without registries -------------------------------------------------

def fetch_wheels(folder: Path, python_version: str) -> int:
    """Download, for CPython ``python_version`` on x86-64 Linux, the project's dependencies
    that a CUDA image lacks (with theirs) and liger-kernel (without its own: torch and triton
    are on the image) into ``folder``, and build the project's own wheel there (installed
    where an editable install fails)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [d for d in project["dependencies"]
              if d.split(">")[0].split("=")[0].split("<")[0].strip() not in ON_THE_IMAGE]
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
            f"--python-version={python_version}", "--implementation=cp",
            *(f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                          "manylinux2014_x86_64")), f"--dest={folder}"]
    folder.mkdir(parents=True, exist_ok=True)
    own = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
           f"--wheel-dir={folder}", str(REPO)]  # pure Python: the project itself, as a wheel
    for command in ([*base, *wanted], [*base, "--no-deps", "liger-kernel"], own):
        print(" ".join(command))
        if subprocess.run(command).returncode != 0:
            return 1
    size = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"{len(list(folder.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {folder}; "
          f"then: python bench/gpu_check.py --wheels {folder}")
    return 0


# -- the command -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check",
                        help="where gpu_check.json, .md and .log go")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_LIMIT_S,
                        help="seconds for the whole check; a step is cut at what is left")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="install from this folder of wheels only (no registry)")
    parser.add_argument("--only", default=None, metavar="STEP,STEP",
                        help="run these steps alone (after install and environment), e.g. "
                             "those a run's time limit left: " + ",".join(STEPS))
    parser.add_argument("--dry-run", action="store_true",
                        help="print each step and what it would run; run nothing")
    parser.add_argument("--smoke", action="store_true",
                        help="as CI runs it: --dry-run, with its plan written as --json")
    parser.add_argument("--json", type=Path, default=None,
                        help="with --dry-run: write the plan here")
    parser.add_argument("--fetch-wheels", type=Path, default=None, metavar="DIR",
                        help="download what --wheels installs into DIR, and stop")
    parser.add_argument("--python-version", default="3.12",
                        help="--fetch-wheels: the GPU machine's Python (default 3.12)")
    args = parser.parse_args(argv)
    args.dry_run = args.dry_run or args.smoke
    if args.only is not None:
        args.only = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = sorted(set(args.only) - set(STEPS))
        if unknown:
            parser.error(f"--only {','.join(unknown)}: no such step; the steps are "
                         f"{', '.join(STEPS)}")
    if args.wheels is not None and not args.wheels.is_dir():
        parser.error(f"--wheels {args.wheels}: no such folder; fill one with "
                     f"--fetch-wheels {args.wheels} on a machine that reaches PyPI")
    return args


def dry_run(args: argparse.Namespace, steps: list[Step], machine: Machine) -> int:
    """Each step with its command, and the tests ``-m cuda`` selects, collected for real."""
    planned = {}
    for step in steps:
        what = step.command and " ".join(step.command)
        if step.name == "install":
            what = " && ".join(install(args, machine, 0)["commands"])
        missing = [part for part in (step.command or [])
                   if part.endswith(".py") and not Path(part).is_file()]
        planned[step.name] = {"what": step.what, "cap_s": step.cap_s, "runs": what,
                              "here": f"skipped: {step.skip}" if step.skip else "runs",
                              "missing": missing}
        print(f"{step.name:<18} cap {step.cap_s:>4.0f} s  {step.what}\n    {what}"
              + (f"\n    here: skipped ({step.skip})" if step.skip else ""))
        if missing:
            print(f"    MISSING: {missing}")
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p",
         "no:cacheprovider", *marked_test_files()],
        cwd=REPO, capture_output=True, text=True)
    tests = [line for line in collected.stdout.splitlines() if "::" in line]
    print(f"\npytest -m cuda selects {len(tests)} tests in {len(marked_test_files())} files")
    plan_doc = {"machine": vars(machine), "time_limit_s": args.time_limit, "steps": planned,
                "cuda_tests": tests}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(plan_doc, indent=1) + "\n")
    broken = any(p["missing"] for p in planned.values()) or collected.returncode != 0 \
        or not tests
    if collected.returncode != 0:
        print(collected.stdout[-3000:] + collected.stderr[-3000:])
    return 1 if broken else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fetch_wheels is not None:
        return fetch_wheels(args.fetch_wheels, args.python_version)
    machine = Machine.read()
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        steps = plan(args, machine, scratch)
        if args.dry_run:
            return dry_run(args, steps, machine)
        return Check(args, machine, scratch).run(steps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
