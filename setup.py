"""Packaging beyond pyproject.toml: the subpackages live in folders at the repository's root
(modeling/, server/, ...) and install under the one ``matformer`` namespace."""

from setuptools import find_packages, setup

ROOTS = ("modeling", "protocol", "server", "client", "relay", "local_testnet", "scripts")

setup(
    packages=["matformer", *(f"matformer.{name}"
                             for name in find_packages(include=[f"{r}*" for r in ROOTS]))],
    package_dir={"matformer": "matformer", **{f"matformer.{root}": root for root in ROOTS}},
)
