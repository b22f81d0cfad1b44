"""The code a checkpoint carries so that ``transformers`` opens any Matformer model.

A Llama-shaped model needs none: ``config.json`` says ``model_type: llama``. Any other gets

    config.json               auto_map → the two files below; external_modules_path → the
                              packed module files, relative to the checkpoint
    configuration_matformer.py, modeling_matformer.py
                              thin subclasses of ``modeling/hf_remote.py``'s classes
    <module>.py               a copy of each file of the user's own components the model
                              uses (their ``@registry.register`` runs when it is imported)

The module copies sit beside the code files, flat, because that is how transformers finds
a remote module's imports (``from .<module> import ...``) and downloads them from the Hub.
Matformer reads the same ``external_modules_path`` back, relative to the checkpoint, so a
checkpoint opens after the folder its modules came from is gone. As with transformers, that
code runs only when the user allows it (``trust_remote_code``, ``consented``), and only from
files inside the checkpoint (``packed_modules``). The checkpoint's code needs the matformer
package installed: it builds the model from it.
"""

from __future__ import annotations

import dataclasses
import inspect
import shutil
from pathlib import Path

from torch import nn

from matformer.modeling.checkpoint.files import CONFIG_NAME
from matformer.modeling.config import ModelConfig
from matformer.modeling.errors import (
    CheckpointError,
    CodeOutsideCheckpoint,
    RegistryError,
    RemoteCodeRefused,
)
from matformer.modeling.layer_spec import model_spec
from matformer.modeling.trust import refusal

CONFIG_CODE = "configuration_matformer.py"
MODEL_CODE = "modeling_matformer.py"
_PACKAGE = Path(__file__).resolve().parents[1]  # modeling/: the components that ship with us

_CONFIGURATION = '''"""The config of a Matformer model, for transformers (written by Matformer)."""

try:
    from matformer.modeling.hf_remote import MatformerConfigBase
except ImportError as error:
    raise ImportError("this checkpoint's code builds the model with the matformer package; "
                      "install it (pip install matformer).") from error


class MatformerConfig(MatformerConfigBase):
    pass
'''

_MODELING = '''"""A Matformer model, for transformers (written by Matformer):
AutoModelForCausalLM or AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).
"""

from .configuration_matformer import MatformerConfig
{imports}
try:
    from matformer.modeling.hf_remote import MatformerCausalLMBase, MatformerMaskedLMBase
except ImportError as error:
    raise ImportError("this checkpoint's code builds the model with the matformer package; "
                      "install it (pip install matformer).") from error


class MatformerForCausalLM(MatformerCausalLMBase):
    config_class = MatformerConfig


class MatformerForMaskedLM(MatformerMaskedLMBase):
    config_class = MatformerConfig
'''


def module_files(model: nn.Module) -> list[Path]:
    """The source files of the model's components that do not ship with Matformer: the
    user's own modules (``external_modules_path``), in the order the model uses them."""
    files: dict[Path, None] = {}
    for module in model.modules():
        if getattr(type(module), "matformer_implementation", None) is None:
            continue
        source = Path(inspect.getfile(type(module))).resolve()
        if not source.is_relative_to(_PACKAGE):
            files[source] = None
    return list(files)


def pack_code(config: ModelConfig, modules: list[Path], directory: Path) -> dict[str, object]:
    """Write the code files and copies of ``modules`` into ``directory``; the entries
    ``config.json`` then needs (``auto_map``, ``external_modules_path``)."""
    names = [path.name for path in modules]
    clashes = sorted({n for n in names if names.count(n) > 1 or n in (CONFIG_CODE, MODEL_CODE)})
    if clashes:
        raise CheckpointError(
            f"the model's own modules would be packed side by side under the same name "
            f"({', '.join(clashes)}); rename the module files so that their names differ "
            f"(and differ from {CONFIG_CODE} and {MODEL_CODE}).")
    for path in modules:
        if path.parent.resolve() != directory.resolve():
            shutil.copyfile(path, directory / path.name)
    imports = "".join(f"from .{Path(n).stem} import __name__ as _registers_{Path(n).stem}  "
                      f"# noqa: F401 (the model's {Path(n).stem} components)\n" for n in names)
    (directory / CONFIG_CODE).write_text(_CONFIGURATION)
    (directory / MODEL_CODE).write_text(_MODELING.format(imports=imports))
    objective = "AutoModelForCausalLM" if config.is_causal else "AutoModelForMaskedLM"
    kind = "CausalLM" if config.is_causal else "MaskedLM"
    return {
        "auto_map": {"AutoConfig": "configuration_matformer.MatformerConfig",
                     objective: f"modeling_matformer.MatformerFor{kind}"},
        "external_modules_path": names or None,
    }


def listed_modules(config: ModelConfig) -> list[Path]:
    """The module files ``config`` lists (a folder is not a list: none)."""
    listed = config.external_modules_path
    return [Path(name) for name in listed] if isinstance(listed, list) else []


def packed_modules(config: ModelConfig, directory: Path) -> ModelConfig:
    """``config`` read from ``directory``'s config.json with its module files made absolute
    there, where they were packed. Each must be a ``.py`` file directly inside ``directory``;
    an absolute path, ``..``, a folder or a symlink leading out is refused, so a checkpoint
    can never point the loader at code elsewhere on the machine. Nothing is imported here."""
    listed = config.external_modules_path
    if listed is None:
        return config
    if not isinstance(listed, list):
        raise CodeOutsideCheckpoint(
            f"{directory / CONFIG_NAME} gives external_modules_path {listed!r}, a folder; a "
            "checkpoint lists its own module files by name. Save the checkpoint again with "
            "Matformer, or remove the key if the model needs no code of its own.")
    config.external_modules_path = [str(_packed_file(directory, name)) for name in listed]
    return config


def _packed_file(directory: Path, name: str) -> Path:
    path = Path(name)
    if path.is_absolute() or len(path.parts) != 1 or path.suffix != ".py":
        raise CodeOutsideCheckpoint(
            f"{directory / CONFIG_NAME} lists module file {name!r}; a checkpoint's module "
            "files are .py files beside its config.json, named without a folder. This "
            "checkpoint points at code elsewhere: do not load it.")
    file = directory / path
    if file.exists() and not _inside(file.resolve(), directory):
        raise CodeOutsideCheckpoint(
            f"{file} is a link to {file.resolve()}, outside the checkpoint; a checkpoint's "
            "module files must be its own: do not load it.")
    return file


def _inside(real: Path, directory: Path) -> bool:
    """True when ``real`` lies in ``directory``, or, for a snapshot of the hub cache, in its
    repository's ``blobs/`` (where the cache keeps the files a snapshot links to)."""
    if real.is_relative_to(directory.resolve()):
        return True
    for folder in directory.absolute().parents:
        if folder.name == "snapshots":
            return real.parent == (folder.parent / "blobs").resolve()
    return False


def consented(config: ModelConfig, trust_remote_code: bool, source: str | Path) -> ModelConfig:
    """The config to build a checkpoint's model from, as the user allowed.

    The checkpoint's own module files are imported (run) only with ``trust_remote_code``.
    Without it they are left out, which is fine when every component the config names is
    registered here anyway (the user imported their own module); otherwise the model cannot
    be built and the refusal names the files to read before allowing them.
    """
    files = listed_modules(config)
    if not files or trust_remote_code:
        return config
    plain = dataclasses.replace(config, external_modules_path=None)
    try:
        model_spec(plain)
    except RegistryError as missing:
        raise RemoteCodeRefused(refusal(source, files, f"its model is built with ({missing})")
                                ) from None
    return plain
