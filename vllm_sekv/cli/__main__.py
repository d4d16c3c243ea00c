"""`python -m vllm_sekv.cli ...` runs the `vllm-sekv` command."""
import sys

from vllm_sekv.cli import main

sys.exit(main())
