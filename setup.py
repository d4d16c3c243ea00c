"""Package layout; all other metadata lives in pyproject.toml."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["vllm_sekv", "vllm_sekv.*"]))
