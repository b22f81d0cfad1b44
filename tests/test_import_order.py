"""Every module of the coordinator, the relay and the client imports on its own, first: an
import circle among them shows only when the module on it is the first one imported
(``matformer.server.coordinator`` before ``matformer.server.config`` once failed so)."""

from __future__ import annotations

import subprocess
import sys

PURGE_AND_IMPORT = r"""
import importlib, pkgutil, sys, traceback
import matformer.modeling, matformer.protocol  # kept: kernels and protobuf register once
packages = ("matformer.server", "matformer.relay", "matformer.client")
names = []
for package in packages:
    module = importlib.import_module(package)
    names += [package] + [info.name for info in pkgutil.walk_packages(module.__path__,
                                                                        package + ".")]
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m.startswith(packages)]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ":\n" + traceback.format_exc(limit=3))
print(len(names))
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_module_of_the_server_relay_and_client_imports_first():
    done = subprocess.run([sys.executable, "-c", PURGE_AND_IMPORT], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert int(done.stdout.split()[0]) > 60  # the walk found the packages' modules
